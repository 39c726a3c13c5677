"""A Flower ``Grid`` that runs a ``ClientApp`` in this process, one node after another: a ``ServerApp`` (ours,
or a workflow of Flower's such as SecAgg+) runs whole rounds against it in well under a second, without Ray.
Messages are deep-copied both ways, as serialization would, so no node sees another's objects."""
from __future__ import annotations

import copy
import uuid

from flwr.app import Context, Message, RecordDict
from flwr.app.error import Error
from flwr.serverapp import Grid
from flwr.supercore.run import Run


class LoopGrid(Grid):
    """``nodes`` SuperNodes running ``client`` with ``node_config`` partition-id / num-partitions (plus
    ``node_config(i)`` extras); a handler that raises answers with an error reply, as a SuperNode does."""

    def __init__(self, client, nodes: int, node_config=None):
        self.client, self._run = client, Run.create_empty(1)
        self.contexts = {i + 1: Context(run_id=1, node_id=i + 1, state=RecordDict(), run_config={},
                                        node_config={"partition-id": i, "num-partitions": nodes,
                                                     **(node_config(i) if node_config else {})})
                         for i in range(nodes)}
        self.replies: dict[str, Message] = {}
        self.errors: list[str] = []

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            sent = copy.deepcopy(msg)
            try:
                reply = self.client(sent, self.contexts[sent.metadata.dst_node_id])
            except Exception as e:  # noqa: BLE001 - a SuperNode answers with an error reply
                self.errors.append(f"node {sent.metadata.dst_node_id}: {e}")
                reply = Message(Error(code=0, reason=str(e)), reply_to=sent)
            reply.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            self.replies[msg.metadata.message_id] = copy.deepcopy(reply)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))

"""Federated LoRA on a tiny random Llama (made locally): only the adapters cross, the loss falls over rounds,
and the global adapters come out as an onnxruntime adapter file that ``LoraAdapter`` loads. Slow (a torch
export and three rounds of two clients: about 60 s at load 12 on 2 cores)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

flwr = pytest.importorskip("flwr")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flwr.app import RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from onnx_autodiff.federated import client_app  # noqa: E402
from onnx_autodiff.federated.model import FederatedModel  # noqa: E402
from onnx_autodiff.federated.server import GlobalModel  # noqa: E402
from onnx_autodiff.training import make_training_model  # noqa: E402
from tests.federated.test_client_server import arrays_of, as_a_server, call  # noqa: E402, F401
from tests.integration.lora_models import VOCAB, causal_lm, export_torchscript  # noqa: E402


@pytest.mark.slow
def test_federated_lora_sends_only_adapters_and_learns(tmp_path):
    base = export_torchscript(causal_lm("llama", dtype=torch.float32), str(tmp_path / "llama.onnx"))
    model = make_training_model(str(tmp_path / "llama.onnx"), "causal_lm", "adamw", lr=2e-2,
                                lora={"rank": 4, "targets": ["q_proj", "v_proj"]})
    rng = np.random.default_rng(0)
    text = np.tile(rng.integers(0, VOCAB, (1, 8)), (16, 1))  # one sentence to learn
    data = [{"input_ids": text[k::2], "attention_mask": np.ones((8, 8), np.int64)} for k in range(2)]
    fed = FederatedModel(model)
    assert fed.share == "lora" and fed.names and all("lora" in n.lower() for n in fed.names)
    app = client_app(model, lambda p, n: data[p], batch_size=4)
    glob = GlobalModel(fed, str(tmp_path / "global"), lambda s: None)
    arrays, states, losses = glob.arrays(), [RecordDict(), RecordDict()], []
    for rnd in (1, 2, 3):
        replies = [call(app, "train", arrays, k, data, {"server-round": rnd}, states[k]) for k in range(2)]
        losses.append(np.mean([r.content.metric_records["metrics"]["train_loss"] for r in replies]))
        agg, _ = FedAvg().aggregate_train(rnd, replies)
        arrays = {k: v.numpy() for k, v in agg.items()}
        glob.update(rnd, arrays)
        assert set(arrays_of(replies[0])) == set(fed.names)
    sent = sum(a.nbytes for a in arrays.values())
    full = sum(t.dims[0] * int(np.prod(t.dims[1:])) * 4 for t in base.graph.initializer if len(t.dims) == 2)
    print(f"bytes per client update: {sent} (adapters) vs {full} (the model's 2-D weights); losses {losses}")
    assert sent * 20 < full, (sent, full)  # adapters only: a small share of the model's weights
    assert losses[-1] < losses[0] - 0.1, losses
    written = glob.finish()
    adapter = [p for p in written if p.endswith(".onnx_adapter")]
    assert adapter, written
    loaded = ort.LoraAdapter()
    loaded.Load(adapter[0])
    assert onnx.load(written[0]).graph.node

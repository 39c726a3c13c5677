"""Text as training data for a causal language model: documents tokenized and packed into fixed-length rows.

``load_text(path, tokenizer, seq_len)`` reads a ``.jsonl`` file (one JSON object per line with a ``"text"``
field, or one JSON string per line) or a ``.txt`` file (one document per line), tokenizes every document
with the Hugging Face ``tokenizers`` library (the ``llm`` extra) from a ``tokenizer.json`` (the tokenizer's
own special tokens, a BOS where its post-processor adds one), ends each with the end-of-sequence token (when
the tokenizer's folder names one), and packs the stream into rows of ``seq_len`` tokens: ``input_ids``,
``attention_mask`` (1 on tokens) and ``labels`` (the token ids, -100 where a row is padded; only the last row
can be). ``causal_lm`` scores position t by the token at t + 1 and leaves -100 labels (and, with its ``mask``
option, mask-0 positions) out (docs/llm.md), so padding never counts, whichever of the two the loss reads.

``find_tokenizer(light)``: the ``tokenizer.json`` beside a model, or beside the model its training model
was made from (an onnxruntime-genai builder folder holds one) when that lies in the model's folder.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..errors import DataError
from ..model import metadata
from ..model.io import source_of

TEXT_SUFFIXES = (".jsonl", ".txt")
IGNORE = -100
_EXTRA = "pip install 'onnx-autodiff[llm]'"


class TextData(dict):
    """``{"input_ids", "attention_mask", "labels"}`` [rows, seq_len] int64, with ``tokens`` (the real tokens)
    and ``documents`` (how many were read); ``fit`` shows tokens/s for it (``count_tokens``)."""

    tokens: int = 0
    documents: int = 0

    @staticmethod
    def count_tokens(batch: dict) -> int:
        return int(np.asarray(batch["attention_mask"]).sum())

    def for_session(self, sess, say) -> TextData:
        """These rows, less the padded last one when the session's loss would count its padding: its labels
        are the token ids (not a ``labels`` input that holds the -100s) and it reads no attention mask."""
        record = metadata.read_json(sess.model, metadata.BUILDER) or {}
        labels = record.get("labels") or []
        vocab = _vocabulary(sess.model, record)
        top = int(self["input_ids"].max())
        if vocab is not None and top >= vocab:
            raise DataError(f"the text's token ids reach {top}, past the model's vocabulary of {vocab}: the tokenizer "
                            "is not the model's", "pass the tokenizer.json the model was made with")
        algorithm = sess.model.training_info[sess.index].algorithm
        masked = any("attention_mask" in n.input for n in algorithm.node)
        padded = self["attention_mask"][:, -1] == 0
        if "labels" in labels or masked or not padded.any():
            return self
        rows = ~padded
        say(f"the last row ({int(self['attention_mask'][-1].sum())} tokens) is left out: the loss reads the token "
            "ids as labels and no attention mask, so it would count the padding (make-training --loss-option "
            "mask=attention_mask counts only the tokens)")
        if not rows.any():
            raise DataError(f"the text holds {self.tokens} tokens, less than one row of {self['input_ids'].shape[1]}, "
                            "and the loss would count the padding of a short row",
                            "lower --seq-len, or build the training model with --loss-option mask=attention_mask")
        out = TextData({k: v[rows] for k, v in self.items()})
        out.tokens, out.documents = int(out["attention_mask"].sum()), self.documents
        return out


def _vocabulary(model, record: dict) -> int | None:
    """The last dim of the output the loss reads (a causal LM's logits [B, S, V]), when static."""
    outputs = {o.name: o for o in model.graph.output}
    for name in record.get("outputs") or []:
        dims = outputs[name].type.tensor_type.shape.dim if name in outputs else []
        if dims and dims[-1].HasField("dim_value"):
            return dims[-1].dim_value
    return None


def is_text(path: str | os.PathLike) -> bool:
    return os.fspath(path).lower().endswith(TEXT_SUFFIXES)


def read_documents(path: str) -> list[str]:
    """The documents of a .jsonl or .txt file (empty ones left out)."""
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist", "pass a .jsonl or .txt file of documents")
    if not is_text(path):
        raise DataError(f"{path!r} is neither .jsonl nor .txt", "text data is one JSON object with a 'text' field "
                                                                  "per line (.jsonl) or one document per line (.txt)")
    docs = []
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.lower().endswith(".txt"):
                docs.append(line.rstrip("\n"))
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path!r} line {k} is not JSON ({e.msg})",
                                'write one JSON object per line: {"text": "..."}') from e
            text = row.get("text") if isinstance(row, dict) else row
            if not isinstance(text, str):
                raise DataError(f"{path!r} line {k} has no 'text' string", 'write one JSON object per line: '
                                                                            '{"text": "..."}, or a JSON string')
            if text:
                docs.append(text)
    if not docs:
        raise DataError(f"{path!r} holds no document", "one document per line")
    return docs


def open_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` from one, from a ``tokenizer.json`` path or from a folder holding one."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise DataError("text data needs the Hugging Face tokenizers library, which is not installed", _EXTRA) from e
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    path = os.fspath(tokenizer)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {path!r} does not exist",
                        "pass the tokenizer.json of the model (a Hugging Face or onnxruntime-genai folder has one)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception types
        raise DataError(f"{path!r} is not a tokenizer.json the tokenizers library reads ({e})",
                        "pass the tokenizer.json of the model") from e


def _special_ids(tokenizer, folder: str | None) -> int | None:
    """The end-of-sequence id from the tokenizer's folder: tokenizer_config.json's ``eos_token``, else
    genai_config.json's ``eos_token_id``; None when neither names one."""
    if not folder:
        return None
    token = _json(os.path.join(folder, "tokenizer_config.json")).get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    eos = tokenizer.token_to_id(token) if isinstance(token, str) else None
    if eos is None:
        ids = _json(os.path.join(folder, "genai_config.json")).get("model", {}).get("eos_token_id")
        eos = ids[0] if isinstance(ids, list) and ids else ids if isinstance(ids, int) else None
    return eos


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def pack(sequences: list[list[int]], seq_len: int, pad: int) -> TextData:
    """The token sequences one after another in rows of ``seq_len``; the last row padded with ``pad`` (mask 0,
    label -100). The padding id must be one the model's embedding has (the end of a sequence, or 0): a
    tokenizer's own padding token may lie past the vocabulary the model was trained with."""
    if seq_len < 2:
        raise DataError(f"seq_len {seq_len}: a causal language model needs at least 2 tokens per row",
                        "for example --seq-len 256")
    stream = np.fromiter((t for s in sequences for t in s), np.int64)
    if not stream.size:
        raise DataError("the documents hold no token", "check the text and the tokenizer")
    rows = -(-stream.size // seq_len)
    ids = np.full(rows * seq_len, pad, np.int64)
    ids[:stream.size] = stream
    mask = np.zeros(rows * seq_len, np.int64)
    mask[:stream.size] = 1
    labels = np.where(mask == 1, ids, IGNORE)
    data = TextData(input_ids=ids.reshape(rows, seq_len), attention_mask=mask.reshape(rows, seq_len),
                    labels=labels.reshape(rows, seq_len))
    data.tokens = int(stream.size)
    return data


def load_text(path: str | os.PathLike, tokenizer, seq_len: int = 256) -> TextData:
    """Documents of ``path`` tokenized by ``tokenizer`` (a ``tokenizer.json``, a folder holding one, or a
    ``tokenizers.Tokenizer``) and packed into rows of ``seq_len`` (see the module docstring)."""
    path = os.fspath(path)
    docs = read_documents(path)
    tok = open_tokenizer(tokenizer)
    folder = None
    if not hasattr(tokenizer, "encode_batch"):
        where = os.fspath(tokenizer)
        folder = where if os.path.isdir(where) else os.path.dirname(os.path.abspath(where))
    eos = _special_ids(tok, folder)
    encoded = [e.ids for e in tok.encode_batch(docs)]
    if eos is not None:
        encoded = [ids if ids and ids[-1] == eos else ids + [eos] for ids in encoded]
    data = pack(encoded, seq_len, eos if eos is not None else 0)  # a padded position's id is never read, but indexed
    data.documents = len(docs)
    return data


def find_tokenizer(light, trusted=()) -> str | None:
    """The ``tokenizer.json`` beside the model ``light`` came from, or beside the inference model its training
    model was made from when that lies in the model's folder or one of ``trusted`` (``io.source_of``: a file
    names files in its own folder only); None when neither folder has one."""
    folders = [light.folder] if light.folder else []
    source = source_of(light.proto, folders + list(trusted))
    if source:
        folders.append(os.path.dirname(source))
    for folder in folders:
        path = os.path.join(folder, "tokenizer.json")
        if os.path.isfile(path):
            return path
    return None


__all__ = ["TextData", "load_text", "pack", "read_documents", "open_tokenizer", "find_tokenizer", "is_text",
           "IGNORE", "TEXT_SUFFIXES"]

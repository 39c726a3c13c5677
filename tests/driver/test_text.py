"""Text data for causal language models (driver/text.py): documents read from .jsonl / .txt, tokenized by a
tokenizer.json, packed into rows with masks and -100 labels; the tokens/s of the progress line."""
import io
import json

import numpy as np
import pytest

from onnx_autodiff.driver.progress import Progress
from onnx_autodiff.driver.text import IGNORE, TextData, find_tokenizer, load_text, pack, read_documents
from onnx_autodiff.errors import DataError

tokenizers = pytest.importorskip("tokenizers")


def word_tokenizer(folder, eos: bool = True):
    """A word-level tokenizer.json (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``w3`` ... ``w49``) that puts ``<s>``
    before each document, and a tokenizer_config.json naming ``</s>`` the end of a sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 50)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    if eos:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return folder / "tokenizer.json"


def test_pack_rows_masks_and_labels():
    data = pack([[1, 5, 6, 2], [1, 7, 2]], seq_len=3, pad=0)
    np.testing.assert_array_equal(data["input_ids"], [[1, 5, 6], [2, 1, 7], [2, 0, 0]])
    np.testing.assert_array_equal(data["attention_mask"], [[1, 1, 1], [1, 1, 1], [1, 0, 0]])
    np.testing.assert_array_equal(data["labels"], [[1, 5, 6], [2, 1, 7], [2, IGNORE, IGNORE]])
    assert data.tokens == 7 and data["input_ids"].dtype == np.int64
    with pytest.raises(DataError, match="at least 2 tokens"):
        pack([[1, 2]], seq_len=1, pad=0)


def test_load_jsonl_and_txt_with_the_folders_special_tokens(tmp_path):
    tok = word_tokenizer(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"text": "w3 w4 w5"}\n\n"w6 w7"\n')
    (tmp_path / "c.txt").write_text("w3 w4 w5\nw6 w7\n")
    for name in ("c.jsonl", "c.txt"):
        data = load_text(tmp_path / name, tok, seq_len=4)
        assert data.documents == 2 and data.tokens == 9  # <s> w.. </s> per document
        np.testing.assert_array_equal(data["input_ids"].reshape(-1)[:9], [1, 3, 4, 5, 2, 1, 6, 7, 2])
        assert data["attention_mask"].sum() == 9 and (data["labels"] == IGNORE).sum() == 3
    assert load_text(tmp_path / "c.txt", tmp_path, seq_len=4)["input_ids"].shape == (3, 4)  # the folder


def test_bad_text_is_named(tmp_path):
    tok = word_tokenizer(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "w3"}\n{"body": "w4"}\n')
    with pytest.raises(DataError, match="line 2 has no 'text'"):
        load_text(tmp_path / "bad.jsonl", tok)
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="line 1 is not JSON"):
        read_documents(str(tmp_path / "broken.jsonl"))
    with pytest.raises(DataError, match="neither .jsonl nor .txt"):
        read_documents(str(tok))
    (tmp_path / "good.txt").write_text("w3 w4\n")
    with pytest.raises(DataError, match="does not exist"):
        load_text(tmp_path / "good.txt", tmp_path / "missing.json")


def test_find_tokenizer_beside_the_model_or_its_source_in_its_folder(tmp_path):
    """The tokenizer.json beside the model, or beside the model it was made from (metadata onnx_autodiff.source)
    when that lies in the model's folder or one the caller names: a recorded path elsewhere is not read."""
    import onnx

    from onnx_autodiff.model import metadata

    class Light:
        def __init__(self, folder, source=None):
            self.folder, self.proto = str(folder), onnx.ModelProto()
            if source:
                metadata.write(self.proto, {metadata.SOURCE: json.dumps({"abspath": str(source)})})

    (tmp_path / "genai").mkdir()
    (tmp_path / "elsewhere").mkdir()
    assert find_tokenizer(Light(tmp_path)) is None
    word_tokenizer(tmp_path / "genai")
    source = tmp_path / "genai" / "model.onnx"
    assert find_tokenizer(Light(tmp_path, source)) == str(tmp_path / "genai" / "tokenizer.json")  # a subfolder
    assert find_tokenizer(Light(tmp_path / "elsewhere", source)) is None
    assert find_tokenizer(Light(tmp_path / "elsewhere", source), trusted=[tmp_path]) is not None
    assert find_tokenizer(Light(tmp_path / "genai")) == str(tmp_path / "genai" / "tokenizer.json")


def test_progress_shows_tokens_per_second():
    out = io.StringIO()
    with Progress(2, "epoch 1/1", stream=out, interval=0.0) as bar:
        bar.update(loss=1.5, tokens=512)
    assert "loss 1.5" in out.getvalue() and "tokens/s" in out.getvalue()
    assert TextData.count_tokens({"attention_mask": np.array([[1, 1, 0], [1, 0, 0]])}) == 3


def test_without_the_tokenizers_library_the_error_names_the_extra(tmp_path, monkeypatch):
    import sys

    (tmp_path / "c.txt").write_text("w3 w4\n")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    with pytest.raises(DataError, match="tokenizers library") as e:
        load_text(tmp_path / "c.txt", tmp_path / "tokenizer.json")
    assert "onnx-autodiff[llm]" in e.value.hint

"""The language-model files Hugging Face Optimum exports and transformers.js repositories publish, built from a
tiny random Llama and GPT-2 (hidden 64, 2 layers, 4 heads, vocab 1000; no downloads), for tests.

Forms (``FORMS``), each a file people hold:

* ``plain``: ``model.onnx`` of ``optimum-cli export onnx --task text-generation`` (logits only);
* ``past``: ``model.onnx`` of ``--task text-generation-with-past`` (``past_key_values.N.key|value`` in,
  ``present.N.key|value`` out; the attention mask spans ``past_sequence_length + sequence_length``);
* ``merged``: ``decoder_model_merged.onnx``: one ``If`` on ``use_cache_branch`` holding the decoder without past
  (else) and the one with past (then), their shared weights initializers of the outer graph;
* ``int8``: ``model_quantized.onnx``: ``onnxruntime.quantization.quantize_dynamic`` of ``past`` (int8 weights,
  ``DynamicQuantizeLinear`` + ``MatMulInteger`` + scale ``Mul``; the embeddings ``DequantizeLinear`` of int8);
* ``q4``: ``model_q4.onnx``: onnxruntime's ``MatMulNBitsQuantizer`` of ``past`` (4 bits, blocks of 32, symmetric;
  it quantizes MatMuls with a constant weight: Llama's projections, none of GPT-2's Gemm layers);
* ``fp16``: ``model_fp16.onnx``: ``onnxruntime.transformers.float16.convert_float_to_float16`` of ``past``.

Two routes make the same graph forms. Optimum's own (``optimum-onnx`` 0.1.0 pins transformers < 4.58, so it lives
in a venv of its own): ``python -m tests.optimum_models --optimum OUT`` there writes ``OUT/<arch>/<form>.onnx`` with
``optimum-cli`` and ``optimum.onnx.merge_decoders``; tests use those files when ``ONNX_AUTODIFF_OPTIMUM_FILES``
names ``OUT``. Without it (CI) the files are made here: torch's TorchScript exporter (opset 18) through a wrapper
that takes and returns the cache as Optimum's export does, our own merge (``merge_decoders`` below: identical
initializers shared in the outer graph, one ``If``), and the same onnxruntime quantizers. Both routes' node counts
per op type agree within a few shape-arithmetic nodes (``tests/integration/test_optimum_files.py`` prints them);
the model maths (the masking ``Where`` / ``IsNaN`` around ``Softmax``, the projections, the quantized forms) is the
same. Each file is built once per test session.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from onnx_autodiff.graph import set_nodes, topological_sort

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCHS = ("llama", "gpt2")
FORMS = ("plain", "past", "merged", "int8", "q4", "fp16")
VOCAB = 1000
LAYERS = 2
OPSET = 18
FILES_ENV = "ONNX_AUTODIFF_OPTIMUM_FILES"
# the LoRA targets of each family's attention (Llama's q/v projections, GPT-2's fused c_attn)
ATTENTION = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def hf_model(arch: str, folder: Path, seed: int = 0) -> Path:
    """A random ``arch`` model saved in ``folder``. Weights are drawn with a standard deviation of 0.2 (transformers'
    0.02 gives near-uniform logits), biases and norm weights as well (transformers starts them at 0 and 1)."""
    import torch
    import transformers as tf

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=False,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, n_positions=128,
                                                 initializer_range=0.2, bos_token_id=1, eos_token_id=2))
    else:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name or ".ln_" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(folder)
    return folder


def cache_names(n_layers: int = LAYERS) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    return past, [p.replace("past_key_values", "present") for p in past]


# ---- the TorchScript route ------------------------------------------------------------------------------

def flat_module(model, n_layers: int, past_in: bool, present_out: bool, order: list[str]):
    """A module taking Optimum's flat inputs (``order``) and returning logits (and the presents)."""
    import torch
    from transformers import DynamicCache

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *args):
            kw = dict(zip(order, args))
            cache = None
            if past_in:
                cache = DynamicCache()
                for i in range(n_layers):
                    cache.update(kw[f"past_key_values.{i}.key"], kw[f"past_key_values.{i}.value"], i)
            elif present_out:
                cache = DynamicCache()
            out = self.m(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"],
                         position_ids=kw["position_ids"], past_key_values=cache, use_cache=present_out)
            if not present_out:
                return out.logits
            presents = []
            for layer in out.past_key_values.layers:
                presents += [layer.keys, layer.values]
            return (out.logits, *presents)

    return Flat()


def torch_export(arch: str, hf, out: Path, past_in: bool, present_out: bool, dtype=None) -> Path:
    """``out``: the model of ``hf`` (a folder, or a transformers model) exported by TorchScript at opset 18 with
    Optimum's input and output names, order and dynamic axes (``dtype``: torch's, float32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    # a copy of a model given: tracing GPT-2 leaves it computing differently afterwards (transformers 5.24)
    model = copy.deepcopy(hf) if isinstance(hf, torch.nn.Module) else AutoModelForCausalLM.from_pretrained(
        hf, attn_implementation="sdpa").eval()
    dtype = dtype or torch.float32
    model = model.to(dtype)
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head = cfg.hidden_size // cfg.num_attention_heads
    past, present = cache_names(cfg.num_hidden_layers)
    b, s, p = 2, 3, (4 if past_in else 0)
    total = "past_sequence_length + sequence_length" if past_in else "sequence_length"
    values = {"input_ids": torch.randint(3, VOCAB, (b, s)), "attention_mask": torch.ones(b, p + s, dtype=torch.int64),
              "position_ids": torch.arange(p, p + s).expand(b, s).contiguous()}
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"}, "attention_mask": {0: "batch_size", 1: total},
            "position_ids": {0: "batch_size", 1: "sequence_length"}, "logits": {0: "batch_size", 1: "sequence_length"}}
    order = ["input_ids"] + (past if past_in and arch == "gpt2" else []) + ["attention_mask", "position_ids"]
    order += past if past_in and arch != "gpt2" else []
    for name in past:
        values[name] = torch.randn(b, n_kv, p, head, dtype=dtype)
        axes[name] = {0: "batch_size", 2: "past_sequence_length"}
    for name in present:
        axes[name] = {0: "batch_size", 2: total}
    outputs = ["logits"] + (present if present_out else [])
    inputs = order if past_in else [n for n in order if not n.startswith("past_key_values")]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(flat_module(model, cfg.num_hidden_layers, past_in, present_out, inputs),
                          tuple(values[n] for n in inputs), str(out), dynamo=False, opset_version=OPSET,
                          input_names=inputs, output_names=outputs,
                          dynamic_axes={k: v for k, v in axes.items() if k in inputs + outputs})
    exported = unwrapped(onnx.load(out))
    onnx.save(tie_transposed(exported) if cfg.tie_word_embeddings else exported, out)
    return out


def unwrapped(model: onnx.ModelProto) -> onnx.ModelProto:
    """The wrapper's attribute ``m`` out of the names (``m.model.layers.0...`` -> ``model.layers.0...``, node
    ``/m/model/...`` -> ``/model/...``), as Optimum names them."""
    def name(text: str) -> str:
        return text[2:] if text.startswith("m.") else ("/" + text[3:] if text.startswith("/m/") else text)

    g = model.graph
    for t in g.initializer:
        t.name = name(t.name)
    for vi in g.value_info:
        vi.name = name(vi.name)
    for n in g.node:
        n.name = name(n.name)
        n.input[:] = [name(i) for i in n.input]
        n.output[:] = [name(o) for o in n.output]
    return model


def tie_transposed(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each 2-D initializer ``onnx::...`` equal to another one transposed becomes ``Transpose`` of it, output
    ``<other>_transposed``, as Optimum writes tied weights (TorchScript exports GPT-2's lm_head as a transposed
    copy of the embedding)."""
    g = model.graph
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer if len(t.dims) == 2}
    copies = {}
    for name, a in arrays.items():
        if not name.startswith("onnx::"):
            continue
        for other, b in arrays.items():
            if other != name and other not in copies and a.shape == b.shape[::-1] and np.array_equal(a, b.T):
                copies[name] = other
                break
    keep = [t for t in g.initializer if t.name not in copies]
    del g.initializer[:]
    g.initializer.extend(keep)
    renamed = {name: f"{source}_transposed" for name, source in copies.items()}
    for n in g.node:
        n.input[:] = [renamed.get(i, i) for i in n.input]
    for name, source in copies.items():
        g.node.append(helper.make_node("Transpose", [source], [renamed[name]], name=f"Transpose_{len(g.node)}",
                                       perm=[1, 0]))
    set_nodes(g, topological_sort(list(g.node)))
    return model


def _digest(t: onnx.TensorProto) -> tuple:
    return t.data_type, tuple(t.dims), hashlib.sha1(onnx.numpy_helper.to_array(t).tobytes()).hexdigest()


def merge_decoders(decoder: onnx.ModelProto, with_past: onnx.ModelProto) -> onnx.ModelProto:
    """The merged decoder of a decoder without past inputs (``decoder``, whose outputs include the presents) and
    one with them: an ``If`` on a new bool input ``use_cache_branch`` [1], then = with past, else = without; the
    outputs of both branches carry the If's output names. Initializers of equal value become one initializer of
    the outer graph (first name kept) that both branches read; the branches keep none."""
    outer, by_digest = [], {}
    branches = []
    for m in (with_past, decoder):
        g = onnx.GraphProto()
        g.CopyFrom(m.graph)
        rename = {}
        for t in g.initializer:
            key = _digest(t)
            if key not in by_digest:
                name = t.name if t.name not in {o.name for o in outer} else f"{t.name}_merged_{len(outer)}"
                kept = onnx.TensorProto()
                kept.CopyFrom(t)
                kept.name = name
                outer.append(kept)
                by_digest[key] = name
            rename[t.name] = by_digest[key]
        for n in g.node:
            n.input[:] = [rename.get(i, i) for i in n.input]
        del g.initializer[:]
        del g.input[:]
        branches.append(g)
    then_g, else_g = branches
    then_g.name, else_g.name = "merged_with_past", "merged_no_past"
    names = [o.name for o in with_past.graph.output]
    if [o.name for o in decoder.graph.output] != names:
        raise ValueError("the two decoders must have the same outputs")
    else_g.output.sort(key=lambda o: names.index(o.name))
    inputs = list(decoder.graph.input)
    seen = {i.name for i in inputs}
    inputs += [i for i in with_past.graph.input if i.name not in seen]
    inputs.append(helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1]))
    node = helper.make_node("If", ["use_cache_branch"], names, name="merged::if", then_branch=then_g,
                            else_branch=else_g)
    graph = helper.make_graph([node], "merged", inputs, list(with_past.graph.output), initializer=outer)
    merged = helper.make_model(graph, opset_imports=list(with_past.opset_import), producer_name="onnx-autodiff tests")
    merged.ir_version = with_past.ir_version
    onnx.checker.check_model(merged)
    return merged


# ---- the variants (the same on both routes) -------------------------------------------------------------

def _quietly(fn, *args, **kwargs):
    quiet = logging.getLogger("onnxruntime.quantization")
    root = logging.getLogger()
    levels = quiet.level, root.level
    quiet.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return fn(*args, **kwargs)
    finally:
        quiet.setLevel(levels[0])
        root.setLevel(levels[1])


def variant(form: str, past: Path, out: Path) -> Path:
    """``out``: ``past`` quantized (``int8``, ``q4``) or converted to float16 (``fp16``) as transformers.js does."""
    if form == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        _quietly(quantize_dynamic, str(past), str(out), weight_type=QuantType.QInt8)
    elif form == "q4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        q = MatMulNBitsQuantizer(onnx.load(past), block_size=32, is_symmetric=True)
        _quietly(q.process)
        onnx.save(q.model.model, out)
    elif form == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        onnx.save(_quietly(convert_float_to_float16, onnx.load(past)), out)
    else:
        raise ValueError(f"no variant {form!r}")
    return out


def build(arch: str, form: str, root: Path) -> Path:
    """``root/<arch>/<form>.onnx`` (made on the TorchScript route unless it exists)."""
    folder = Path(root) / arch
    path = folder / f"{form}.onnx"
    if path.exists():
        return path
    hf = hf_model(arch, Path(root) / f"hf-{arch}")
    if form == "plain":
        return torch_export(arch, hf, path, past_in=False, present_out=False)
    if form == "past":
        return torch_export(arch, hf, path, past_in=True, present_out=True)
    if form == "merged":
        decoder = torch_export(arch, hf, folder / "decoder_model.onnx", past_in=False, present_out=True)
        onnx.save(merge_decoders(onnx.load(decoder), onnx.load(build(arch, "past", root))), path)
        return path
    return variant(form, build(arch, "past", root), path)


class OptimumModels:
    """The files of ``FORMS`` made on first request and kept for the session: ``get("llama", "int8")`` -> path.
    With ``ONNX_AUTODIFF_OPTIMUM_FILES`` set, Optimum's own files from that folder."""

    def __init__(self, root: Path):
        self.root = Path(root)
        given = os.environ.get(FILES_ENV)
        self.given = Path(given) if given else None

    @property
    def route(self) -> str:
        return "optimum-cli" if self.given is not None else "torch.onnx (TorchScript)"

    def get(self, arch: str, form: str) -> Path:
        if self.given is not None:
            path = self.given / arch / f"{form}.onnx"
            if not path.exists():
                raise FileNotFoundError(f"{FILES_ENV}={self.given} has no {arch}/{form}.onnx")
            return path
        return build(arch, form, self.root)

    def hf(self, arch: str) -> Path:
        """The transformers model the files were made from."""
        if self.given is not None:
            return self.given / f"hf-{arch}"
        return hf_model(arch, self.root / f"hf-{arch}")


def feeds(model_path, ids: np.ndarray, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Training feeds for a file of ``FORMS``: the ids, the mask (ones by default), position ids as transformers
    derives them from the mask (cumsum - 1, 1 where masked), an empty past and ``use_cache_branch`` False where
    the model takes them."""
    model = onnx.load(str(model_path), load_external_data=False)
    mask = np.ones_like(ids) if mask is None else mask
    positions = np.where(mask == 0, 1, np.cumsum(mask, axis=1) - 1)
    out = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64),
           "position_ids": positions.astype(np.int64)}
    for i in model.graph.input:
        tt = i.type.tensor_type
        if i.name.startswith("past_key_values."):
            dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim]
            dims[0] = ids.shape[0]
            out[i.name] = np.zeros(dims, helper.tensor_dtype_to_np_dtype(tt.elem_type))
        elif i.name == "use_cache_branch":
            out[i.name] = np.array([False])
    names = {i.name for i in model.graph.input}
    return {k: v for k, v in out.items() if k in names}


def vit_classifier(out: Path, seed: int = 0) -> Path:
    """A tiny random ViT image classifier (16x16 images in 8x8 patches: 4 patches and a class token, hidden 64, one
    layer, GELU through Erf, 5 labels) exported as Optimum's image-classification task exports it: opset 17,
    ``pixel_values`` with every dim symbolic (``batch_size, num_channels, height, width``), ``logits``."""
    import torch
    import transformers as tf

    out = Path(out)
    if out.exists():
        return out
    cfg = tf.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=128, num_labels=5)
    torch.manual_seed(seed)
    model = tf.ViTForImageClassification(cfg).eval()
    axes = {"pixel_values": {0: "batch_size", 1: "num_channels", 2: "height", 3: "width"}, "logits": {0: "batch_size"}}
    out.parent.mkdir(parents=True, exist_ok=True)
    _quietly(torch.onnx.export, model, (torch.randn(1, 3, 16, 16),), str(out), input_names=["pixel_values"],
             output_names=["logits"], dynamic_axes=axes, opset_version=17, dynamo=False)
    return out


def bert_classifier(out: Path, seed: int = 0) -> Path:
    """A tiny random BERT text classifier (hidden 64, 2 layers, GELU through Erf, 3 labels) exported as Optimum's
    text-classification task exports it: opset 17, ``input_ids``, ``attention_mask``, ``token_type_ids`` of
    symbolic ``batch_size, sequence_length``, ``logits``."""
    import torch
    import transformers as tf

    out = Path(out)
    if out.exists():
        return out
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(seed)
    model = tf.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(3, VOCAB, (1, 6))
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {**{n: {0: "batch_size", 1: "sequence_length"} for n in names}, "logits": {0: "batch_size"}}
    out.parent.mkdir(parents=True, exist_ok=True)
    _quietly(torch.onnx.export, model, (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(out),
             input_names=names, output_names=["logits"], dynamic_axes=axes, opset_version=17, dynamo=False)
    return out


def optimum_route(out: Path) -> None:
    """Optimum's own files in ``out`` (run in a venv with optimum-onnx 0.1.0, transformers < 4.58)."""
    import subprocess

    from optimum.exporters.onnx import export
    from optimum.exporters.tasks import TasksManager
    from optimum.onnx import merge_decoders as optimum_merge
    from transformers import AutoModelForCausalLM

    out = Path(out)
    for arch in ARCHS:
        hf = hf_model(arch, out / f"hf-{arch}")
        folder = out / arch
        folder.mkdir(parents=True, exist_ok=True)
        for form, task in (("plain", "text-generation"), ("past", "text-generation-with-past")):
            tmp = out / f"cli-{arch}-{form}"
            subprocess.run(["optimum-cli", "export", "onnx", "-m", str(hf), "--task", task, "--opset", str(OPSET),
                            str(tmp)], check=True, capture_output=True)
            (tmp / "model.onnx").replace(folder / f"{form}.onnx")
        model = AutoModelForCausalLM.from_pretrained(hf)
        ctor = TasksManager.get_exporter_config_constructor("onnx", model, task="text-generation-with-past",
                                                            library_name="transformers")
        config = ctor(model.config, task="text-generation", use_past=True, use_past_in_inputs=False)
        export(model, config, folder / "decoder_model.onnx", opset=OPSET)
        optimum_merge(folder / "decoder_model.onnx", folder / "past.onnx", save_path=str(folder / "merged.onnx"))
        for form in ("int8", "q4", "fp16"):
            variant(form, folder / "past.onnx", folder / f"{form}.onnx")
        print(f"wrote {folder}: {', '.join(FORMS)}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--optimum":
        optimum_route(Path(sys.argv[2]))
    else:
        root = Path(sys.argv[1] if len(sys.argv) > 1 else "optimum-models")
        for a in ARCHS:
            for f in FORMS:
                print(build(a, f, root))

"""The argparse parser of the onnx-autodiff command: one subcommand per command function."""
from __future__ import annotations

import argparse

from ..runtimes.targets import RUNNERS, RUNTIMES, TARGETS
from .checks import cmd_check, cmd_conformance, cmd_gradcheck
from .commands import (
    cmd_demo,
    cmd_export,
    cmd_export_adapter,
    cmd_export_step,
    cmd_lower,
    cmd_make_training,
    cmd_rules,
)
from .common import CHECKPOINT, PROG
from .federated import add_parsers as add_federated_parsers
from .forward import add_parsers as add_forward_parsers
from .train import cmd_import_state, cmd_train

# ---- the parser ---------------------------------------------------------------------------------

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        installed = version("onnx-autodiff")
    except PackageNotFoundError:
        installed = None
    return __version__ if installed in (None, __version__) else f"{__version__} (installed metadata: {installed})"


def _loss_help() -> str:
    from ..training.losses import LOSSES

    names = [f"{name}{' (default)' if name == 'cross_entropy' else ''}"
             + (f" [also {', '.join(loss.aliases)}]" if loss.aliases else "") for name, loss in LOSSES.items()]
    return ("a built-in loss: " + "; ".join(names) + " (the names in brackets are accepted aliases); or a loss "
            "graph FILE.onnx; several outputs: OUTPUT=LOSS[:WEIGHT], repeated. Any other name is refused")


def _targets_help() -> str:
    return "; ".join(f"{name}: {t.about}" for name, t in sorted(TARGETS.items()))


class _Formatter(argparse.HelpFormatter):
    """Every option that takes a value and has a default says it: ``(default: X)`` after its help, unless the
    help already places ``%(default)s`` itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" not in text and action.option_strings and action.nargs != 0
                and action.default not in (None, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser with ``_Formatter``: the subcommands' parsers are made by this class."""

    def __init__(self, *args, formatter_class=_Formatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


QUIET_HELP = ("nothing on stderr but errors: no progress bar, no stage messages (the results still print on "
              "stdout)")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)  # --debug after the command: it must not reset one before it
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    p = _Parser(prog=PROG,
                                description="Lower the ONNX training spec to plain ONNX and train with stock "
                                            "onnxruntime.")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    _lower(sub, common)
    _make_training(sub, common)
    _train(sub, common)
    _import_state(sub, common)
    _export(sub, common)
    _export_step(sub, common)
    _export_adapter(sub, common)
    _check(sub, common)
    _gradcheck(sub, common)
    _conformance(sub, common)
    _rules(sub, common)
    add_forward_parsers(sub, common)  # jvp, hvp, jacobian
    add_federated_parsers(sub, common)  # federated simulate
    _demo(sub, common)
    return p


def _lower(sub, common) -> None:
    s = sub.add_parser("lower", parents=[common], help="lower Gradient / optimizer / training nodes to standard ONNX")
    s.add_argument("input", metavar="IN", help="the model with Gradient / optimizer / training nodes (.onnx)")
    s.add_argument("output", metavar="OUT", help="where the lowered model goes (.onnx)")
    s.add_argument("--target-opset", type=int, metavar="N",
                   help="convert the model to this opset first (onnx.version_converter); by default it keeps its "
                        "opset unless a gradient needs a newer one")
    s.set_defaults(run=cmd_lower)


def _make_training(sub, common) -> None:
    s = sub.add_parser("make-training", parents=[common],
                       help="add a loss, a Gradient node and an optimizer (a TrainingInfoProto) to an inference model")
    s.add_argument("input", metavar="IN", help="the inference model (.onnx)")
    s.add_argument("output_path", metavar="OUT", help="where the training model goes (.onnx)")
    s.add_argument("--loss", action="append", metavar="LOSS", help=_loss_help())
    s.add_argument("--optimizer", default="adam", help="sgd, momentum, nesterov, adagrad, adam, adamw")
    s.add_argument("--lr", type=float, default=1e-3, help="learning rate recorded as the default for train")
    s.add_argument("--trainable", nargs="+", action="extend", metavar="PATTERN",
                   help="initializers to train: names or glob patterns (default: every float initializer)")
    s.add_argument("--frozen", nargs="+", action="extend", metavar="PATTERN", help="initializers to keep fixed")
    s.add_argument("--output", action="append", metavar="NAME",
                   help="the model output the loss reads (default: the first)")
    s.add_argument("--label", action="append", metavar="NAME",
                   help="label input name (default: labels); OUTPUT=NAME for several")
    s.add_argument("--momentum", type=float,
                   help="momentum and nesterov: the momentum factor (default: 0.9)")
    s.add_argument("--dampening", type=float, help="momentum and nesterov: dampening of the momentum (default: 0)")
    s.add_argument("--weight-decay", type=float,
                   help="L2 penalty (decoupled for adamw) (default: 0; adamw 0.01, as torch.optim.AdamW)")
    s.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"),
                   help="adam and adamw: the moving averages' coefficients (default: 0.9 0.999)")
    s.add_argument("--eps", type=float, help="adam, adamw, adagrad: added to the denominator (default: 1e-8; "
                                             "adagrad 1e-10)")
    s.add_argument("--lr-decay", type=float, help="adagrad: learning-rate decay (default: 0)")
    s.add_argument("--loss-option", action="append", metavar="KEY=VALUE",
                   help="an option of the loss: axis=-1 (cross_entropy's class axis), mask=attention_mask (causal_lm)")
    s.add_argument("--lora-rank", type=int, metavar="R", help="train LoRA adapters of rank R instead of the weights")
    s.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA scale alpha (alpha/rank; default 8)")
    s.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default 0)")
    s.add_argument("--lora-base-backward", choices=("float32", "int8"),
                   help="the input gradient through a frozen int4 (MatMulNBits) base: float32 (default) or int8, "
                        "faster on onnxruntime's int8 kernels, ~1%% off (docs/llm.md)")
    s.add_argument("--lora-targets", metavar="NAMES",
                   help="comma-separated modules, weights or nodes to adapt (globs allowed): q_proj,v_proj; "
                        "or a preset: attention, mlp, all")
    s.add_argument("--memory-budget", metavar="SIZE",
                   help="let the backward recompute cheap activations until the step's estimated peak fits SIZE "
                        "(2GiB, 500MB, bytes, or auto: the memory available now); needs networkx")
    s.add_argument("--budget-dim", action="append", metavar="NAME=SIZE",
                   help="the size of a symbolic input dim for the memory estimate (repeat: --budget-dim batch=32)")
    s.add_argument("--precision", choices=["fp16", "bf16"],
                   help="mixed precision: forward and backward in float16/bfloat16 (a float32 model is converted), "
                        "float32 masters and optimizer state, dynamic loss scaling for fp16 (a float16/bfloat16 "
                        "model trains so by default)")
    s.set_defaults(run=cmd_make_training)


def _train(sub, common) -> None:
    s = sub.add_parser("train", parents=[common], help="train a training model on an .npz, with checkpoints")
    s.add_argument("model", metavar="MODEL", help="the training model (make-training) or a checkpoint")
    s.add_argument("--data", required=True, metavar="DATA",
                   help="an .npz of arrays named like the model inputs, or X (first input) and y (label); or text "
                        "for a language model: .jsonl ({\"text\": ...} per line) or .txt (a document per line)")
    s.add_argument("--tokenizer", metavar="tokenizer.json",
                   help="text data: the Hugging Face tokenizer (default: the tokenizer.json beside MODEL, or beside "
                        "the model it was made from when that is in MODEL's folder; needs the llm extra)")
    s.add_argument("--seq-len", type=int, default=256, metavar="N",
                   help="text data: tokens per row; documents are packed one after another")
    s.add_argument("--epochs", type=int, default=10, metavar="N", help="passes over the data")
    s.add_argument("--batch-size", type=int, default=32, metavar="N", help="samples per step")
    s.add_argument("--lr", type=float, help="learning rate fed at every step (default: the one make-training recorded)")
    s.add_argument("--checkpoint", required=True, metavar="DIR",
                   help=f"directory for {CHECKPOINT} (weights, optimizer state and the training state in one file); "
                        "training resumes from it; one trainer at a time")
    s.add_argument("--seed", type=int, default=0, help="shuffling seed")
    s.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                   help="keep the samples in the file's order (by default each epoch shuffles them with --seed)")
    s.add_argument("--export", metavar="OUT", help="also write the trained inference model")
    s.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    s.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="run each batch as K micro-batches and update once (same result, less memory)")
    s.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="under torchrun: how long a process waits for the others before failing")
    s.add_argument("--runtime", default="onnxruntime", choices=RUNNERS,
                   help="train on this runtime: webgpu trains as onnxruntime does, on its WebGPU execution provider "
                        "(docs/gpu.md); the others train a step bundle in DIR/bundle/ (docs/runtimes.md); "
                        "every runtime writes the same checkpoint and resumes from it")
    s.set_defaults(run=cmd_train)


def _import_state(sub, common) -> None:
    s = sub.add_parser("import-state", parents=[common],
                       help="the inference model with the weights of a state file (.npz) or a checkpoint")
    s.add_argument("model", help="the training model the bundle was exported from")
    s.add_argument("state", help="the state file (.npz of {state input: array}) or a checkpoint (DIR/checkpoint.onnx)")
    s.add_argument("output", metavar="OUT", help="where the inference model goes (.onnx)")
    _base_option(s)
    s.set_defaults(run=cmd_import_state)


def _base_option(s) -> None:
    s.add_argument("--base", metavar="MODEL",
                   help="the model a LoRA checkpoint's frozen weights are in, when it is not in the checkpoint's "
                        "folder (files outside a model's folder are read only when you name them)")


def _export(sub, common) -> None:
    s = sub.add_parser("export", parents=[common], help="the inference model with the trained weights")
    s.add_argument("model", metavar="MODEL", help="a checkpoint (train) or a training model")
    s.add_argument("output", metavar="OUT", help="where the inference model goes (.onnx)")
    _base_option(s)
    s.add_argument("--adapters", choices=("merged", "inputs"), default="merged",
                   help="LoRA adapters merged into the weights (default), or kept as graph inputs for "
                        "onnxruntime's LoraAdapter files")
    s.set_defaults(run=cmd_export)


def _export_step(sub, common) -> None:
    s = sub.add_parser("export-step", parents=[common],
                       help="a step bundle (step.onnx, init.onnx, bundle.json) any ONNX runtime can train")
    s.add_argument("model", help="a training model (make-training) or a checkpoint")
    s.add_argument("out_dir", help="the bundle directory (created if needed)")
    _base_option(s)
    s.add_argument("--target", default="portable", choices=sorted(TARGETS), metavar="TARGET",
                   help=f"the runtime the bundle is for, one of {', '.join(sorted(TARGETS))} (default: %(default)s, "
                        f"what every runtime here takes). {_targets_help()}")
    s.add_argument("--dim", action="append", metavar="NAME=SIZE",
                   help="the size of a symbolic dim (repeat: --dim N=32): the step takes batches of that size only "
                        "and computes no shapes at run time (on WebGPU no node runs on the CPU)")
    s.set_defaults(run=cmd_export_step)


def _export_adapter(sub, common) -> None:
    s = sub.add_parser("export-adapter", parents=[common],
                       help="the LoRA adapters of a training model or checkpoint, for PEFT or onnxruntime")
    s.add_argument("model", metavar="CKPT", help="a checkpoint or training model with LoRA adapters")
    s.add_argument("out_dir", metavar="OUT_DIR", help="the folder the adapter files go to (created if needed)")
    s.add_argument("--format", choices=("peft", "onnxruntime", "genai"), default="peft",
                   help="peft: adapter_model.safetensors + adapter_config.json; onnxruntime: adapter.onnx_adapter; "
                        "genai: OUT_DIR becomes a copy of the onnxruntime-genai folder the model was made from with "
                        "its model adapter-ready, plus adapter.onnx_adapter (og.Adapters loads it)")
    s.add_argument("--prefix", help="peft: a leading part of the module paths to drop (a wrapper's 'm.'); it must "
                                    "end where a module name ends (a dot follows)")
    _base_option(s)
    s.add_argument("--family", metavar="NAME",
                   help="peft: the Hugging Face family of a model builder's model (genai_config.json's model.type: "
                        "llama, qwen2, phi3, ...), which names its modules (phi3 fuses gate_proj/up_proj into "
                        "gate_up_proj); default: the one the training model recorded, else its builder folder's")
    s.add_argument("--genai-folder", metavar="FOLDER",
                   help="genai: the model builder's folder the training model was made from (default: the one it "
                        "records, when that is in the folder of CKPT or of --base)")
    s.set_defaults(run=cmd_export_adapter)


def _check(sub, common) -> None:
    s = sub.add_parser("check", parents=[common],
                       help="gradcheck the first float output w.r.t. the float initializers; with --target, whether "
                            "the model trains on a runtime")
    s.add_argument("model", metavar="MODEL", help="the model to check (.onnx; a training model's inference graph)")
    _gradcheck_options(s)
    s.add_argument("--target", choices=sorted(TARGETS), metavar="TARGET",
                   help=f"instead of gradchecking, whether the model trains (or runs) on this runtime, one of "
                        f"{', '.join(sorted(TARGETS))}: what it lacks, the step lowered for it, and, where the "
                        "runtime is installed, one step run on it against onnxruntime (exit 1 when it would fail); "
                        "for webgpu also every node onnxruntime would run on the CPU")
    s.add_argument("--dim", action="append", metavar="NAME=SIZE",
                   help="the size of a symbolic input dim (repeat: --dim N=32): of the inputs the gradcheck makes "
                        "(default: what the graph allows, a Conv's channels and spatial sizes, else by name); with "
                        "--target as export-step --dim")
    s.set_defaults(run=cmd_check)


def _gradcheck_options(s) -> None:
    s.add_argument("--output", help="the output to differentiate (default: the first float output)")
    s.add_argument("--float32", action="store_true",
                   help="check in float32 instead of float64 (float64 runs ops onnxruntime lacks in double "
                        "through onnx's reference evaluator)")
    s.add_argument("--rtol", type=float,
                   help="relative tolerance (default 1e-5 in float64; 1e-3 with the backward on another runtime, in "
                        "float32; 1e-2 with --float32, where central differences lose digits to rounding and may "
                        "cross ReLU/MaxPool kinks)")
    s.add_argument("--eps", type=float, help="finite-difference step (default 1e-6; 1e-3 with --float32)")
    s.add_argument("--seed", type=int, default=0, help="the seed of the random inputs and directions")
    s.add_argument("--padding", choices=["left", "right"],
                   help="pad the first row of an attention mask (left: some queries see no key, as left-padded "
                        "generation batches); default no padding")


def _gradcheck(sub, common) -> None:
    s = sub.add_parser("gradcheck", parents=[common],
                       help="gradcheck with the backward run on any runtime (OpenVINO, tract, onnxruntime-node, ...)")
    s.add_argument("model", metavar="MODEL", help="the model to check (.onnx; a training model's inference graph)")
    _gradcheck_options(s)
    runners = [n for n, t in RUNTIMES.items() if t.runner]
    s.add_argument("--runtime", default="auto", choices=["auto", *runners], metavar="RUNTIME",
                   help=f"where the backward runs, one of auto, {', '.join(runners)} (default: %(default)s: "
                        "everything in float64 on onnxruntime, onnx.reference where onnxruntime lacks a double "
                        "kernel). Another runtime runs the backward lowered for its target, in float32, against "
                        "float64 central differences")
    s.set_defaults(run=cmd_gradcheck)


def _conformance(sub, common) -> None:
    s = sub.add_parser("conformance", parents=[common],
                       help="every rule case and random graphs through runtimes: a table per op (forward and "
                            "backward), as text and JSON")
    runners = [n for n, t in RUNTIMES.items() if t.runner]
    s.add_argument("--runtime", action="append", choices=runners, metavar="RUNTIME",
                   help=f"a runtime to run, one of {', '.join(runners)} (repeat for several)")
    s.add_argument("--graphs", type=int, default=300, metavar="N", help="random graphs")
    s.add_argument("--graphs-from", choices=("chain", "registry"), default="chain",
                   help="chain: chains of elementwise ops, reductions and products of computed tensors, drawn by "
                        "numpy (the checked-in tables'); registry: the registry fuzz of onnx_autodiff.testing "
                        "(every rule case's op; needs hypothesis)")
    s.add_argument("--seed", type=int, default=0, help="the seed of the random graphs and cotangents")
    s.add_argument("--ops", metavar="OP,OP", help="only the rule cases of these ops (no probes)")
    s.add_argument("--out", metavar="DIR", help="write RUNTIME.json and RUNTIME.txt into DIR")
    s.add_argument("--write", action="store_true",
                   help="write them over the checked-in tables (onnx_autodiff/data/conformance/), which the targets "
                        "read: then regenerate docs/runtimes.md's section with --markdown")
    s.add_argument("--markdown", action="store_true",
                   help="print the conformance section of docs/runtimes.md from the checked-in tables")
    s.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    s.set_defaults(run=cmd_conformance)


def _rules(sub, common) -> None:
    s = sub.add_parser("rules", parents=[common], help="the ops with a gradient rule")
    s.add_argument("--markdown", action="store_true", help="the Markdown table of docs/operators.md")
    s.set_defaults(run=cmd_rules)


def _demo(sub, common) -> None:
    s = sub.add_parser("demo", parents=[common], help="train a small CNN on the bundled 8x8 digits")
    s.add_argument("--out", default="onnx-autodiff-demo", metavar="DIR", help="where the model and the plot go")
    s.add_argument("--epochs", type=int, default=12, metavar="N", help="passes over the training images")
    s.add_argument("--seed", type=int, default=0, help="the seed of the initial weights and the shuffling")
    s.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    s.add_argument("--web", action="store_true",
                   help="train in the browser instead: serve a page (onnxruntime-web) on 127.0.0.1; needs "
                        "`npm install onnxruntime-web`")
    s.add_argument("--port", type=int, default=8000, help="with --web: the port (0: a free one)")
    s.add_argument("--ort-web", metavar="DIR",
                   help="with --web: onnxruntime-web's dist folder (default: node_modules/onnxruntime-web/dist "
                        "here or in a folder above)")
    s.set_defaults(run=cmd_demo)

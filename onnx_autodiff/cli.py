"""The ``onnx-autodiff`` command: lower, make-training, train, export, check, rules, demo.

Errors print one line (what went wrong, then a hint) and exit non-zero: 2 for usage and input errors
(missing file, not an ONNX model, bad option, an op without a gradient rule), 1 when the work itself
fails (training diverged, gradients disagree, a file cannot be written), 128 + the signal number when
interrupted. ``--debug`` (before or after the command) shows the traceback instead; the hint and the exit
code come from the error itself (``errors.py``). Every file is written atomically (``io.py``). This module
parses and prints: ``train`` is ``TrainingSession.fit`` (``fit.py``: batching, learning rate, progress,
the checkpoint directory of ``checkpoint.py``, the data checks of ``train_data.py``) on the files given.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import numpy as np

from .driver.progress import stage
from .io import check_output_path, first_line, load_checked

PROG = "onnx-autodiff"
CHECK_LIMIT = 1 << 29  # bytes of tensors check accepts: float64 doubles them, one model stops at 2 GiB
CHECKPOINT = "checkpoint.onnx"


class CliError(Exception):
    """An error the user can fix: printed as one line with a hint, exit code ``exit_code`` (as the library's
    errors, which carry ``hint`` and ``exit_code`` too)."""

    def __init__(self, message: str, hint: str = "", exit_code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code


# ---- helpers ------------------------------------------------------------------------------------

def load_onnx(path: str, what: str = "model"):
    """Load an ONNX file whole (every tensor inline), with io.load_checked's clear errors."""
    from .weights import attach_weights

    model, weights = load_checked(path, what)
    attach_weights(model, weights)
    return model


def _save(model, path: str, weights=None) -> None:
    from .io import save_model_atomic

    check_output_path(path, "output")
    save_model_atomic(model, path, weights=weights)


# ---- lower --------------------------------------------------------------------------------------

def cmd_lower(args) -> int:
    from .lower import lower
    from .passes.training import training_nodes_left

    model, weights = load_checked(args.input)
    before = len(training_nodes_left(model))
    with stage(f"lowering {args.input}"):
        out = lower(model, target_opset=args.target_opset)
    _save(out, args.output, weights)
    print(f"lowered {before} training node(s) (Gradient, GraphCall, optimizers) to standard ONNX; "
          f"wrote {args.output} ({len(out.graph.node)} nodes in the graph, {len(out.training_info)} training_info)")
    return 0


# ---- make-training ------------------------------------------------------------------------------

def _parse_losses(specs: list[str]):
    """``NAME`` | ``PATH.onnx`` | ``OUTPUT=NAME[:WEIGHT]`` -> (loss for make_training_model, loss_weights)."""
    def one(text: str):
        if text.endswith(".onnx"):
            return load_onnx(text, "loss graph").graph
        return text

    if len(specs) == 1 and "=" not in specs[0]:
        return one(specs[0]), None
    losses, weights = {}, {}
    for spec in specs:
        if "=" not in spec:
            raise CliError(f"--loss {spec!r}: with several losses each one is OUTPUT=LOSS[:WEIGHT]",
                           "for example --loss logits=cross_entropy --loss aux=mse:0.5")
        out, rest = spec.split("=", 1)
        weight = 1.0
        if ":" in rest:
            head, tail = rest.rsplit(":", 1)
            try:
                weight = float(tail)
                rest = head
            except ValueError:
                pass
        losses[out] = one(rest)
        weights[out] = weight
    return losses, weights


def _budget_dims(specs: list[str] | None) -> dict[str, int]:
    """``NAME=SIZE`` pairs -> {NAME: SIZE}."""
    dims = {}
    for spec in specs or []:
        name, _, size = spec.partition("=")
        if not name or not size.isdigit() or int(size) <= 0:
            raise CliError(f"--budget-dim {spec!r}: expected NAME=SIZE with a positive integer size",
                           "for example --budget-dim batch=32 --budget-dim sequence=128")
        dims[name] = int(size)
    return dims


def cmd_make_training(args) -> int:
    from .training import builder_record, make_training_model

    model, arrays = load_checked(args.input)
    loss, weights = _parse_losses(args.loss or ["cross_entropy"])
    options = {}
    for key in ("momentum", "dampening", "weight_decay", "eps", "lr_decay"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.betas is not None:
        options["betas"] = tuple(args.betas)
    label = args.label
    if label and len(label) == 1 and "=" not in label[0]:
        label = label[0]
    elif label:
        label = dict(x.split("=", 1) for x in label)
    with stage(f"building and lowering the training model of {args.input}"):
        out = make_training_model(model, loss, args.optimizer, lr=args.lr, optimizer_options=options or None,
                                  trainable=args.trainable, frozen=args.frozen, outputs=args.output, label=label,
                                  loss_weights=weights, weights=arrays, loss_options=_loss_options(args),
                                  lora=_lora(args), memory_budget=args.memory_budget,
                                  memory_budget_dims=_budget_dims(args.budget_dim))
    _save(out, args.output_path, arrays)
    rec = builder_record(out)
    floats = sum(t.data_type in (1, 10, 11, 16) for t in model.graph.initializer)
    shown = ", ".join(rec["trainable"][:8]) + (", ..." if len(rec["trainable"]) > 8 else "")
    print(f"loss on {', '.join(rec['outputs'])} (label input(s): {', '.join(rec['labels'])}); optimizer "
          f"{rec['optimizer']}, lr {rec['lr']:g} (input {rec['learning_rate']!r})")
    print(f"trainable: {len(rec['trainable'])} of {floats} float initializers ({shown})")
    if args.memory_budget is not None:
        from .lower import lower
        from .passes.remat import remat_summary
        print(remat_summary(lower(out)))  # lowered already while building: remembered, not lowered again
    print(f"wrote {args.output_path}; train it with: {PROG} train {args.output_path} --data DATA.npz --checkpoint DIR")
    return 0


def _loss_options(args) -> dict | None:
    """``--loss-option KEY=VALUE`` (repeated) -> a dict; integer values become ints."""
    out = {}
    for text in args.loss_option or []:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise CliError(f"--loss-option {text!r}: expected KEY=VALUE", "for example --loss-option axis=-1")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out or None


def _lora(args) -> dict | None:
    if args.lora_rank is None:
        if args.lora_targets or args.lora_alpha is not None or args.lora_dropout is not None:
            raise CliError("--lora-targets/--lora-alpha/--lora-dropout need --lora-rank", "for example "
                           "--lora-rank 8 --lora-alpha 16 --lora-targets q_proj,v_proj")
        return None
    if not args.lora_targets:
        raise CliError("--lora-rank needs --lora-targets", "for example --lora-targets q_proj,v_proj")
    spec = {"rank": args.lora_rank, "targets": args.lora_targets}
    if args.lora_alpha is not None:
        spec["alpha"] = args.lora_alpha
    if args.lora_dropout is not None:
        spec["dropout"] = args.lora_dropout
    return spec


# ---- train --------------------------------------------------------------------------------------

def _check_train_args(args) -> None:
    if args.epochs < 1 or args.batch_size < 1:
        raise CliError("--epochs and --batch-size must be at least 1", "for example --epochs 10 --batch-size 32")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr >= 0):
        raise CliError(f"--lr {args.lr:g}: the learning rate must be a finite number >= 0",
                       "for example --lr 0.01")


def cmd_train(args) -> int:
    _check_train_args(args)
    group = _data_parallel(args)
    if group is not None and group.rank:
        args.quiet = True  # one progress bar: rank 0's
    try:
        with _quiet_unless(group is None or group.rank == 0):
            return _train(args, group)
    finally:
        if group is not None:
            group.close()


def _train(args, group) -> int:
    from .driver.checkpoint import (
        CheckpointDir,
        TrainState,
        check_resume,
        file_fingerprint,
        model_file_fingerprint,
        signals_as_exceptions,
    )
    from .driver.session import TrainingSession
    from .driver.spec_checks import check_update_bindings
    from .driver.train_data import load_npz
    from .errors import TrainingDivergedError
    from .io import base_path_of

    ckdir = CheckpointDir(args.checkpoint, writer=group is None or group.rank == 0)
    if args.export:
        check_output_path(args.export, "--export", not_same_as=(args.model, ckdir.model_path))
    model, weights = load_checked(args.model)
    if not len(model.training_info):
        raise CliError(f"{args.model!r} has no training_info: there is nothing to train",
                       f"add a loss and an optimizer first: {PROG} make-training {args.model} OUT.onnx --loss ... ")
    check_update_bindings(model)
    data = load_npz(args.data)
    identity = TrainState(model_sha256=model_file_fingerprint(args.model), data_sha256=file_fingerprint(args.data),
                          batch_size=args.batch_size, seed=args.seed, shuffle=args.shuffle, lr=None,
                          model=os.path.abspath(args.model), data=os.path.abspath(args.data))
    names = (repr(args.model), repr(args.data))
    start = (model, weights)
    try:
        if ckdir.exists():  # resume from the checkpoint itself: no second lowering, and errors before any work
            ckdir.lock()
            if ckdir.has_checkpoint():
                start, saved = ckdir.load()
                check_resume(ckdir, saved, identity, *names)
        with stage("lowering the step and opening an onnxruntime session", enabled=not args.quiet):
            sess = TrainingSession(start[0], weights=start[1], progress=not args.quiet,
                                   base_path=base_path_of(start[0]) or args.model)
        with signals_as_exceptions():  # the per-step work happens in TrainingSession.fit -> run_epoch -> step
            sess.fit(data, args.batch_size, args.epochs, checkpoint=ckdir, seed=args.seed, shuffle=args.shuffle,
                     lr=args.lr, progress=not args.quiet, log=_say, identity=identity, names=names,
                     accumulate=args.accumulate, group=group)
    except TrainingDivergedError as e:
        e.hint = ("the data is finite (train checks it before the first step), so the update went non-finite "
                  "first: lower --lr and rerun to resume from the checkpoint of the last finished epoch")
        raise
    finally:
        ckdir.release()
    print(f"checkpoint: {ckdir.model_path}")
    if ckdir.writer:
        _export(sess, args)
    return 0


# ---- train: --accumulate and data-parallel processes (torchrun) -----------------------------------

def _data_parallel(args):
    """The torch.distributed group when torchrun started this process with others, else None; refuses a
    --batch-size the processes and micro-batches do not divide."""
    from .driver.distributed import DataParallel, environment

    env = environment()
    world = env[1] if env else 1
    if args.accumulate < 1:
        raise CliError(f"--accumulate {args.accumulate}: the number of micro-batches must be at least 1",
                       "for example --accumulate 4")
    parts = world * args.accumulate
    if args.batch_size % parts:
        raise CliError(f"--batch-size {args.batch_size} (the global batch) is not divisible by {world} process(es) x "
                       f"--accumulate {args.accumulate} = {parts}: the parts would differ in size",
                       f"pass a --batch-size that is a multiple of {parts}")
    return DataParallel.from_environment(timeout=args.timeout)


@contextlib.contextmanager
def _quiet_unless(talk: bool):
    """Rank 0 alone prints (errors still go to stderr on every rank)."""
    if talk:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def _say(line: str) -> None:
    print(line)
    sys.stdout.flush()


def _export(sess, args) -> None:
    if args.export:
        sess.export_inference(args.export)
        print(f"exported the inference model to {args.export}")
    else:
        print(f"export the inference model with: {PROG} export "
              f"{os.path.join(args.checkpoint, 'checkpoint.onnx')} OUT.onnx")


# ---- export, check, rules, demo -----------------------------------------------------------------

def cmd_export(args) -> int:
    from .driver.session import TrainingSession
    from .training.lora import lora_record

    check_output_path(args.output, "export: OUT", not_same_as=(args.model,))
    model, weights = load_checked(args.model)
    if not len(model.training_info):
        raise CliError(f"{args.model!r} has no training_info: it already is an inference model",
                       "export takes a training model or a checkpoint written by train")
    sess = TrainingSession(model, weights=weights)
    sess.export_inference(args.output, adapters=args.adapters)
    lora = "" if lora_record(model) is None else (
        ", LoRA adapters merged" if args.adapters == "merged" else ", LoRA adapters as inputs (zero by default)")
    print(f"wrote {args.output}: the inference graph with the trained weights ({sess.steps} steps{lora}), "
          "no training_info")
    return 0


def cmd_export_adapter(args) -> int:
    from .training.adapters import export_adapter
    from .training.lora import lora_record

    model, _ = load_checked(args.model)
    record = lora_record(model)
    if record is None:
        raise CliError(f"{args.model!r} has no LoRA adapters (no onnx_autodiff.lora metadata)",
                       f"build the training model with {PROG} make-training ... --lora-rank R --lora-targets ...")
    if os.path.isfile(args.out_dir):
        raise CliError(f"OUT_DIR {args.out_dir!r} is a file", "name a directory")
    paths = export_adapter(args.model, args.out_dir, args.format, prefix=args.prefix or "")
    print(f"wrote {', '.join(paths)}: {len(record['layers'])} LoRA layers, rank {record['rank']}")
    if args.format == "onnxruntime":
        print(f"the model that reads them: {PROG} export {args.model} MODEL.onnx --adapters inputs")
    return 0


def cmd_check(args) -> int:
    import onnx

    from .gradcheck import gradcheck
    from .graph import FLOAT_TYPES

    light, weights = load_checked(args.model)
    size = sum(np.asarray(a).nbytes for a in weights.values())
    if size > CHECK_LIMIT:
        raise CliError(f"check promotes every weight to float64 in one model; {args.model!r} holds "
                       f"{size / 2**30:.1f} GiB of tensors, past what one ONNX model (2 GiB) can hold",
                       "gradcheck a smaller model with the same ops, or one layer of it (onnx.utils.extract_model)")
    from .weights import attach_weights

    attach_weights(light, weights)
    m = light
    del m.training_info[:]
    infos = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(m).graph.output}
    floats = [o.name for o in m.graph.output if infos.get(o.name, o).type.tensor_type.elem_type in FLOAT_TYPES]
    if not floats:
        raise CliError("the model has no floating-point output to differentiate", "check takes a float model")
    of = args.output or floats[0]
    wrt = [t.name for t in m.graph.initializer if t.data_type in FLOAT_TYPES]
    if not wrt:
        raise CliError("the model has no floating-point initializer to differentiate by",
                       "check differentiates the first float output w.r.t. the float initializers")
    rtol = args.rtol if args.rtol is not None else (1e-2 if args.float32 else 1e-5)
    eps = args.eps if args.eps else (1e-3 if args.float32 else 1e-6)
    report = gradcheck(m, of=of, wrt=wrt, float64=not args.float32, raise_on_failure=False, seed=args.seed,
                       rtol=rtol, eps=eps)
    print(report)
    if report.ok:
        print(f"ok: {len(report.checks)} tensor(s) agree with central differences")
        return 0
    worst = report.worst
    print(f"{PROG} check: error: the gradient of {of!r} w.r.t. {worst.name!r} disagrees with finite differences "
          f"(relative error {worst.rel_err:.2e}); hint: find the op with --debug or gradcheck one node at a time",
          file=sys.stderr)
    return 1


def cmd_rules(args) -> int:
    from .coverage import coverage_markdown, coverage_rows

    if args.markdown:
        sys.stdout.write(coverage_markdown())
        return 0
    rows = coverage_rows()
    widths = [max(len(r[k]) for r in rows + [("domain", "op", "status", "detail")]) for k in range(3)]
    print(f"{'domain':{widths[0]}}  {'op':{widths[1]}}  {'status':{widths[2]}}  detail")
    for d, op, status, detail in rows:
        print(f"{d:{widths[0]}}  {op:{widths[1]}}  {status:{widths[2]}}  {detail}")
    n_rule = sum(r[2] == "rule" for r in rows)
    n_fn = sum(r[2] == "function body" and "no rule" not in r[3] for r in rows)
    n_none = sum(r[2] == "no gradient" for r in rows)
    print(f"{n_rule} op types with a gradient rule, {n_fn} more differentiated through their schema's function "
          f"body, {n_none} declared without gradient (as in docs/operators.md)")
    return 0


def cmd_demo(args) -> int:
    from . import demo

    if args.epochs < 1:
        raise CliError("--epochs must be at least 1", "the default is 12")
    demo.run(args.out, epochs=args.epochs, seed=args.seed, progress=not args.quiet)
    return 0


# ---- the parser ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)  # --debug after the command: it must not reset one before it
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    p = argparse.ArgumentParser(prog=PROG,
                                description="Lower the ONNX training spec to plain ONNX and train with stock "
                                            "onnxruntime.")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("lower", parents=[common], help="lower Gradient / optimizer / training nodes to standard ONNX")
    s.add_argument("input", metavar="IN")
    s.add_argument("output", metavar="OUT")
    s.add_argument("--target-opset", type=int, metavar="N",
                   help="convert the model to this opset first (onnx.version_converter); by default it keeps its "
                        "opset unless a gradient needs a newer one")
    s.set_defaults(run=cmd_lower)

    s = sub.add_parser("make-training", parents=[common],
                       help="add a loss, a Gradient node and an optimizer (a TrainingInfoProto) to an inference model")
    s.add_argument("input", metavar="IN")
    s.add_argument("output_path", metavar="OUT")
    s.add_argument("--loss", action="append", metavar="LOSS",
                   help="cross_entropy (default), nll, mse, l1, bce, bce_with_logits, or a loss graph FILE.onnx; "
                        "several outputs: OUTPUT=LOSS[:WEIGHT], repeated")
    s.add_argument("--optimizer", default="adam", help="sgd, momentum, nesterov, adagrad, adam (default), adamw")
    s.add_argument("--lr", type=float, default=1e-3, help="learning rate recorded as the default for train (1e-3)")
    s.add_argument("--trainable", nargs="+", action="extend", metavar="PATTERN",
                   help="initializers to train: names or glob patterns (default: every float initializer)")
    s.add_argument("--frozen", nargs="+", action="extend", metavar="PATTERN", help="initializers to keep fixed")
    s.add_argument("--output", action="append", metavar="NAME",
                   help="the model output the loss reads (default: the first)")
    s.add_argument("--label", action="append", metavar="NAME",
                   help="label input name (default: labels); OUTPUT=NAME for several")
    s.add_argument("--momentum", type=float)
    s.add_argument("--dampening", type=float)
    s.add_argument("--weight-decay", type=float)
    s.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"))
    s.add_argument("--eps", type=float)
    s.add_argument("--lr-decay", type=float)
    s.add_argument("--loss-option", action="append", metavar="KEY=VALUE",
                   help="an option of the loss: axis=-1 (cross_entropy's class axis), mask=attention_mask (causal_lm)")
    s.add_argument("--lora-rank", type=int, metavar="R", help="train LoRA adapters of rank R instead of the weights")
    s.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA scale alpha (alpha/rank; default 8)")
    s.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default 0)")
    s.add_argument("--lora-targets", metavar="NAMES",
                   help="comma-separated modules, weights or nodes to adapt (globs allowed): q_proj,v_proj")
    s.add_argument("--memory-budget", metavar="SIZE",
                   help="let the backward recompute cheap activations until the step's estimated peak fits SIZE "
                        "(2GiB, 500MB, bytes, or auto: the memory available now); needs networkx")
    s.add_argument("--budget-dim", action="append", metavar="NAME=SIZE",
                   help="the size of a symbolic input dim for the memory estimate (repeat: --budget-dim batch=32)")
    s.set_defaults(run=cmd_make_training)

    s = sub.add_parser("train", parents=[common], help="train a training model on an .npz, with checkpoints")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("--data", required=True, metavar="DATA.npz",
                   help="arrays named like the model inputs, or X (first input) and y (label)")
    s.add_argument("--epochs", type=int, default=10)
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--lr", type=float, help="learning rate fed at every step (default: the one make-training recorded)")
    s.add_argument("--checkpoint", required=True, metavar="DIR",
                   help=f"directory for {CHECKPOINT} (weights, optimizer state and the training state in one file); "
                        "training resumes from it; one trainer at a time")
    s.add_argument("--seed", type=int, default=0, help="shuffling seed")
    s.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    s.add_argument("--export", metavar="OUT", help="also write the trained inference model")
    s.add_argument("--quiet", action="store_true", help="no progress bar and no stage messages, only errors")
    s.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="run each batch as K micro-batches and update once (same result, less memory)")
    s.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="under torchrun: how long a process waits for the others before failing (default 600)")
    s.set_defaults(run=cmd_train)

    s = sub.add_parser("export", parents=[common], help="the inference model with the trained weights")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("output", metavar="OUT")
    s.add_argument("--adapters", choices=("merged", "inputs"), default="merged",
                   help="LoRA adapters merged into the weights (default), or kept as graph inputs for "
                        "onnxruntime's LoraAdapter files")
    s.set_defaults(run=cmd_export)

    s = sub.add_parser("export-adapter", parents=[common],
                       help="the LoRA adapters of a training model or checkpoint, for PEFT or onnxruntime")
    s.add_argument("model", metavar="CKPT")
    s.add_argument("out_dir", metavar="OUT_DIR")
    s.add_argument("--format", choices=("peft", "onnxruntime"), default="peft",
                   help="peft: adapter_model.safetensors + adapter_config.json; onnxruntime: adapter.onnx_adapter")
    s.add_argument("--prefix", help="peft: a leading part of the module paths to drop (a wrapper's 'm.')")
    s.set_defaults(run=cmd_export_adapter)

    s = sub.add_parser("check", parents=[common],
                       help="gradcheck the first float output w.r.t. the float initializers")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("--output", help="the output to differentiate (default: the first float output)")
    s.add_argument("--float32", action="store_true",
                   help="check in float32 instead of float64 (float64 runs ops onnxruntime lacks in double "
                        "through onnx's reference evaluator)")
    s.add_argument("--rtol", type=float,
                   help="relative tolerance (default 1e-5 in float64; 1e-2 with --float32, where central "
                        "differences lose digits to rounding and may cross ReLU/MaxPool kinks)")
    s.add_argument("--eps", type=float, help="finite-difference step (default 1e-6; 1e-3 with --float32)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=cmd_check)

    s = sub.add_parser("rules", parents=[common], help="the ops with a gradient rule")
    s.add_argument("--markdown", action="store_true", help="the Markdown table of docs/operators.md")
    s.set_defaults(run=cmd_rules)

    s = sub.add_parser("demo", parents=[common], help="train a small CNN on the bundled 8x8 digits")
    s.add_argument("--out", default="onnx-autodiff-demo", metavar="DIR", help="where the model and the plot go")
    s.add_argument("--epochs", type=int, default=12)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(run=cmd_demo)
    return p


def _os_error(e: OSError) -> tuple[str, str]:
    import errno

    where = f" {e.filename!r}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write{where}: the disk is full", "free some space and rerun"
    return f"{e.strerror or first_line(e)}{where}", "check the path and its permissions"


def main(argv: list[str] | None = None) -> int:
    from .driver.checkpoint import Interrupted

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (KeyboardInterrupt, Interrupted) as e:
        signum = getattr(e, "signum", 2)
        kept = (f"; the checkpoint of the last finished epoch is kept in {args.checkpoint!r}: rerun the same "
                "command to resume" if args.command == "train" else "")
        print(f"\n{PROG} {args.command}: interrupted ({'SIGTERM' if signum == 15 else 'SIGINT'}){kept}",
              file=sys.stderr)
        return 128 + signum
    except Exception as e:  # noqa: BLE001 - one line instead of a traceback, unless --debug
        if args.debug:
            raise
        from .errors import OnnxAutodiffError

        hint, code = getattr(e, "hint", ""), getattr(e, "exit_code", 1)  # every error of ours carries both
        if isinstance(e, CliError):
            what = str(e)
        elif isinstance(e, OnnxAutodiffError):
            what = " ".join(str(e).split())
        elif isinstance(e, OSError):
            what, hint = _os_error(e)
        else:
            what = f"{type(e).__name__}: {first_line(e)}"
            hint = hint or "this is a bug in onnx-autodiff: rerun with --debug for the traceback and report it"
        print(f"{PROG} {args.command}: error: {what}" + (f"; hint: {hint}" if hint else ""), file=sys.stderr)
        return code


__all__ = ["main", "build_parser", "CliError", "load_onnx"]

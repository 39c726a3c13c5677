"""The ``onnx-autodiff`` command: lower, make-training, train, export, check, rules, demo.

Errors print one line (what went wrong, then a hint) and exit non-zero: 2 for usage and input errors
(missing file, not an ONNX model, bad option, an op without a gradient rule), 1 when the work itself
fails (training diverged, gradients disagree). ``--debug`` shows the traceback instead. Every file is
written atomically (a temporary file in the same directory, then ``os.replace``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zipfile

import numpy as np

PROG = "onnx-autodiff"
CHECKPOINT = "checkpoint.onnx"
TRAIN_STATE = "train_state.json"


class CliError(Exception):
    """An error the user can fix: printed as one line with a hint, exit code ``code``."""

    def __init__(self, message: str, hint: str = "", code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.code = code


# ---- helpers ------------------------------------------------------------------------------------

def load_onnx(path: str, what: str = "model"):
    """Load an ONNX file with clear errors for a missing file, a directory or something that is not ONNX."""
    import onnx
    from google.protobuf.message import DecodeError

    from .io import load_model

    if not os.path.exists(path):
        raise CliError(f"{what} file {path!r} does not exist", "check the path")
    if os.path.isdir(path):
        raise CliError(f"{what} path {path!r} is a directory, not an .onnx file", "name the .onnx file inside it")
    try:
        model = load_model(path)
    except (DecodeError, RuntimeWarning, ValueError, OSError) as e:
        raise CliError(f"{path!r} is not an ONNX model ({type(e).__name__}: {_first_line(e)})",
                       "pass a .onnx file written by onnx.save or an exporter") from e
    if not model.ir_version or not model.HasField("graph"):
        raise CliError(f"{path!r} is not an ONNX model (no IR version or graph)",
                       "pass a .onnx file written by onnx.save or an exporter")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise CliError(f"{path!r} is not a valid ONNX model: {_first_line(e)}",
                       "run onnx.checker.check_model on it to see every problem") from e
    return model


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _save(model, path: str) -> None:
    from .io import save_model_atomic

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"cannot write {path!r}: directory {directory!r} does not exist", "create it first")
    save_model_atomic(model, path)


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def train_epoch(sess, feeds: list[dict], epoch: int, epochs: int, progress: bool, loss_name: str | None = None) -> list[float]:
    """One epoch of ``sess.step``; a ``\\r``-updated progress bar with the loss on stderr."""
    name = loss_name or sess.loss_name
    losses: list[float] = []
    last = 0.0
    for i, f in enumerate(feeds):
        out = sess.step(f)
        losses.append(float(np.asarray(out[name]).reshape(-1)[0]) if name else float("nan"))
        now = time.perf_counter()
        if progress and (now - last > 0.1 or i + 1 == len(feeds)):
            last = now
            done = int(24 * (i + 1) / len(feeds))
            sys.stderr.write(f"\repoch {epoch + 1}/{epochs} [{'#' * done}{'.' * (24 - done)}] "
                             f"{i + 1}/{len(feeds)} loss {losses[-1]:.4f}")
            sys.stderr.flush()
    if progress:  # clear the bar: the caller prints the epoch's summary line
        sys.stderr.write("\r" + " " * 72 + "\r")
        sys.stderr.flush()
    return losses


# ---- lower --------------------------------------------------------------------------------------

def cmd_lower(args) -> int:
    from .lower import lower
    from .passes.training import training_nodes_left

    model = load_onnx(args.input)
    before = len(training_nodes_left(model))
    out = lower(model, target_opset=args.target_opset)
    _save(out, args.output)
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


def cmd_make_training(args) -> int:
    from .training_builder import builder_record, make_training_model

    model = load_onnx(args.input)
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
    out = make_training_model(model, loss, args.optimizer, lr=args.lr, optimizer_options=options or None,
                              trainable=args.trainable, frozen=args.frozen, outputs=args.output, label=label,
                              loss_weights=weights)
    _save(out, args.output_path)
    rec = builder_record(out)
    floats = sum(t.data_type in (1, 10, 11, 16) for t in model.graph.initializer)
    shown = ", ".join(rec["trainable"][:8]) + (", ..." if len(rec["trainable"]) > 8 else "")
    print(f"loss on {', '.join(rec['outputs'])} (label input(s): {', '.join(rec['labels'])}); optimizer "
          f"{rec['optimizer']}, lr {rec['lr']:g} (input {rec['learning_rate']!r})")
    print(f"trainable: {len(rec['trainable'])} of {floats} float initializers ({shown})")
    print(f"wrote {args.output_path}; train it with: {PROG} train {args.output_path} --data DATA.npz --checkpoint DIR")
    return 0


# ---- train --------------------------------------------------------------------------------------

def _load_npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.exists(path):
        raise CliError(f"data file {path!r} does not exist", "pass an .npz written by numpy.savez")
    if not zipfile.is_zipfile(path):
        raise CliError(f"{path!r} is not a NumPy .npz archive",
                       "write it with numpy.savez(path, X=..., y=...) or with arrays named like the model inputs")
    try:
        with np.load(path, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("a single array, not an archive")
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise CliError(f"{path!r} is not a NumPy .npz archive ({_first_line(e)})",
                       "write it with numpy.savez(path, X=..., y=...) or with arrays named like the model inputs") from e


def _input_types(sess) -> dict[str, tuple[int, list]]:
    out = {}
    for vi in sess.step_model.graph.input:
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") else None
        out[vi.name] = (tt.elem_type, dims)
    return out


def map_data(sess, data: dict[str, np.ndarray], lr_input: str | None, record: dict | None) -> dict[str, np.ndarray]:
    """Arrays for every data input of the step: by name, or X -> the first model input and y -> the label."""
    from onnx import helper

    needed = [n for n in sess.feed_names if n != lr_input]
    inference_inputs = [i.name for i in sess.model.graph.input
                        if i.name not in {t.name for t in sess.model.graph.initializer}]
    labels = (record or {}).get("labels") or [i.name for i in sess.model.training_info[sess.index].algorithm.input
                                              if i.name != lr_input]
    aliases = {}
    if inference_inputs:
        aliases[inference_inputs[0]] = "X"
    if labels:
        aliases[labels[0]] = "y"
    mapped = {}
    for name in needed:
        if name in data:
            mapped[name] = data[name]
        elif aliases.get(name) in data:
            mapped[name] = data[aliases[name]]
        else:
            alias = f" (or {aliases[name]!r})" if name in aliases else ""
            raise CliError(f"the data has no array for input {name!r}{alias}; it has {sorted(data)}",
                           f"name the arrays after the inputs {needed}, or X / y for the first input and the label")
    types = _input_types(sess)
    n = None
    for name, arr in mapped.items():
        elem, dims = types[name]
        want = helper.tensor_dtype_to_np_dtype(elem)
        if dims is not None and (arr.ndim != len(dims) or any(d and d != s for d, s in zip(dims[1:], arr.shape[1:]))):
            shown = "[" + ", ".join("N" if k == 0 and d is None else ("?" if d is None else str(d)) for k, d in enumerate(dims)) + "]"
            raise CliError(f"data array for {name!r} has shape {list(arr.shape)}, the input needs {shown}",
                           "the first axis is the sample axis; reshape the array or rebuild the model with another label")
        if arr.dtype != want:
            if not np.can_cast(arr.dtype, want, casting="same_kind") and not (arr.dtype.kind in "iub" and want.kind in "iuf"):
                raise CliError(f"data array for {name!r} is {arr.dtype}, the input needs {want}",
                               f"convert it with .astype(np.{want.name})")
            arr = arr.astype(want)
        if n is None:
            n = len(arr)
        elif len(arr) != n:
            raise CliError(f"data arrays disagree on the number of samples ({n} vs {len(arr)} for {name!r})",
                           "every array needs the samples on its first axis")
        mapped[name] = np.ascontiguousarray(arr)
    if not n:
        raise CliError("the data holds no samples", "check the arrays in the .npz")
    return mapped


def cmd_train(args) -> int:
    from .session import TrainingSession
    from .training_builder import builder_record

    if args.epochs < 1 or args.batch_size < 1:
        raise CliError("--epochs and --batch-size must be at least 1", "for example --epochs 10 --batch-size 32")
    os.makedirs(args.checkpoint, exist_ok=True)
    ckpt = os.path.join(args.checkpoint, CHECKPOINT)
    state_path = os.path.join(args.checkpoint, TRAIN_STATE)
    resume = os.path.exists(ckpt) and os.path.exists(state_path)
    model = load_onnx(ckpt if resume else args.model, "checkpoint" if resume else "model")
    if not len(model.training_info):
        raise CliError(f"{args.model!r} has no training_info: there is nothing to train",
                       f"add a loss and an optimizer first: {PROG} make-training {args.model} OUT.onnx --loss ... ")
    data = _load_npz(args.data)
    state = {"epochs_done": 0, "losses": []}
    if resume:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        print(f"resuming from {ckpt}: {state['epochs_done']} epoch(s), {state.get('steps', 0)} steps done")
        if state["epochs_done"] >= args.epochs:
            print(f"already trained {state['epochs_done']} epoch(s); nothing to do (raise --epochs to train more)")
            return 0
    record = builder_record(model)
    sess = TrainingSession(model)
    lr_input = (record or {}).get("learning_rate")
    if lr_input is None and "learning_rate" in sess.feed_names:
        lr_input = "learning_rate"
    if args.lr is not None and lr_input is None:
        raise CliError("this model has no learning-rate input: its learning rate is fixed inside the model",
                       "drop --lr, or rebuild it with make-training")
    lr = args.lr if args.lr is not None else state.get("lr", (record or {}).get("lr", 1e-3))
    arrays = map_data(sess, data, lr_input, record)
    n = len(next(iter(arrays.values())))
    steps_per_epoch = math.ceil(n / args.batch_size)
    print(f"training on {n} samples ({', '.join(f'{k} {list(v.shape)}' for k, v in arrays.items())}), "
          f"{steps_per_epoch} steps per epoch" + (f", lr {lr:g}" if lr_input else ""))
    for epoch in range(state["epochs_done"], args.epochs):
        start = time.perf_counter()
        order = np.random.default_rng([args.seed, epoch]).permutation(n) if args.shuffle else np.arange(n)
        feeds = []
        for k in range(steps_per_epoch):
            idx = order[k * args.batch_size:(k + 1) * args.batch_size]
            f = {name: arr[idx] for name, arr in arrays.items()}
            if lr_input:
                f[lr_input] = np.float32(lr)
            feeds.append(f)
        losses = train_epoch(sess, feeds, epoch, args.epochs, progress=not args.quiet)
        mean = float(np.mean(losses))
        state = {"epochs_done": epoch + 1, "steps": sess.steps, "batch_size": args.batch_size, "seed": args.seed,
                 "lr": lr, "data": os.path.abspath(args.data), "losses": state["losses"] + [mean]}
        sess.save(ckpt)
        write_text_atomic(state_path, json.dumps(state, indent=1))
        print(f"epoch {epoch + 1}/{args.epochs}: loss {mean:.6f} ({len(losses)} steps, "
              f"{time.perf_counter() - start:.1f} s)")
        sys.stdout.flush()
    print(f"checkpoint: {ckpt}")
    if args.export:
        sess.export_inference(args.export)
        print(f"exported the inference model to {args.export}")
    else:
        print(f"export the inference model with: {PROG} export {ckpt} OUT.onnx")
    return 0


# ---- export, check, rules, demo -----------------------------------------------------------------

def cmd_export(args) -> int:
    from .session import TrainingSession

    model = load_onnx(args.model)
    if not len(model.training_info):
        raise CliError(f"{args.model!r} has no training_info: it already is an inference model",
                       "export takes a training model or a checkpoint written by train")
    sess = TrainingSession(model)
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        raise CliError(f"cannot write {args.output!r}: directory {directory!r} does not exist", "create it first")
    sess.export_inference(args.output)
    print(f"wrote {args.output}: the inference graph with the trained weights ({sess.steps} steps), "
          "no training_info")
    return 0


def cmd_check(args) -> int:
    import onnx

    from .gradcheck import gradcheck
    from .graph import FLOAT_TYPES

    model = load_onnx(args.model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
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
    print(f"{n_rule} op types with a gradient rule, {len(rows) - n_rule} declared without gradient")
    return 0


def cmd_demo(args) -> int:
    from . import demo

    if args.epochs < 1:
        raise CliError("--epochs must be at least 1", "the default is 12")
    demo.run(args.out, epochs=args.epochs, seed=args.seed, progress=not args.quiet)
    return 0


# ---- the parser ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p = argparse.ArgumentParser(prog=PROG, parents=[common],
                                description="Lower the ONNX training spec to plain ONNX and train with stock onnxruntime.")
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
    s.add_argument("--output", action="append", metavar="NAME", help="the model output the loss reads (default: the first)")
    s.add_argument("--label", action="append", metavar="NAME", help="label input name (default: labels); OUTPUT=NAME for several")
    s.add_argument("--momentum", type=float)
    s.add_argument("--dampening", type=float)
    s.add_argument("--weight-decay", type=float)
    s.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"))
    s.add_argument("--eps", type=float)
    s.add_argument("--lr-decay", type=float)
    s.set_defaults(run=cmd_make_training)

    s = sub.add_parser("train", parents=[common], help="train a training model on an .npz, with checkpoints")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("--data", required=True, metavar="DATA.npz",
                   help="arrays named like the model inputs, or X (first input) and y (label)")
    s.add_argument("--epochs", type=int, default=10)
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--lr", type=float, help="learning rate fed at every step (default: the one make-training recorded)")
    s.add_argument("--checkpoint", required=True, metavar="DIR",
                   help=f"directory for {CHECKPOINT} and {TRAIN_STATE}; training resumes from them")
    s.add_argument("--seed", type=int, default=0, help="shuffling seed")
    s.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    s.add_argument("--export", metavar="OUT", help="also write the trained inference model")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(run=cmd_train)

    s = sub.add_parser("export", parents=[common], help="the inference model with the trained weights")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("output", metavar="OUT")
    s.set_defaults(run=cmd_export)

    s = sub.add_parser("check", parents=[common],
                       help="gradcheck the first float output w.r.t. the float initializers")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("--output", help="the output to differentiate (default: the first float output)")
    s.add_argument("--float32", action="store_true", help="check in float32 instead of float64 (float64 runs ops onnxruntime lacks in double "
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


def _hint_for(e: Exception) -> tuple[str, int]:
    from .errors import GradcheckError, OnnxAutodiffError, UnsupportedOperatorError
    from .session import TrainingDivergedError
    from .training_builder import TrainingBuilderError

    if isinstance(e, UnsupportedOperatorError):
        return "freeze the parameters behind that op (--frozen PATTERN) or register a rule (docs/writing_rules.md)", 2
    if isinstance(e, TrainingDivergedError):
        return "lower --lr; the checkpoint of the last finished epoch is kept", 1
    if isinstance(e, TrainingBuilderError):
        return f"see {PROG} make-training --help", 2
    if isinstance(e, GradcheckError):
        return "try --float32 for ops without float64 kernels", 1
    if isinstance(e, OnnxAutodiffError):
        return "see docs/training.md for what the spec allows", 2
    return "", 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except CliError as e:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {e}" + (f"; hint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return e.code
    except Exception as e:  # noqa: BLE001 - one line instead of a traceback, unless --debug
        if args.debug:
            raise
        from .errors import OnnxAutodiffError

        hint, code = _hint_for(e)
        if not isinstance(e, OnnxAutodiffError):
            what = f"{type(e).__name__}: {_first_line(e)}"
            hint = hint or "rerun with --debug for the traceback and report it"
        else:
            what = " ".join(str(e).split())
        print(f"{PROG} {args.command}: error: {what}" + (f"; hint: {hint}" if hint else ""), file=sys.stderr)
        return code


__all__ = ["main", "build_parser", "CliError", "load_onnx", "map_data", "train_epoch"]

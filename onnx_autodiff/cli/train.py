"""The train command (``TrainingSession.fit`` on the files given; other runtimes through their bundle) and
import-state."""
from __future__ import annotations

import contextlib
import math
import os
import sys

import onnx

from ..driver.progress import stage
from ..model.carrier import open_model
from ..model.io import base_path_of, check_output_path
from .common import PROG, CliError

# ---- train --------------------------------------------------------------------------------------

def _check_train_args(args) -> None:
    if args.epochs < 1 or args.batch_size < 1:
        raise CliError("--epochs and --batch-size must be at least 1", "for example --epochs 10 --batch-size 32")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr >= 0):
        raise CliError(f"--lr {args.lr:g}: the learning rate must be a finite number >= 0",
                       "for example --lr 0.01")


def cmd_train(args) -> int:
    from ..runtimes.targets import RUNTIMES

    _check_train_args(args)
    target = RUNTIMES[args.runtime]
    if not target.in_session:
        return _train_on_runtime(args)
    ep = target.ep
    args.providers = [ep] if ep else None  # an execution provider: TrainingSession, the state on the device
    group = _data_parallel(args)
    if group is not None and group.rank:
        args.quiet = True  # one progress bar: rank 0's
    try:
        with _quiet_unless(group is None or group.rank == 0):
            return _train(args, group)
    finally:
        if group is not None:
            group.close()


def _identity(args, data_sha256: str):
    """The ``TrainState`` a run of these files starts with, and how messages call the model and the data: the same
    on every runtime, so a checkpoint one runtime wrote resumes on another."""
    from ..driver.checkpoint import TrainState, model_file_fingerprint

    identity = TrainState(model_sha256=model_file_fingerprint(args.model), data_sha256=data_sha256,
                          batch_size=args.batch_size, seed=args.seed, shuffle=args.shuffle, lr=None,
                          model=os.path.abspath(args.model), data=os.path.abspath(args.data))
    return identity, (repr(args.model), repr(args.data))


def _train(args, group) -> int:
    from ..driver.checkpoint import CheckpointDir, check_resume, signals_as_exceptions
    from ..driver.session import TrainingSession
    from ..errors import TrainingDivergedError
    from ..model.io import base_path_of

    ckdir = CheckpointDir(args.checkpoint, writer=group is None or group.rank == 0)
    if args.export:
        check_output_path(args.export, "--export", not_same_as=(args.model, ckdir.model_path))
    light = _training_model(args)
    data, data_sha256 = _load_data(args, light)
    identity, names = _identity(args, data_sha256)
    start = light
    try:
        if ckdir.exists():  # resume from the checkpoint itself: no second lowering, and errors before any work
            ckdir.lock()
            if ckdir.has_checkpoint():
                start, saved = ckdir.load(base=args.model)
                check_resume(ckdir, saved, identity, *names)
        with stage("lowering the step and opening an onnxruntime session", enabled=not args.quiet):
            sess = TrainingSession(start, args.providers, progress=not args.quiet,
                                   base_path=base_path_of(start.proto) or args.model)
        with signals_as_exceptions():  # the per-step work happens in TrainingSession.fit -> run_epoch -> step
            sess.fit(data, args.batch_size, args.epochs, checkpoint=ckdir, seed=args.seed, shuffle=args.shuffle,
                     lr=args.lr, progress=not args.quiet, log=_say, identity=identity, names=names,
                     accumulate=args.accumulate, group=group)
    except TrainingDivergedError as e:
        e.hint = _DIVERGED
        raise
    finally:
        ckdir.release()
    print(f"checkpoint: {ckdir.model_path}")
    if ckdir.writer:
        _export(sess, args)
    return 0


_DIVERGED = ("the data is finite (train checks it before the first step), so the update went non-finite first: "
             "lower --lr and rerun to resume from the checkpoint of the last finished epoch")


def _training_model(args):
    from ..driver.spec_checks import check_update_bindings

    light = open_model(args.model)
    if not len(light.proto.training_info):
        raise CliError(f"{args.model!r} has no training_info: there is nothing to train",
                       f"add a loss and an optimizer first: {PROG} make-training {args.model} OUT.onnx --loss ... ")
    check_update_bindings(light.proto)
    return light


def _load_data(args, light):
    """(arrays, fingerprint) of ``--data``: an .npz, or text (.jsonl / .txt) tokenized by ``--tokenizer`` (default:
    the tokenizer.json beside the model or the model it was made from) into rows of ``--seq-len``."""
    import hashlib

    from ..driver.checkpoint import file_fingerprint
    from ..driver.text import find_tokenizer, is_text, load_text
    from ..driver.train_data import load_npz

    if not is_text(args.data):
        if args.tokenizer:
            raise CliError(f"--tokenizer reads text, but --data {args.data!r} is not .jsonl or .txt",
                           "drop --tokenizer, or pass text data")
        return load_npz(args.data), file_fingerprint(args.data)
    tokenizer = args.tokenizer or find_tokenizer(light)
    if tokenizer is None:
        raise CliError(f"--data {args.data!r} is text, and no tokenizer.json is beside {args.model!r} or the model "
                       "it was made from (read only in the folder of MODEL)",
                       "name it: --tokenizer PATH/tokenizer.json")
    with stage(f"tokenizing {args.data}", enabled=not args.quiet):
        data = load_text(args.data, tokenizer, args.seq_len)
    print(f"{args.data}: {data.documents} documents, {data.tokens} tokens in {len(data['input_ids'])} rows of "
          f"{args.seq_len} (tokenizer {tokenizer})")
    h = hashlib.sha256(f"{file_fingerprint(args.data)}:{file_fingerprint(tokenizer)}:{args.seq_len}".encode())
    return data, h.hexdigest()


def _train_on_runtime(args) -> int:
    """``fit`` over the step bundle on ``--runtime``: the same checks, lines, checkpoint and resume as on
    onnxruntime (``runtimes/train.py``)."""
    from ..driver.checkpoint import CheckpointDir, signals_as_exceptions
    from ..errors import TrainingDivergedError
    from ..runtimes.state_file import import_state
    from ..runtimes.train import train_bundle

    if args.accumulate != 1 or os.environ.get("WORLD_SIZE", "1") != "1":
        raise CliError(f"--runtime {args.runtime} trains in one process, one step per batch",
                       "drop --accumulate and torchrun, or train on onnxruntime")
    ckdir = CheckpointDir(args.checkpoint)
    if args.export:
        check_output_path(args.export, "--export", not_same_as=(args.model, ckdir.model_path))
    light = _training_model(args)
    data, data_sha256 = _load_data(args, light)
    identity, names = _identity(args, data_sha256)
    try:
        with signals_as_exceptions():
            trainer = train_bundle(light, data, runtime=args.runtime, checkpoint=ckdir, batch_size=args.batch_size,
                                   epochs=args.epochs, seed=args.seed, shuffle=args.shuffle, lr=args.lr,
                                   progress=not args.quiet, log=_say, identity=identity, names=names)
    except TrainingDivergedError as e:
        e.hint = _DIVERGED
        raise
    print(f"checkpoint: {ckdir.model_path}")
    if args.export:
        import_state(light, trainer.state, args.export)
        print(f"exported the inference model to {args.export}")
    else:
        _export_hint(args)
    return 0


def cmd_import_state(args) -> int:
    from ..runtimes.state_file import import_state, load_state

    check_output_path(args.output, "import-state: OUT", not_same_as=(args.model,))
    import_state(open_model(args.model, base=args.base), load_state(args.state), args.output)
    print(f"wrote {args.output}: the inference graph with the weights of {args.state}")
    return 0


# ---- train: --accumulate and data-parallel processes (torchrun) -----------------------------------

def _data_parallel(args):
    """The torch.distributed group when torchrun started this process with others, else None; refuses a
    --batch-size the processes and micro-batches do not divide."""
    from ..driver.distributed import DataParallel, environment

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
        _export_hint(args)


def _export_hint(args) -> None:
    ckpt = os.path.join(args.checkpoint, "checkpoint.onnx")
    base = base_path_of(onnx.load(ckpt, load_external_data=False)) if os.path.exists(ckpt) else None
    named = "" if base is None or os.path.dirname(base) == os.path.dirname(os.path.abspath(ckpt)) else \
        f" --base {args.model}"  # the frozen weights it references are outside its folder: name them
    print(f"export the inference model with: {PROG} export {ckpt} OUT.onnx{named}")

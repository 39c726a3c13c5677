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

import sys

from ..model.io import first_line
from .common import PROG, CliError, load_onnx
from .parser import build_parser


def _os_error(e: OSError) -> tuple[str, str]:
    import errno

    where = f" {e.filename!r}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write{where}: the disk is full", "free some space and rerun"
    return f"{e.strerror or first_line(e)}{where}", "check the path and its permissions"


def main(argv: list[str] | None = None) -> int:
    from ..driver.checkpoint import Interrupted

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
        from ..errors import OnnxAutodiffError

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

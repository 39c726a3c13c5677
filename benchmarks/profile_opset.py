"""``benchmarks.profile --against`` with the benchmark model exported at another opset (the benchmarks export at 17).

    python -m benchmarks.profile_opset 18 resnet18 --threads 1 --steps 2 --against /work/main --rounds 2

Forms that need a newer opset (the Conv input gradient's Col2Im, opset 18) show only in a model at that opset.
Each side runs in its own process, alternating ``--rounds`` times, as ``benchmarks.profile --against`` does; the
table is that module's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from .profile import comparison_table


def _at_opset(opset: int) -> None:
    """TorchScript export at ``opset`` whatever the caller asks."""
    import torch

    export = torch.onnx.export

    def at_opset(*args, **kwargs):
        kwargs["opset_version"] = opset
        return export(*args, **kwargs)

    torch.onnx.export = at_opset


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("opset", type=int)
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--against", metavar="DIR", required=True, help="the checkout profiled as 'before'")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", metavar="DIR", help=argparse.SUPPRESS)  # one side's run: the checkout DIR, JSON out
    args = p.parse_args(argv)
    profile_args = [args.model, "--threads", str(args.threads), "--steps", str(args.steps)]
    if args.one:
        from . import profile

        _at_opset(args.opset)
        return profile.main(profile_args + ["--json", "--code", args.one])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {"before": [], "after": []}
    for _ in range(args.rounds):
        for side, code in (("before", args.against), ("after", here)):
            cmd = [sys.executable, "-m", "benchmarks.profile_opset", str(args.opset), *profile_args,
                   "--against", args.against, "--one", code]
            out = subprocess.run(cmd, cwd=here, capture_output=True, text=True, check=True).stdout
            run = json.loads(out.splitlines()[-1])
            if os.path.realpath(run["code"]) != os.path.realpath(code):
                raise SystemExit(f"the {side} run imported onnx_autodiff from {run['code']}, not {code}")
            runs[side].append(run)
    print(f"{args.model} at opset {args.opset}, {args.threads} thread(s), {args.steps} steps per run; "
          f"before: {args.against}")
    print(comparison_table(runs, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

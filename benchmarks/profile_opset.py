"""``benchmarks.profile --against`` with the benchmark model exported at another opset (the benchmarks export at 17).

    python -m benchmarks.profile_opset 18 resnet18 --threads 1 --steps 2 --against /work/main --rounds 2
    python -m benchmarks.profile_opset 18 resnet18 --toggle col2im_input_grad=0,im2col_weight_grad_max_out=0 --steps 10

Forms that need a newer opset (the Conv input gradient's Col2Im, opset 18) show only in a model at that opset.
Each side runs in its own process, alternating ``--rounds`` times, as ``benchmarks.profile --against`` does; the
table is that module's. ``--toggle OPTION=VALUE,...``: instead, this checkout's step built twice in one process,
with those emitter options (the old forms) and without, and ``--steps`` steps of each run in turn (one intra-op
thread unless ``--threads``): the median and min thread CPU ms per step, a load change hitting both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .profile import comparison_table


def _at_opset(opset: int) -> None:
    """TorchScript export at ``opset`` whatever the caller asks."""
    import torch

    export = torch.onnx.export

    def at_opset(*args, **kwargs):
        kwargs["opset_version"] = opset
        return export(*args, **kwargs)

    torch.onnx.export = at_opset


def toggle(model_name: str, options: dict, threads: int, steps: int) -> str:
    """Median (min) thread CPU ms per step of the step built with ``options`` and with the defaults, alternating."""
    import onnxruntime as ort

    from onnx_autodiff.engine.builder import emit_options

    from .profile import step_model

    sessions = {}
    with tempfile.TemporaryDirectory(prefix="oa-toggle-") as workdir:
        for side, opts in (("options", options), ("defaults", {})):
            with emit_options(**opts):
                model, feeds = step_model(model_name, workdir, "sgd")
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            so.log_severity_level = 3
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            del model
            names = {i.name for i in sess.get_inputs()}
            run_feeds = {k: v for k, v in feeds.items() if k in names}
            sess.run(None, run_feeds)  # warm-up
            sessions[side] = (sess, run_feeds)
    times = {side: [] for side in sessions}
    for _ in range(steps):
        for side, (sess, feeds) in sessions.items():
            t = time.thread_time()
            sess.run(None, feeds)
            times[side].append(1e3 * (time.thread_time() - t))
    return "; ".join(f"{side} {np.median(v):.1f} ({min(v):.1f})" for side, v in times.items()) + \
        f" thread CPU ms/step, median (min) of {steps}; load {os.getloadavg()[0]:.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("opset", type=int)
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--against", metavar="DIR", help="the checkout profiled as 'before'")
    p.add_argument("--toggle", metavar="OPTION=VALUE,...", help="this checkout's step with these emitter options "
                   "against its defaults, in one process (integer values)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", metavar="DIR", help=argparse.SUPPRESS)  # one side's run: the checkout DIR, JSON out
    args = p.parse_args(argv)
    if args.toggle:
        _at_opset(args.opset)
        options = {k: int(v) for k, v in (kv.split("=") for kv in args.toggle.split(","))}
        print(f"{args.model} at opset {args.opset}, {args.threads} thread(s), {options} vs the defaults: "
              + toggle(args.model, options, args.threads, args.steps))
        return 0
    if not args.against:
        p.error("give --against DIR or --toggle OPTION=VALUE,...")
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

"""Lowering time of synthetic chains (issue 21: a 10,000-node chain lowers in <= 5 s), wall and CPU.

    flock /tmp/heavy.lock python -m benchmarks.lower_chain 2500 5000 10000
    python -m benchmarks.lower_chain 10000 --profile 25     # cProfile of the lowering, top lines by own time

Each size is ``benchmarks.run.chain_model(n)`` with SGD (``make_training_model``), lowered once in this
process (``lower`` keeps no cache; a 10-node chain is lowered first, so no size pays for importing the
rules). Process CPU time is the number to compare on a busy machine; the wall
time and the 1-minute load average are printed beside it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time


def main(argv=None):
    from onnx_autodiff import lower

    from .run import chain_model
    from .training_model import make_training_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sizes", nargs="*", type=int, default=[2500, 5000, 10000], help="chain lengths in nodes")
    p.add_argument("--profile", type=int, default=0, metavar="LINES", help="print this many cProfile lines")
    args = p.parse_args(argv)
    lower(make_training_model(chain_model(10), "logits", "sgd", 0.01))  # imports the rules before any timing
    for n in args.sizes:
        training = make_training_model(chain_model(n), "logits", "sgd", 0.01)
        prof = cProfile.Profile() if args.profile else None
        load = os.getloadavg()[0]
        wall, cpu = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        lower(training)
        if prof:
            prof.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"{n:>6} nodes  wall {wall:5.2f} s  cpu {cpu:5.2f} s  load {load:.2f}"
              + ("  (profiled)" if prof else ""), flush=True)
        if prof:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
            print(out.getvalue())


if __name__ == "__main__":
    main()

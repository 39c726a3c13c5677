"""Run under torchrun by tests/integration/test_distributed.py: trains every ``*.onnx`` in DIR for STEPS
global batches of DIR/data_<name>.npz (arrays x, labels; global batch BATCH) data-parallel through ``SplitStep`` and
``DataParallel.reduce``; rank 0 writes the final state of each to DIR/<name>.world<N>.npz.

usage: python -m torch.distributed.run --nproc-per-node N tests/dist_worker.py DIR BATCH STEPS
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from onnx_autodiff.driver.accumulate import SplitStep
from onnx_autodiff.driver.distributed import DataParallel
from onnx_autodiff.driver.session import TrainingSession


def main(directory: str, batch: int, steps: int) -> None:
    group = DataParallel.from_environment(timeout=30)
    try:
        for path in sorted(Path(directory).glob("*.onnx")):
            with np.load(Path(directory) / f"data_{path.stem}.npz") as z:
                data = {k: z[k] for k in z.files}
            sess = TrainingSession(str(path), progress=False)
            step = SplitStep(sess, list(data), 1, group.rank, group.world, group.reduce)
            for k in range(steps):
                step.step({n: a[k * batch:(k + 1) * batch] for n, a in data.items()})
            if group.rank == 0:
                np.savez(Path(directory) / f"{path.stem}.world{group.world}.npz", **dict(sess.state))
    finally:
        group.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

"""Set-up time of the docs' path, split into phases, in CPU seconds (issue 38: BERT-base to its first step <= 2 s).

    python -m benchmarks.setup_phases MODEL.onnx [--labels 2] [--batch 8] [--seq 64] [--profile 30]
    python -m benchmarks.setup_phases --tiny         # a small MLP built here: to see that it runs

One process does what the docs show, once: ``make_training_model(path, "cross_entropy", "adam")`` ->
``TrainingSession(training_model, session_options=so)`` (``so.intra_op_num_threads = 1``) -> ``step(feeds)``.
Each phase is timed inclusively, in process CPU time (``time.process_time``: the machine is shared, and one
intra-op thread keeps onnxruntime's work on the calling thread) and wall time, by wrapping the functions that
make it (their nesting is printed as indentation). ``--profile N`` adds cProfile's top N lines by own time.
A token model (an int64 input) is fed random ids below ``--vocab``; a float one standard normals.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from contextlib import contextmanager

import numpy as np

ROWS: list[tuple[int, str, float, float]] = []
_DEPTH = [0]


@contextmanager
def phase(name: str):
    depth = _DEPTH[0]
    _DEPTH[0] += 1
    row = len(ROWS)
    ROWS.append((depth, name, 0.0, 0.0))
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield
    finally:
        _DEPTH[0] = depth
        ROWS[row] = (depth, name, time.process_time() - cpu, time.perf_counter() - wall)


def wrap(module, attr: str, name: str | None = None) -> None:
    """Time every call of ``module.attr`` as the phase ``name`` (inclusive); nothing where the checkout has no such
    function (an older tree run with this script, for an A/B)."""
    if hasattr(module, attr):
        setattr(module, attr, _timed(getattr(module, attr), name or f"{module.__name__.rsplit('.', 1)[-1]}.{attr}"))


def _timed(fn, name: str):
    def timed(*a, **k):
        with phase(name):
            return fn(*a, **k)
    return timed


def instrument() -> None:
    from onnx_autodiff.driver import forward_check, runs, session, state, step, step_model
    from onnx_autodiff.model import carrier
    from onnx_autodiff.passes import pipeline
    from onnx_autodiff.training import builder, trainable

    wrap(builder, "open_model", "load (open_model)")
    wrap(builder, "build_training_model", "build_training_model")
    wrap(builder, "hand_back", "hand_back")
    wrap(builder, "check_rules", "builder.check_rules")
    wrap(builder, "select_trainable")
    wrap(trainable, "constant_initializers", "parameters.constant_initializers")
    wrap(builder, "make_portable", "builder.make_portable")
    wrap(session, "open_step", "open_step")
    wrap(step, "open_model", "open_model (the returned ModelProto)")
    wrap(step, "assemble")
    wrap(step, "lowered", "lower")
    wrap(pipeline, "_lower", "pipeline._lower")
    pipeline.PIPELINE = tuple(_timed(f, f"pass {f.__name__}") for f in pipeline.PIPELINE)
    for attr in ("shape_hints", "finalize", "check_model"):
        wrap(pipeline, attr, f"pipeline.{attr}")
    wrap(step, "validate_training_info")
    wrap(step, "feed_host_scalars")
    wrap(step, "check_step_bindings")
    wrap(step, "loss_output")
    wrap(step, "step_model_parts", "step model parts")  # trees before the sixth session's bertsetup
    wrap(step, "checked_plain", "step model: checked_plain")
    wrap(step, "plain_step_parts", "step model parts")
    wrap(step_model, "validate_training_info", "step_model.validate_training_info")
    wrap(step_model, "finalize", "step_model: finalize")
    wrap(step_model, "check_model", "step_model: check_model")
    wrap(step, "run_pipeline", "step_fixes")
    wrap(step, "build_init_model", "init model")
    wrap(step, "plain_init_model", "init model")
    wrap(step, "fold_weight_arithmetic", "prefold")
    wrap(session, "open_runs", "open_runs (onnxruntime sessions)")
    wrap(runs, "split_step_model")
    wrap(runs, "prepare_run")
    wrap(runs.ort, "InferenceSession", "ort.InferenceSession")
    wrap(session, "forward_check", "forward_check (build)")
    wrap(forward_check.ForwardCheck, "run", "ForwardCheck.run")
    wrap(forward_check.ForwardCheck, "compare", "ForwardCheck.compare")
    wrap(runs.StepRuns, "execute", "StepRuns.execute")
    wrap(state.StateBuffers, "load_stored")
    del carrier


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def feeds_for(path: str, batch: int, seq: int, labels: int, vocab: int) -> dict:
    import onnx

    m = onnx.load(path, load_external_data=False)
    inits = {t.name for t in m.graph.initializer}
    rng = np.random.default_rng(0)
    feeds = {}
    for i in m.graph.input:
        if i.name in inits:
            continue
        tt = i.type.tensor_type
        dims = [d.dim_value or (batch if k == 0 else seq) for k, d in enumerate(tt.shape.dim)]
        if tt.elem_type == onnx.TensorProto.INT64:
            feeds[i.name] = rng.integers(0, vocab, dims).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(dims).astype(np.float32)
    feeds["labels"] = rng.integers(0, labels, batch).astype(np.int64)
    return feeds


def tiny_model(folder: str) -> tuple[str, int]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w1, w2])
    path = os.path.join(folder, "tiny.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path, 4


def run(path: str, feeds: dict, profile: int) -> None:
    import onnxruntime as ort

    from onnx_autodiff import TrainingSession, make_training_model

    instrument()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    with phase("TOTAL set-up to the first step"):
        with phase("make_training_model"):
            training = make_training_model(path, "cross_entropy", "adam")
        with phase("TrainingSession"):
            sess = TrainingSession(training, session_options=so, progress=False)
        peak_setup = _peak_mb()
        with phase("first step"):
            loss = float(sess.step(feeds)[sess.loss_name])
    if prof:
        prof.disable()
    with phase("second step"):
        loss2 = float(sess.step(feeds)[sess.loss_name])
    print(f"load {os.getloadavg()[0]:.2f}; losses {loss:.6f} {loss2:.6f}")
    print(f"peak RSS {peak_setup:.0f} MB after the set-up, {_peak_mb():.0f} MB after the second step")
    print(f"{'phase':<60} {'cpu s':>7} {'wall s':>7}")
    for depth, name, cpu, wall in ROWS:
        print(f"{'  ' * depth + name:<60} {cpu:7.2f} {wall:7.2f}")
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(profile)
        print(out.getvalue())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="an inference .onnx (BERT: benchmarks.run.prepare_large's export)")
    p.add_argument("--tiny", action="store_true", help="a small MLP built here instead")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--labels", type=int, default=2, help="classes of the cross entropy")
    p.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    p.add_argument("--profile", type=int, default=0, metavar="LINES")
    a = p.parse_args(argv)
    if a.tiny == (a.model is not None):
        p.error("give a model path or --tiny")
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path, labels = tiny_model(folder) if a.tiny else (a.model, a.labels)
        run(path, feeds_for(path, a.batch, a.seq, labels, a.vocab), a.profile)


if __name__ == "__main__":
    sys.exit(main())

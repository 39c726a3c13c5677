"""A step bundle driven from ``bundle.json`` alone, as a user's driver would: this file imports json, numpy and
the runtime's own package, nothing of onnx-autodiff (it checks so at the end). The loop is docs/runtimes.md's:
run ``init.onnx``, then per batch feed the batch, the state, the hyper-parameters and the host scalars, and carry
the state. Inputs and outputs go by position (``step_inputs``, ``step_outputs``, ``init_outputs``), which every
runtime keeps; tract's API names an output by the node that computes it.

    python drive.py RUNTIME JOBS.json

RUNTIME: reference, openvino or tract. ``JOBS.json``: ``[{"bundle", "batches", "out"}]``: each bundle folder trained
on its batches (an ``.npz`` of ``<step>/<feed>`` arrays); ``out`` (an ``.npz``) gets ``loss/<step>`` and
``state/<name>`` after the last step.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def open_model(runtime: str, path: Path):
    """``run(list of arrays in graph input order) -> list of arrays in graph output order``."""
    if runtime == "reference":
        from onnx.reference import ReferenceEvaluator

        ev = ReferenceEvaluator(str(path))
        return lambda arrays: ev.run(None, dict(zip(ev.input_names, arrays)))
    if runtime == "openvino":
        import openvino as ov

        core = ov.Core()
        compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})

        def run_openvino(arrays):
            result = compiled(dict(zip(compiled.inputs, arrays)))
            return [result[port] for port in compiled.outputs]
        return run_openvino
    if runtime == "tract":
        import tract

        plans = {}

        def run_tract(arrays):
            key = tuple(a.shape for a in arrays)
            if key not in plans:  # tract plans for the shapes it is given
                model = tract.onnx().load(str(path))
                for k, a in enumerate(arrays):
                    if a.ndim:
                        model.set_input_fact(k, f"{','.join(map(str, a.shape))},{TRACT[a.dtype.name]}")
                for k in range(model.output_count()):
                    model.set_output_fact(k, None)
                plans[key] = model.into_model().into_runnable()
            return [r.to_numpy() for r in plans[key].run(arrays)]
        return run_tract
    raise SystemExit(f"unknown runtime {runtime!r}")


TRACT = {"float32": "f32", "int64": "i64", "int32": "i32", "bool": "bool", "float64": "f64"}


def host_scalars(manifest: dict, state: dict) -> dict:
    out = {}
    for name, h in manifest.get("host_scalars", {}).items():
        t = int(np.asarray(state[h["counter"]]).reshape(-1)[0]) + h["offset"]
        value = np.prod([(1 - beta**t) ** power for beta, power in h["factors"]]) if "factors" in h else t
        out[name] = np.array(value, h["dtype"])
    return out


def train(runtime: str, folder: Path, batches: list[dict]) -> tuple[list[float], dict]:
    manifest = json.loads((folder / "bundle.json").read_text())
    assert manifest["format"] == "onnx-autodiff-step/2", manifest["format"]
    init = open_model(runtime, folder / manifest["init"])
    step = open_model(runtime, folder / manifest["step"])
    state = dict(zip(manifest["init_outputs"], init([])))
    hyper = {k: np.array(v, np.float32) for k, v in manifest["hyper"].items()}
    losses = []
    for batch in batches:
        feeds = {**batch, **state, **hyper, **host_scalars(manifest, state)}
        out = dict(zip(manifest["step_outputs"], step([np.asarray(feeds[n]) for n in manifest["step_inputs"]])))
        state = {i: np.asarray(out[o]) for i, o in manifest["state"].items()}
        losses.append(float(np.asarray(out[manifest["loss"]]).reshape(-1)[0]))
    return losses, state


def main(argv: list[str]) -> None:
    runtime, jobs = argv
    for job in json.loads(Path(jobs).read_text()):
        data = np.load(job["batches"])
        steps = sorted({int(k.split("/")[0]) for k in data.files})
        batches = [{k.split("/", 1)[1]: data[k] for k in data.files if k.split("/")[0] == str(s)} for s in steps]
        losses, state = train(runtime, Path(job["bundle"]), batches)
        np.savez(job["out"], **{f"loss/{k}": np.float64(v) for k, v in enumerate(losses)},
                 **{f"state/{k}": v for k, v in state.items()})
    assert not [m for m in sys.modules if m.split(".")[0] == "onnx_autodiff"], "the driver imported onnx-autodiff"


if __name__ == "__main__":
    main(sys.argv[1:])

"""OpenVINO (CPU) as a bundle runner, computing in f32: on CPUs with AMX the CPU plugin defaults to bf16
(INFERENCE_PRECISION_HINT), which moves the weights far from an f32 step."""
from __future__ import annotations

import openvino as ov

from ..errors import BundleError


def load(path: str):
    core = ov.Core()
    model = core.read_model(path)
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    takes = {n for i in compiled.inputs for n in i.get_names()}
    outputs = [(o, sorted(o.get_names())) for o in compiled.outputs]

    def run(feeds):
        unknown = sorted(set(feeds) - takes)
        if unknown:
            raise BundleError(f"{path!r} takes no inputs {unknown[:5]} (OpenVINO)")
        result = compiled(dict(feeds)) if feeds else compiled({})
        out = {}
        for port, names in outputs:
            for n in names:
                out[n] = result[port].copy()
        return out
    return run

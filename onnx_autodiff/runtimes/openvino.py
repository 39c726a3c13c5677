"""OpenVINO (CPU) as a bundle runner, computing in f32: on CPUs with AMX the CPU plugin defaults to bf16
(INFERENCE_PRECISION_HINT), which moves the weights far from an f32 step. Inputs and outputs are matched to the
compiled model's ports by their order in the ONNX graph: OpenVINO renames a port whose tensor is also another's
(an input that is also an output after it folds an Identity-like node keeps only the output's name)."""
from __future__ import annotations

import onnx
import openvino as ov

from .loop import check_feeds
from .refusal import refused


def version() -> str:
    return ov.__version__.split("-")[0]


def load(path: str):
    graph = onnx.load(path, load_external_data=False).graph
    inits = {t.name for t in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in inits]
    core = ov.Core()
    try:
        compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    except RuntimeError as e:
        raise refused("openvino", "convert", path, e) from None
    if len(compiled.inputs) == len(inputs) and len(compiled.outputs) == len(graph.output):
        ports = dict(zip(inputs, compiled.inputs))
        outputs = [(port, [o.name]) for port, o in zip(compiled.outputs, graph.output)]
    else:  # not one port per graph input and output: by the names OpenVINO kept
        ports = {n: i for i in compiled.inputs for n in i.get_names()}
        outputs = [(o, sorted(o.get_names())) for o in compiled.outputs]

    def run(feeds):
        check_feeds(path, "OpenVINO", ports, feeds)
        try:
            result = compiled({ports[k]: v for k, v in feeds.items()})
        except RuntimeError as e:
            raise refused("openvino", "run", path, e) from None
        out = {}
        for port, names in outputs:
            for n in names:
                out[n] = result[port].copy()
        return out
    return run

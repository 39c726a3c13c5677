"""The first step's forward checked against a plain onnxruntime run of the same graph: never a silent wrong base.

The step's sessions hold no weights: every weight is an input bound from our buffers, except the constants a
kernel must prepack (``ort_options.CONSTANT_INPUTS``). A kernel that computes differently when a tensor it
expects constant arrives at run time trained once, silently, against a base of zeros (MatMulNBits from an int4
model's file). So the first step of a session also runs the step's forward (the nodes its loss and its returned
inference outputs depend on) as a model loads: every weight an initializer, with the values the step reads,
on the same batch; the loss and those outputs must agree, or the step stops before it changes anything
(``ForwardMismatchError``). After the first step it costs nothing: the reference session is gone.

Tolerance: ``|step - reference| <= RTOL * max(1, max |reference|)`` per output. The two runs compute the same
nodes in float32 in graphs onnxruntime optimizes apart (the step's weights are inputs, which some fusions need
constant), so they differ by rounding: sums reordered (~1e-6 relative) and, for MatMulNBits at accuracy_level 4,
activations rounded to int8 per block of a slightly different input (measured up to 3e-4 relative on a builder
model's logits). A wrong base is off by the outputs' own size (a zero base: logits 0 where the model's are
O(1)). ``RTOL = 1e-2`` lies between.

When it runs (``TrainingSession(check_forward=...)``): ``"auto"``, the default, builds the reference only where a
node of the forward outside standard ONNX (a com.microsoft kernel such as MatMulNBits, or a node whose subgraphs
hold one) reads a tensor the step feeds at run time (a state tensor, or a frozen weight bound from our buffers):
standard-domain kernels are held to onnx's backend tests, which feed every input at run time, and the case the
check was made for is such a contrib node. ``True`` builds it whatever the model holds; ``False`` never does.
Where "auto" builds none, the first batch's float feeds are still checked for NaN / Inf (``DataError``).

Outputs that depend on a random op (a training-mode Dropout with a ratio that is not 0, RandomNormal, ...) differ
between any two runs and are not compared; a step whose loss depends on one is checked on its other outputs
only (often none: a LoRA dropout above 0 leaves nothing to compare).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..errors import ForwardMismatchError
from ..graph import ancestors, model_shell, node_inputs, subgraphs
from ..model.carrier import mapped_file, set_reference
from ..model.packed import is_packed
from ..model.weights import is_detached, mark_detached, set_tensor_bytes
from .train_data import check_finite

RTOL = 1e-2
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})
RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def _constant(graph: onnx.GraphProto, name: str):
    for t in graph.initializer:
        if t.name == name and not is_detached(t):
            return numpy_helper.to_array(t)
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            for a in n.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
    return None


def is_random(node: onnx.NodeProto, graph: onnx.GraphProto) -> bool:
    """A node whose output differs from run to run: a random op, or a Dropout in training mode with a ratio
    that is not a constant 0."""
    if node.op_type in RANDOM_OPS:
        return True
    if node.op_type != "Dropout":
        return False
    if len(node.input) < 3 or not node.input[2]:
        return False  # inference mode (opset 12+), or the ratio of an old Dropout that is_test decides
    mode = _constant(graph, node.input[2])
    if mode is not None and not bool(np.asarray(mode).reshape(-1)[0]):
        return False
    ratio = _constant(graph, node.input[1]) if len(node.input) > 1 and node.input[1] else np.float32(0.5)
    return ratio is None or float(np.asarray(ratio).reshape(-1)[0]) != 0.0


def compared_outputs(step_model: onnx.ModelProto, wanted: list[str]) -> tuple[list[str], list[str]]:
    """(outputs of ``wanted`` to compare, those left out because they depend on a random op)."""
    g = step_model.graph
    produced = {o for n in g.node for o in n.output}
    out, random = [], []
    for name in wanted:
        if name not in produced:
            continue
        if any(is_random(n, g) for n in ancestors(g.node, [name])):
            random.append(name)
        else:
            out.append(name)
    return out, random


class ForwardCheck:
    """The reference run of the first step. ``names``: the outputs compared; ``value(name)``: the array the
    step reads for an initializer (the state's current value, or the frozen weight)."""

    def __init__(self, step_model: onnx.ModelProto, names: list[str], skipped: list[str], providers,
                 options: Callable[[], ort.SessionOptions]):
        self.names, self.skipped, self.providers, self.options = names, skipped, providers, options
        g = step_model.graph
        nodes = ancestors(g.node, names)
        read = {x for n in nodes for x in node_inputs(n)} | set(names)
        inits = {t.name for t in g.initializer}
        m = model_shell(step_model)
        r = m.graph
        r.name = f"{g.name}_forward"
        r.node.extend(nodes)
        r.input.extend(i for i in g.input if i.name in read and i.name not in inits)
        r.initializer.extend(t for t in g.initializer if t.name in read)
        outputs = {o.name: o for o in g.output}
        r.output.extend(outputs[n] for n in names)
        r.value_info.extend(vi for vi in g.value_info if vi.name in read)
        self.model = m
        self.inputs = [i.name for i in r.input]

    def run(self, feeds: Mapping[str, ort.OrtValue], value: Callable[[str], np.ndarray],
            state: set[str]) -> dict[str, np.ndarray]:
        """The compared outputs from a session whose initializers hold the values the step reads. A NaN or
        Inf in a float feed (the first batch) is the data's fault: ``DataError`` naming the feed, not a
        mismatch (both runs give NaN, which compares unequal)."""
        check_feeds({n: feeds[n] for n in self.inputs if n not in state})
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        names, values, mapped = [], [], {}
        for t in m.graph.initializer:
            if is_detached(t) or t.name in state:
                arr = value(t.name)
                for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    t.ClearField(f)
                if is_packed(t.data_type):  # onnxruntime makes no OrtValue of int4 (...) from numpy: inline, packed
                    set_tensor_bytes(t, arr)
                    continue
                if mapped_file(arr) is not None:
                    mapped[t.name] = (t, mapped_file(arr))
                    continue
                mark_detached(t)
                names.append(t.name)
                values.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr)))
        options = self.options()
        if names:  # onnxruntime copies these
            options.add_external_initializers(names, values)
        if mapped:  # and maps these from their files, as it does a model's external data: no copy
            folder = os.path.commonpath([os.path.dirname(path) for _, (path, _, _) in mapped.values()])
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
            for t, (path, offset, length) in mapped.values():
                set_reference(t, os.path.relpath(path, folder).replace(os.sep, "/"), offset, length)
        sess = ort.InferenceSession(m.SerializeToString(), options, providers=self.providers)
        got = sess.run_with_ort_values(self.names, {n: feeds[n] for n in self.inputs})
        return {n: v.numpy().copy() for n, v in zip(self.names, got)}

    def compare(self, expected: Mapping[str, np.ndarray], values: Mapping[str, ort.OrtValue], step: int) -> None:
        """ForwardMismatchError for the first output of ``values`` off its reference by more than the tolerance."""
        for name in self.names:
            if name not in values:
                continue
            got = np.asarray(values[name].numpy(), np.float64)
            ref = np.asarray(expected[name], np.float64)
            if got.shape != ref.shape:
                raise ForwardMismatchError(name, step, f"in shape: {list(got.shape)}, where the model gives "
                                                       f"{list(ref.shape)}")
            scale = max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
            diff = float(np.max(np.abs(got - ref))) if ref.size else 0.0
            if not diff <= RTOL * scale:
                tolerance = f"{RTOL * scale:.3g}: {RTOL:g} of the largest value, {scale:.4g}"
                raise ForwardMismatchError(name, step, f"by up to {diff:.4g}, where the tolerance is {tolerance}")


def check_feeds(feeds: Mapping) -> None:
    """``DataError`` naming a float feed (an array or an OrtValue) that holds NaN or Inf."""
    check_finite({n: v.numpy() if isinstance(v, ort.OrtValue) else np.asarray(v) for n, v in feeds.items()
                  if _is_float(v)}, what="the feed")


def _is_float(value) -> bool:
    if isinstance(value, ort.OrtValue):
        return value.data_type() in ("tensor(float)", "tensor(float16)", "tensor(double)")
    return np.asarray(value).dtype.kind == "f"


def _foreign(node: onnx.NodeProto) -> bool:
    """A node outside standard ONNX, or one whose subgraphs hold one."""
    return node.domain not in STANDARD_DOMAINS or any(_foreign(n) for g in subgraphs(node) for n in g.node)


def foreign_readers(step_model: onnx.ModelProto, names: list[str], fed: set[str]) -> list[str]:
    """The nodes ``names`` depend on that lie outside standard ONNX and read one of ``fed`` (the tensors the step
    binds at run time), as ``"domain.Op 'node'"``."""
    return [f"{n.domain}.{n.op_type} {n.name!r}" for n in ancestors(step_model.graph.node, names)
            if _foreign(n) and any(x in fed for x in node_inputs(n))]


def forward_check(step_model: onnx.ModelProto, loss: str | None, outputs: list[str], inference_outputs: set[str],
                  providers, options: Callable[[], ort.SessionOptions],
                  fed: set[str] | None = None) -> ForwardCheck | None:
    """The check of a session's first step: its loss and the inference-model outputs it returns (``outputs``),
    less those a random op makes differ between runs; None when nothing is left to compare. ``fed`` (the
    ``"auto"`` rule): also None unless a node outside standard ONNX reads one of these run-time tensors."""
    wanted = [o for o in outputs if o in inference_outputs and o != loss] + ([loss] if loss else [])
    names, skipped = compared_outputs(step_model, wanted)
    if not names or (fed is not None and not foreign_readers(step_model, names, fed)):
        return None
    return ForwardCheck(step_model, names, skipped, providers, options)


__all__ = ["ForwardCheck", "forward_check", "foreign_readers", "check_feeds", "compared_outputs", "is_random", "RTOL",
           "RANDOM_OPS", "STANDARD_DOMAINS"]

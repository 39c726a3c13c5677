"""The small API gradient rules write against: a node view and a scoped node builder.

A rule never touches protobufs or invents names: it calls ``g.Mul(a, b)``, ``g.const(1.0, like=x)``,
``g.unbroadcast(dz, x, z)`` and returns one gradient name (or None) per input.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GradientRuleError, OpsetTooOldError
from ..graph import GraphView, TensorInfo, decoded, fresh_name

Grads = list  # list[str | None]: one gradient name (or None) per output (dy) or per input (a rule's result)

_INT_OUT = {"Shape", "Size", "NonZero", "ArgMax", "ArgMin"}
_BOOL_OUT = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor",
             "IsNaN", "IsInf"}


class NodeView:
    """What a rule sees of its forward node."""

    def __init__(self, node: onnx.NodeProto, opset: int, needs: Sequence[bool], outer_inputs: Sequence[str] = ()):
        self.proto = node
        self.name = node.name
        self.op_type = node.op_type
        self.domain = node.domain
        self.opset = opset
        self.inputs = node.input[:]  # [:]: one call (iterating a upb field ends in a formatted IndexError)
        self.outputs = node.output[:]
        # outer-scope tensors its subgraphs read; gradient i for i >= len(inputs) goes to outer_inputs[i - len(inputs)]
        self.outer_inputs = list(outer_inputs)
        self._needs = list(needs)
        self._attrs = {a.name: a for a in node.attribute[:]}

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute's value (strings as ``str``), or ``default`` when the node does not set it."""
        a = self._attrs.get(name)
        return default if a is None else decoded(helper.get_attribute_value(a))

    def has_attr(self, name: str) -> bool:
        return name in self._attrs

    def input(self, i: int) -> str | None:
        """The i-th input's name, or None when it is absent or empty."""
        return self.inputs[i] if i < len(self.inputs) and self.inputs[i] else None

    def output(self, i: int) -> str | None:
        return self.outputs[i] if i < len(self.outputs) and self.outputs[i] else None

    def needs_grad(self, i: int) -> bool:
        """Whether the engine wants a gradient for input i (skip the work for the others); indices past
        the inputs refer to ``outer_inputs``."""
        return i < len(self._needs) and self._needs[i]

    def __repr__(self):
        return f"<{self.op_type} node {self.name!r}>"


_OPTIONS: ContextVar[tuple] = ContextVar("emit_options", default=())  # (name, value) pairs


@contextmanager
def emit_options(**options):
    """Within the block, every emitter starts with these switches of the emitted forms (``Emitter``): a test
    or a benchmark lowers the same model with a fast form off to compare it with the plain one."""
    token = _OPTIONS.set(tuple({**dict(_OPTIONS.get()), **options}.items()))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def emit_option(name: str, default):
    """The value ``emit_options`` gives ``name`` in this block, else ``default``: for a pass that runs outside an
    Emitter (``engine/peephole_cnn.py``)."""
    return dict(_OPTIONS.get()).get(name, default)


class Emitter:
    """Collects the nodes of one lowering; owns names, constants and the info of new tensors.

    ``target``: the runtime the nodes are for (a record with ``has_op(op_type)``, ``runtimes/targets.py``;
    None: every op); rules pick forms it has. ``options``: switches of the emitted forms, read by rules and
    the peephole as ``option(name, default)`` (tests and benchmarks compare a fast form with the plain one),
    on top of those ``emit_options`` sets for a block of code."""

    def __init__(self, view: GraphView, taken: set[str], target=None, options: dict | None = None):
        self.view = view
        self.target = target
        self.options = {**dict(_OPTIONS.get()), **(options or {})}
        self.info = view.info
        self.taken = taken
        # the forward walk (``forward.push_forward``), set by the forward engine: a JVP rule that emits an op's
        # decomposition pushes tangents through it (``GradBuilder.push``)
        self.push = None
        self.tangents: dict[str, str] | None = None  # the forward walk's tangents so far (``tangent_of``)
        # node name -> {output: the tensor standing for it}: the nodes whose outputs a JVP rule computes itself
        # (``GradBuilder.replace_outputs``); None where the walk's caller cannot drop a node
        self.replacements: dict[str, dict[str, str]] | None = None
        self.nodes: list[onnx.NodeProto] = []
        self._consts: dict[tuple, str] = {}
        self.constants: dict[str, np.ndarray] = {}  # the values of the Constants emitted (forward.local_view)
        self._count: dict[str, int] = {}

    def fresh(self, base: str) -> str:
        n = self._count.get(base, 0)
        while True:
            name = f"{base}_{n}"
            n += 1
            if name not in self.taken:
                self._count[base] = n
                self.taken.add(name)
                return name

    @property
    def opset(self) -> int:
        return self.view.opset("")


ONE_HOT_ROWS = 1024  # classes: past this the identity matrix of ``one_hot_rows`` (C x C) is too large


class GradBuilder:
    """Emits nodes named under a scope (``<forward node>/grad``)."""

    def __init__(self, emitter: Emitter, scope: str):
        self.em = emitter
        self.scope = scope

    # ---- facts -----------------------------------------------------------------------------------
    @property
    def opset(self) -> int:
        """The model's default-domain opset: emitted nodes must be valid at this version."""
        return self.em.opset

    def has_op(self, op_type: str) -> bool:
        """Whether the target runtime (``runtimes/targets.py``) implements default-domain ``op_type``."""
        return self.em.target is None or self.em.target.has_op(op_type)

    def has_output(self, op_type: str, index: int) -> bool:
        """Whether the target runtime computes output ``index`` of default-domain ``op_type`` (MaxPool's
        Indices: not on WebGPU)."""
        return self.em.target is None or self.em.target.has_output(op_type, index)

    def has_int64(self) -> bool:
        """Whether the target runtime computes on int64 tensors (onnxruntime-web's WebGPU does not: a compare or
        an Unsqueeze of class labels would run on the CPU)."""
        return self.em.target is None or self.em.target.int64

    def option(self, name: str, default):
        """A switch of the emitted forms (``Emitter.options``), ``default`` unless the lowering set it."""
        return self.em.options.get(name, default)

    def dtype(self, name: str) -> int | None:
        return self.em.view.dtype(name)

    def shape(self, name: str) -> tuple | None:
        return self.em.view.shape(name)

    def rank(self, name: str) -> int | None:
        s = self.shape(name)
        return None if s is None else len(s)

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape when every dim is a known integer, else None."""
        s = self.shape(name)
        if s is None or any(not isinstance(d, int) for d in s):
            return None
        return tuple(s)

    def producer(self, name: str) -> onnx.NodeProto | None:
        """The forward node that computes tensor ``name`` (None for graph inputs and initializers)."""
        return self.em.view.producer.get(name)

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        """The forward nodes that read tensor ``name``."""
        return list(self.em.view.consumers.get(name, ()))

    def tangent_of(self, name: str) -> str | None:
        """In a forward walk, the tangent of forward tensor ``name`` pushed so far (None: zero, or not a forward
        walk): a JVP rule may rewrite the tangent of its input from the tangents its producer read."""
        return None if self.em.tangents is None else self.em.tangents.get(name)

    def can_replace_outputs(self) -> bool:
        """Whether this forward walk lets a JVP rule compute its node's outputs itself (``replace_outputs``)."""
        return self.em.replacements is not None

    def replace_outputs(self, node: NodeView | onnx.NodeProto, values: Sequence[str | None],
                        tangents: Sequence[str | None] | None = None) -> None:
        """In a JVP rule, where ``can_replace_outputs()``: ``values[k]`` (emitted by the rule) stands for the node's
        output k, and the node is dropped from the model, so the rule computes the primal once beside its tangent
        (an LSTM unrolled instead of the fused node and an unrolled copy). ``node`` may also be a later node of
        the walk (a forward ``NodeProto``) whose outputs the rule has computed on the way, with their
        ``tangents``: the walk then skips it (the HVP's LSTM backward reuses the forward's pre-activations)."""
        if self.em.replacements is None:
            raise GradientRuleError("replace_outputs(): this forward walk cannot drop a node; ask "
                                    "can_replace_outputs() first")
        proto = node.proto if isinstance(node, NodeView) else node
        outs = list(proto.output)
        missing = [o for k, o in enumerate(outs) if o and (k >= len(values) or not values[k])]
        if missing:
            raise GradientRuleError(f"replace_outputs() for node {proto.name!r} gives nothing for its outputs "
                                    f"{missing}")
        self.em.replacements[proto.name] = {o: v for o, v in zip(outs, values) if o}
        if tangents is not None and self.em.tangents is not None:
            self.em.tangents.update({o: t for o, t in zip(outs, tangents) if o and t})

    def value(self, name: str | None):
        """The numpy value of a constant input (Constant node or non-input initializer), else None."""
        return None if not name else self.em.view.value(name)

    def np_dtype(self, name: str):
        dt = self.dtype(name)
        if dt is None:
            raise GradientRuleError(f"the element type of {name!r} is unknown; run shape inference or annotate it")
        return helper.tensor_dtype_to_np_dtype(dt)

    # ---- emission --------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A new tensor name under this builder's scope (for the inputs and outputs of a subgraph)."""
        return self.em.fresh(f"{self.scope}/{base}")

    def declare(self, name: str, dtype: int | None, shape: tuple | None = None) -> None:
        """Record the type (and shape) of an emitted tensor that the builder cannot tell (a Loop's outputs)."""
        self.em.info[name] = TensorInfo(dtype, shape)

    def op(self, op_type: str, *inputs: str | None, outputs: int | Sequence[str] = 1, domain: str = "", **attrs):
        """Emit one node; returns its output name, or a tuple when it has several. ``outputs``: how many, or
        their names (a tensor others read by name: a graph's output, a state tensor; ``name``)."""
        name = self.em.fresh(f"{self.scope}/{op_type}")
        if isinstance(outputs, int):
            outs = [name] + [self.em.fresh(f"{name}:{i}") for i in range(1, outputs)]
        else:
            outs = list(outputs)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        ins = [i or "" for i in inputs]
        node = helper.make_node(op_type, ins, outs, name=name, domain=domain or None, **attrs)
        self.em.nodes.append(node)
        self._record_info(node, ins, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def name(self, want: str) -> str:
        """``<scope>/<want>`` itself when no tensor has that name yet, else with a number: the name of a tensor
        that others read by name (``op(..., outputs=[name])``)."""
        return fresh_name(self.em.taken, f"{self.scope}/{want}" if self.scope else want)

    def under(self, scope: str):
        """A builder of the same nodes whose names go under ``<this scope>/<scope>`` (a loss, an optimizer's part)."""
        sub = copy.copy(self)
        sub.scope = f"{self.scope}/{scope}" if self.scope else scope
        return sub

    def same_op(self, node: NodeView, *inputs: str | None, outputs: int = 1, **attrs):
        """The node's own op and attributes (``attrs`` over them; None drops one) on other inputs: a linear
        op applied to tangents."""
        out = self.op(node.op_type, *inputs, outputs=outputs, domain=node.domain, **attrs)
        self.em.nodes[-1].attribute.extend(a for a in node.proto.attribute if a.name not in attrs)
        return out

    def mark(self) -> int:
        """Where the emitted nodes stand now: ``push(since=mark)`` pushes tangents through those emitted after."""
        return len(self.em.nodes)

    def push(self, since: int, tangents: dict[str, str]) -> dict[str, str]:
        """Tangents pushed forward, from ``tangents`` (tensor -> tangent), through the nodes this rule emitted
        since ``mark()`` (an op's decomposition into ops with rules): the tangent of every tensor they reach."""
        if self.em.push is None:
            raise GradientRuleError("push() is for JVP rules: the forward walk sets it")
        return self.em.push(self.em, self.em.nodes[since:], tangents, f"{self.scope}/push")

    def __getattr__(self, op_type: str):
        if op_type[:1].isupper():
            return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)
        raise AttributeError(op_type)

    def _record_info(self, node: onnx.NodeProto, inputs: list[str], outputs: list[str]) -> None:
        """The element type of the new node's outputs (``inputs``/``outputs``: its names, read from
        Python lists rather than the message)."""
        op = node.op_type
        if op in _INT_OUT:
            dt = TensorProto.INT64
        elif op in _BOOL_OUT:
            dt = TensorProto.BOOL
        elif op == "Cast":
            dt = next(a.i for a in node.attribute[:] if a.name == "to")
        elif op in ("Constant", "ConstantOfShape"):  # attribute[:]: one call (see graph.py's docstring)
            vals = [a.t for a in node.attribute[:] if a.name == "value"]
            dt = vals[0].data_type if vals else TensorProto.FLOAT
        elif op == "CastLike":
            dt = self.dtype(inputs[1])
        elif op == "OneHot":
            dt = self.dtype(inputs[2])
        elif op == "DequantizeLinear":
            dt = self.dtype(inputs[1])
        elif op == "Where":
            dt = self.dtype(inputs[1]) or self.dtype(inputs[2])
        else:  # the first input of known type (the view's info read directly: this runs for every node)
            info, dt = self.em.view.info, None
            for i in inputs:
                t = info.get(i) if i else None
                if t is not None and t.dtype is not None:
                    dt = t.dtype
                    break
        for o in outputs:
            self.em.info.setdefault(o, TensorInfo(dt, None))

    def const(self, value, like: str | None = None, dtype=None) -> str:
        """A Constant of ``value`` with the element type of tensor ``like`` (or numpy ``dtype``)."""
        if dtype is None:
            dtype = self.np_dtype(like) if like is not None else np.asarray(value).dtype
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        cached = self.em._consts.get(key)
        if cached is not None:
            return cached
        if self.opset < 9 and arr.dtype.kind not in "f":
            # Constant takes only float tensors before opset 9: carry the value as double, then Cast
            # (exact for the shapes, axes and indices rules build).
            dbl = self.op("Constant", value=numpy_helper.from_array(arr.astype(np.float64)))
            name = self.op("Cast", dbl, to=helper.np_dtype_to_tensor_dtype(arr.dtype))
        else:
            name = self.op("Constant", value=numpy_helper.from_array(arr))
        self.em._consts[key] = name
        self.em.constants[name] = arr
        self.em.info[name] = TensorInfo(helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape)
        return name

    def ints(self, values) -> str:
        """A 1-D int64 Constant (shapes, axes, indices)."""
        return self.const(np.asarray(values, dtype=np.int64).reshape(-1))

    # ---- shapes ----------------------------------------------------------------------------------
    def shape_of(self, x: str) -> str:
        """``Shape(x)``, folded into a Constant when the shape is static."""
        s = self.static_shape(x)
        return self.ints(s) if s is not None else self.op("Shape", x)

    def full_like(self, x: str, value: float, like: str | None = None) -> str:
        """A tensor of x's shape filled with ``value`` in the element type of ``like`` (default x)."""
        if self.opset < 9:  # no ConstantOfShape yet: a Constant of the static shape
            shape = self.static_shape(x)
            if shape is None:
                self.needs_opset(9, f"a tensor shaped like {x!r} (its shape is not static)")
            return self.const(np.full(shape, value, dtype=self.np_dtype(like or x)))
        return self.full(self.shape_of(x), value, like or x)

    def full(self, shape: str, value: float, like: str) -> str:
        """``ConstantOfShape``: a tensor of the run-time ``shape`` (a 1-D int64 tensor) filled with ``value``
        in the element type of ``like``."""
        fill = np.array([value], dtype=self.np_dtype(like))
        if not self.has_op("ConstantOfShape"):  # WebGPU: the value expanded, on the device
            return self.op("Expand", self.const(fill.reshape(())), shape)
        return self.op("ConstantOfShape", shape, value=numpy_helper.from_array(fill))

    def one_hot_rows(self, t: str, classes, like: str, rank: int) -> str | None:
        """``[N, C, d...]`` 0/1 in the element type of ``like``: the row ``t`` of an identity matrix for every target
        ``t`` ``[N, d...]`` (``rank``: the scores'). One Gather: no arithmetic on the int64 targets, which a runtime
        without int64 kernels (onnxruntime-web's WebGPU) would run on the CPU. None when ``classes`` is not a static
        number up to ``ONE_HOT_ROWS`` (the identity matrix is C x C)."""
        if not isinstance(classes, int) or classes > ONE_HOT_ROWS:
            return None
        rows = self.Gather(self.const(np.eye(classes, dtype=self.np_dtype(like))), t, axis=0)  # [N, d..., C]
        return rows if rank == 2 else self.Transpose(rows, perm=[0, rank - 1] + list(range(1, rank - 1)))

    def mask(self, cond: str, like: str) -> str:
        """A boolean tensor as 0/1 in the element type of ``like``."""
        return self.op("Cast", cond, to=self.dtype(like))

    def dim(self, x: str, axis: int) -> str:
        """x's size along ``axis`` as a 1-D int64 tensor of one element (a Constant when static)."""
        s = self.shape(x)
        if s is not None and isinstance(s[axis], int):
            return self.ints([s[axis]])
        return self.op("Gather", self.op("Shape", x), self.ints([axis]))

    def need_rank(self, x: str) -> int:
        """x's rank; a GradientRuleError saying what to do when it is unknown."""
        r = self.rank(x)
        if r is None:
            raise GradientRuleError(f"the gradient needs the rank of {x!r}; run shape inference or annotate its shape")
        return r

    def int_values(self, name: str | None) -> list[int] | None:
        """The value of a constant integer input as a flat list; None when absent or not constant."""
        v = self.value(name)
        return None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]

    def expand_to(self, t: str, x: str, like: str) -> str:
        """Tangent ``t`` of tensor ``x`` broadcast to the shape of ``like``: no node when the declared
        shapes of x and ``like`` are equal and known."""
        sx, sl = self.shape(x), self.shape(like)
        if sx is not None and sx == sl and None not in sx:
            return t
        return self.expand_like(t, like)

    def zeros_like(self, x: str) -> str:
        return self.full_like(x, 0.0)

    def ones_like(self, x: str) -> str:
        return self.full_like(x, 1.0)

    # ---- opset-aware forms -----------------------------------------------------------------------
    def reduce_sum(self, x: str, axes: Sequence[int] | None, keepdims: bool = True) -> str:
        """ReduceSum over static ``axes`` (None: every axis); no node when ``axes`` is empty."""
        if axes is not None and len(axes) == 0:
            return x
        if self.opset >= 13:
            ax = None if axes is None else self.ints(list(axes))
            return self.op("ReduceSum", x, ax, keepdims=int(keepdims))
        return self.op("ReduceSum", x, keepdims=int(keepdims), axes=None if axes is None else list(axes))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        if not axes:
            return x
        if self.opset >= 13:
            return self.op("Unsqueeze", x, self.ints(list(axes)))
        return self.op("Unsqueeze", x, axes=list(axes))

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        if not axes:
            return x
        if self.opset >= 13:
            return self.op("Squeeze", x, self.ints(list(axes)))
        return self.op("Squeeze", x, axes=list(axes))

    def reshape_like(self, x: str, like: str) -> str:
        """x reshaped to the shape of ``like``, exactly: a 0 in Shape(like) is a 0, not a copied dim
        (``allowzero`` from opset 14; below, a run-time shape with a zero dim would be misread)."""
        s = self.static_shape(like)
        if s is not None and 0 not in s:
            return self.op("Reshape", x, self.ints(s))
        if self.opset >= 14:
            return self.op("Reshape", x, self.op("Shape", like), allowzero=1)
        return self.op("Reshape", x, self.op("Shape", like))

    def needs_opset(self, opset: int, what: str):
        """Raise OpsetTooOldError: ``what`` needs ``opset`` (lower() then converts the model, once)."""
        raise OpsetTooOldError(
            f"{self.scope.rsplit('/grad', 1)[0]!r}: {what} needs opset {opset}, the model has opset {self.opset}. "
            f"lower() converts the model to opset {opset} with onnx.version_converter; or re-export it at "
            f"opset {opset} or newer", needs=opset)

    def require(self, opset: int, what: str) -> None:
        """``needs_opset`` when the model's opset is below ``opset``: what follows may emit ops of ``opset``."""
        if self.opset < opset:
            self.needs_opset(opset, what)

    def slice(self, x: str, starts: Sequence[int], ends: Sequence[int], axes: Sequence[int],
              steps: Sequence[int] | None = None) -> str:
        """Slice with static bounds: inputs from opset 10, attributes before (unit steps only)."""
        if steps is not None and all(s == 1 for s in steps):
            steps = None
        if self.opset >= 10:
            return self.op("Slice", x, self.ints(starts), self.ints(ends), self.ints(axes),
                           None if steps is None else self.ints(steps))
        if steps is not None:
            self.needs_opset(10, "a Slice with steps")
        big = np.iinfo(np.int64).max
        return self.op("Slice", x, starts=list(starts), ends=[min(e, big) for e in ends], axes=list(axes))

    def pad(self, x: str, pads: Sequence[int], value: float = 0.0) -> str:
        """Constant Pad with static pads (``[begins..., ends...]``): attributes below opset 11."""
        if not any(pads):
            return x
        if self.opset >= 11:
            fill = None if value == 0.0 else self.const(value, like=x)
            return self.op("Pad", x, self.ints(pads), fill)
        return self.op("Pad", x, pads=list(pads), value=float(value) if value else None)

    def split(self, x: str, axis: int, sizes: Sequence[int]) -> list[str]:
        """Split into static sizes: the sizes as an attribute below opset 13, an input from 13."""
        if len(sizes) == 1:
            return [x]
        if self.opset >= 13:
            return list(self.op("Split", x, self.ints(sizes), outputs=len(sizes), axis=axis))
        return list(self.op("Split", x, outputs=len(sizes), axis=axis, split=list(sizes)))

    def cast_like(self, x: str, like: str) -> str:
        """x in the element type of ``like``: CastLike from opset 15, Cast to like's (known) type before."""
        if self.opset >= 15:
            return self.op("CastLike", x, like)
        return self.op("Cast", x, to=self.dtype(like))

    def count(self, x: str, y: str) -> str:
        """How many elements of x went into each element of y (a reduction of x), as a scalar of x's type."""
        return self.cast_like(self.op("Div", self.op("Size", x), self.op("Size", y)), x)

    def where(self, cond: str, a: str, b: str) -> str:
        """``Where(cond, a, b)``; below opset 9 arithmetic on a 0/1 mask (a and b must be finite)."""
        if self.opset >= 9:
            return self.op("Where", cond, a, b)
        m = self.op("Cast", cond, to=self.dtype(a) or self.dtype(b))
        return self.op("Add", b, self.op("Mul", m, self.op("Sub", a, b)))

    def sign(self, x: str) -> str:
        """``Sign(x)``; below opset 9 a difference of two 0/1 masks."""
        if self.opset >= 9:
            return self.op("Sign", x)
        zero = self.const(0.0, like=x)
        pos = self.op("Cast", self.op("Greater", x, zero), to=self.dtype(x))
        neg = self.op("Cast", self.op("Less", x, zero), to=self.dtype(x))
        return self.op("Sub", pos, neg)

    def expand_like(self, x: str, like: str) -> str:
        """x broadcast to the shape of ``like``: Expand from opset 8, a product with ones before."""
        if self.opset >= 8:
            return self.op("Expand", x, self.shape_of(like))
        if self.static_shape(like) is None:
            self.needs_opset(8, f"broadcasting to the shape of {like!r}, which is not static,")
        return self.op("Mul", x, self.ones_like(like))

    def scatter_elements(self, data: str, indices: str, updates: str, axis: int = 0, add: bool = False) -> str:
        """ScatterElements (opset 11; Scatter at 9 and 10); ``add`` accumulates repeated indices,
        which needs reduction='add' (opset 16)."""
        if add and self.opset < 16:
            self.needs_opset(16, "ScatterElements with reduction='add'")
        if self.opset >= 11:
            return self.op("ScatterElements", data, indices, updates, axis=axis, reduction="add" if add else None)
        if self.opset < 9:
            self.needs_opset(9, "Scatter")
        return self.op("Scatter", data, indices, updates, axis=axis)

    def one_hot(self, indices: str, depth: str, like: str, axis: int = -1) -> str:
        """OneHot(indices) in the element type of ``like`` (negative indices count from the back).

        Built in float32 and cast: onnxruntime's OneHot has no double kernel. Below opset 9 (no OneHot)
        only constant indices and depth, folded into a constant."""
        if self.opset < 9:
            v, d = self.value(indices), self.value(depth)
            if v is None or d is None:
                self.needs_opset(9, "OneHot of indices known only at run time")
            d = int(np.asarray(d).reshape(-1)[0])
            v = np.asarray(v)
            return self.const(np.moveaxis(np.eye(d)[v % d], -1, axis if axis >= 0 else v.ndim + 1 + axis), like=like)
        if self.dtype(indices) != TensorProto.INT64:
            indices = self.op("Cast", indices, to=TensorProto.INT64)
        hot = self.op("OneHot", indices, depth, self.const(np.array([0.0, 1.0], dtype=np.float32)), axis=axis)
        self.declare(hot, TensorProto.FLOAT)
        return hot if self.dtype(like) == TensorProto.FLOAT else self.op("Cast", hot, to=self.dtype(like))

    def gemm(self, a: str, b: str, c: str | None = None, **attrs) -> str:
        """Gemm; C optional from opset 11, a zero C (broadcast) before."""
        if c is None and self.opset < 11:
            c = self.const(0.0, like=a)
        return self.op("Gemm", a, b, c, **attrs)

    # ---- broadcasting ----------------------------------------------------------------------------
    def unbroadcast(self, dz: str, x: str, z: str | None = None, *, shape: tuple | None = None) -> str:
        """Sum ``dz`` (shaped like forward output ``z``, or ``shape`` for a tensor the rule built) down to
        the shape of input ``x``.

        Static when the shapes tell which axes were broadcast. Where they do not but both ranks are known,
        the axes are picked at run time from ``Shape(x)`` into an axes tensor of static length (every runtime
        converts that; OpenVINO refuses axes of a length known only at run time); with a rank unknown, from
        ``Shape(x)`` and ``Shape(dz)`` through NonZero.
        """
        if z is None and shape is not None:
            self.declare(dz, self.dtype(dz) or self.dtype(x), tuple(shape))
        z_shape = self.shape(z) if z is not None else shape
        plan = broadcast_plan(self.shape(x), z_shape if z_shape is not None else self.shape(dz))
        if plan is None:
            return self._unbroadcast_dynamic(dz, x)
        lead, kept, unsure, rank = plan
        if unsure:
            return self._unbroadcast_ranked(dz, x, lead, kept, unsure, rank)
        if not kept:
            return self.reduce_sum(dz, list(range(lead)), keepdims=False)
        r = self.reduce_sum(dz, list(range(lead)) + kept, keepdims=True)
        return self.squeeze(r, list(range(lead)))

    def _unbroadcast_ranked(self, dz: str, x: str, lead: int, kept: list[int], unsure: list[int], rank: int) -> str:
        """ReduceSum over ``fixed`` and over each axis of ``unsure`` where x's dim is 1 at run time: ``dz`` gets one
        trailing size-1 axis per unsure axis, and an unsure axis that was not broadcast reduces its stand-in
        instead, so the axes tensor has a static length. Reshaped to ``Shape(x)``."""
        if self.opset < 13:
            self.needs_opset(13, f"undoing the broadcast of {x!r} at run time (its shape is not static)")
        fixed = list(range(lead)) + kept
        sx = self.op("Shape", x)
        padded = self.unsqueeze(dz, list(range(rank, rank + len(unsure))))
        one = self.ints([1])
        pieces = [self.ints(fixed)] if fixed else []
        for j, axis in enumerate(unsure):
            dim = self.op("Gather", sx, self.ints([axis - lead]), axis=0)
            pieces.append(self.op("Where", self.op("Equal", dim, one), self.ints([axis]), self.ints([rank + j])))
        axes = pieces[0] if len(pieces) == 1 else self.op("Concat", *pieces, axis=0)
        r = self.op("ReduceSum", padded, axes, keepdims=1)
        return self.op("Reshape", r, sx)

    @staticmethod
    def broadcast_shape(s1: Sequence | None, s2: Sequence | None) -> tuple | None:
        """numpy broadcast of two shapes with int / symbolic dims (None for a dim it cannot tell); None
        when either shape is unknown."""
        if s1 is None or s2 is None:
            return None
        n = max(len(s1), len(s2))
        s1 = (1,) * (n - len(s1)) + tuple(s1)
        s2 = (1,) * (n - len(s2)) + tuple(s2)
        return tuple(a if a == b or b == 1 else b if a == 1 else None for a, b in zip(s1, s2))

    def _unbroadcast_dynamic(self, dz: str, x: str) -> str:
        if self.opset < 13:
            self.needs_opset(13, f"undoing the broadcast of {x!r} at run time (its shape is not static)")
        one = self.ints([1])
        sx = self.op("Shape", x)
        sz = self.op("Shape", dz)
        pad_len = self.op("Sub", self.op("Size", sz), self.op("Size", sx))
        pad = self.full(self.op("Reshape", pad_len, one), 1, sx)
        padded = self.op("Concat", pad, sx, axis=0)
        axes = self.op("Reshape", self.op("NonZero", self.op("Equal", padded, one)), self.ints([-1]))
        r = self.op("ReduceSum", dz, axes, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", r, sx)


def broadcast_plan(x_shape: tuple | None, z_shape: tuple | None):
    """How ``z`` was broadcast from ``x`` when both ranks are known: ``(lead, kept, unsure, rank of z)``: the
    number of leading axes, the axes of z where x's dim is 1, and those where the shapes cannot tell (a symbolic
    or unknown dim of x facing another dim: 1 or the same at run time). None when a rank is unknown."""
    if x_shape is None or z_shape is None or len(x_shape) > len(z_shape):
        return None
    lead = len(z_shape) - len(x_shape)
    kept, unsure = [], []
    for i, (xd, zd) in enumerate(zip(x_shape, z_shape[lead:])):
        if (xd == zd and xd is not None) or zd == 1 or (isinstance(xd, int) and xd != 1):
            continue  # the same dim; z's dim 1 (x's is 1 too); x's static dim other than 1 (z's is the same)
        (kept if xd == 1 else unsure).append(lead + i)
    return lead, kept, unsure, len(z_shape)


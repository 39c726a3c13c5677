"""Random graphs made from the rule registry's own cases (hypothesis): every op with a rule case, placed anywhere
in a float64 graph, its gradient held against central differences by ``check_graph``.

A graph starts from one or two graph inputs (ranks 0-4, some dims symbolic) and places node templates
(``templates.py``: one per rule case) one after the other. Each template input the case differentiates is fed

- a fresh graph input or weight of the case's shape and value range, or
- a tensor the graph already has: as it is (tensors reused, ``Mul(t, t)``), transposed (``Q @ K^T`` of
  computed Q and K), expanded, or flattened, cut or tiled and reshaped to the shape;

a computed tensor is moved into the case's value range (``low + (high - low) * sigmoid((t - mean) / std)``, and
away from zero by ``gap``), and the inputs of a piecewise op (``NodeTemplate.piecewise``) get distinct offsets
so that no two values tie. Elementwise ops take any shapes of rank 0-4 that broadcast; other ops their case's
shapes, or those with each distinct size changed (the first input's shape that of a tensor the graph has, or
its transpose: products of computed tensors). Attributes: the case's, with FLOAT attributes scaled, 0/1 flags
flipped and the axis of an elementwise op redrawn. Every node is run as it is placed (``run_nodes``): a node
that does not run, or whose outputs are not finite or past ``LIMIT``, is taken back, so every graph is valid and
its values are tame. If / Loop / Scan nodes wrap a few templates in a body that reads the outer graph
(``control_graphs.py``).

The outputs are the tensors nothing reads; every graph input and weight is differentiated (``check.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..graph import info_from_type, node_inputs, walk_graphs
from ..ort_options import session_options
from .check import FuzzGraph, graph_to_float32, has_loop
from .control_graphs import Invalid, place_control
from .deps import strategies
from .rule_cases import In, RuleCase
from .templates import NodeTemplate, node_templates, run_nodes

D = TensorProto.DOUBLE
LIMIT = 1e3  # a tensor with a larger magnitude does not join the graph (exp of exp ...)


class _Names:
    def __init__(self):
        self.n = 0

    def fresh(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"


_DEFAULT = In()


class _Builder:
    """One graph (the main one or a body) as it grows: nodes, the values of every tensor, the pool of float
    tensors a node may read. A body's fresh inputs and weights are the main graph's (read from the outer scope)."""

    def __init__(self, draw, rng, opset: int, names: _Names, symbolic: bool, outer: _Builder | None = None):
        self.draw, self.rng, self.opset, self.names, self.symbolic = draw, rng, opset, names, symbolic
        self.root = outer.root if outer else self
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.values: dict[str, np.ndarray] = dict(outer.values) if outer else {}
        self.pool: list[str] = list(outer.pool) if outer else []
        self.made: list[str] = []  # float tensors made by this graph's nodes
        self.feeds: dict[str, np.ndarray] = {}
        self.wrt: list[str] = []
        self.placed: list[str] = []
        self.case_of: dict[str, RuleCase] = outer.case_of if outer else {}  # node name -> its rule case
        self.placed_node = ""  # the name of the last template node placed
        self.runtimes: list[str] = []  # what ran each node (onnx.reference where onnxruntime has no kernel)
        self.unlike_reference: list[str] = []  # nodes onnx.reference computes otherwise than onnxruntime

    @property
    def st(self):
        return strategies()

    # ---- the graph's own bookkeeping ------------------------------------------------------------------
    def mark(self):
        return len(self.nodes), len(self.inits), len(self.pool), len(self.made), len(self.root.inputs), \
            len(self.root.inits), len(self.root.wrt), len(self.root.pool)

    def rollback(self, mark) -> None:
        n, i, p, m, ri, rinit, rw, rp = mark
        del self.nodes[n:], self.inits[i:], self.pool[p:], self.made[m:]
        root = self.root
        for vi in root.inputs[ri:]:
            root.feeds.pop(vi.name, None)
        del root.inputs[ri:], root.inits[rinit:], root.wrt[rw:], root.pool[rp:]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self.values[name]))

    def const(self, value, base: str = "c") -> str:
        name = self.names.fresh(base)
        arr = np.asarray(value)
        self.inits.append(numpy_helper.from_array(arr, name))
        self.values[name] = arr
        return name

    def ints(self, values) -> str:
        return self.const(np.asarray(values, dtype=np.int64), "i")

    def add(self, op: str, inputs: Sequence[str], outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        """One node, run at once on the values it reads; Invalid when it does not run or its float
        outputs are not finite or past LIMIT."""
        outs = [self.names.fresh("t") for _ in range(outputs)]
        node = helper.make_node(op, list(inputs), outs, name=outs[0], domain=domain or None,
                                **{k: v for k, v in attrs.items() if v is not None})
        try:
            got = run_nodes([node], {}, self.opsets(domain), self.values, self.root.runtimes)
        except Exception as e:
            raise Invalid(f"{op}: {e}") from None
        for o in outs:
            v = np.asarray(got[o])
            if np.issubdtype(v.dtype, np.floating) and v.size and (not np.all(np.isfinite(v))
                                                                    or np.max(np.abs(v)) > LIMIT):
                raise Invalid(f"{op}: values past {LIMIT}")
            self.values[o] = v
        self.nodes.append(node)
        return outs

    def opsets(self, domain: str = ""):
        out = [helper.make_opsetid("", self.opset)]
        if domain:
            out.append(helper.make_opsetid(domain, 1))
        return out

    # ---- fresh tensors: inputs and weights of the main graph ------------------------------------------
    def fresh_input(self, shape, spec: In, grad: bool = True) -> str:
        root = self.root
        value = In(tuple(shape), low=spec.low, high=spec.high, gap=spec.gap).sample(self.rng)
        if grad and self.draw(self.st.booleans()):
            name = self.names.fresh("w")
            root.inits.append(numpy_helper.from_array(value, name))
        else:
            name = self.names.fresh("x")
            dims = [f"{name}_{k}" if self.symbolic and self.draw(self.st.integers(0, 3)) == 0 else d
                    for k, d in enumerate(shape)]
            root.inputs.append(helper.make_tensor_value_info(name, D, dims))
            root.feeds[name] = value
        if grad:
            root.wrt.append(name)
        self.values[name] = value
        if self is not root:
            root.values[name] = value
        return name

    def bool_input(self, value: bool) -> str:
        root = self.root
        name = self.names.fresh("cond")
        root.inputs.append(helper.make_tensor_value_info(name, TensorProto.BOOL, []))
        root.feeds[name] = np.array(value)
        self.values[name] = root.values[name] = np.array(value)
        return name

    # ---- feeding a template input ---------------------------------------------------------------------
    def feed(self, shape: tuple[int, ...], spec: In, piecewise: bool, edge: int, edges: int) -> str:
        """A tensor of ``shape`` in ``spec``'s range for one input of a node (see the module doc)."""
        st = self.st
        shape = tuple(shape)
        exact = [p for p in self.pool if self.shape(p) == shape]
        turned = [p for p in self.pool if len(shape) >= 2 and self.shape(p) != shape
                  and sorted(self.shape(p)) == sorted(shape)]
        smaller = [p for p in self.pool if self.shape(p) != shape and _broadcasts_to(self.shape(p), shape)]
        kinds = ["fresh"] + ["reuse"] * 3 * bool(exact) + ["transpose"] * 2 * bool(turned) + \
            ["expand"] * bool(smaller) + ["reshape"] * bool(self.pool)
        kind = self.draw(st.sampled_from(kinds))
        if kind == "fresh":
            return self.fresh_input(shape, spec)
        if kind == "reuse":
            t = self.draw(st.sampled_from(exact))
        elif kind == "transpose":
            t = self.draw(st.sampled_from(turned))
            t = self.add("Transpose", [t], perm=_perm_to(self.shape(t), shape))[0]
        elif kind == "expand":
            t = self.add("Expand", [self.draw(st.sampled_from(smaller)), self.ints(shape)])[0]
        else:
            t = self.reshape_to(self.draw(st.sampled_from(self.pool)), shape)
        return self.condition(t, spec, piecewise, edge, edges)

    def reshape_to(self, t: str, shape: tuple[int, ...]) -> str:
        """``t`` flattened, tiled or cut to the size of ``shape``, and reshaped to it."""
        have, need = int(np.prod(self.shape(t))), int(np.prod(shape))
        flat = self.add("Reshape", [t, self.ints([-1])])[0]
        if have < need:
            flat = self.add("Tile", [flat, self.ints([-(-need // have)])])[0]
            have *= -(-need // have)
        if have > need:
            flat = self.add("Slice", [flat, self.ints([0]), self.ints([need]), self.ints([0])])[0]
        return self.add("Reshape", [flat, self.ints(list(shape))])[0]

    def condition(self, t: str, spec: In, piecewise: bool, edge: int, edges: int) -> str:
        """``t`` kept apart from ties (a piecewise op's input, or one with zeros or copies) and moved into
        ``spec``'s value range (a case with its own range, or a tensor of large values)."""
        v = self.values[t]
        # apart: ties (a piecewise op), zeros (kinks, norms), copies (a tiled tensor normalized is constant: its
        # exact gradient is 0, its central difference rounding noise)
        if piecewise or not np.all(v) or np.unique(v).size < v.size or self.draw(self.st.integers(0, 3)) == 0:
            n = max(v.size, 1)
            order = self.rng.permutation(n)
            spread = 0.5 * max(float(np.std(v)), 1.0)  # wide: a normalization of it is well conditioned
            offsets = ((order * edges + edge + 0.5) / (n * edges) - 0.5) * spread
            t = self.add("Add", [t, self.const(offsets.reshape(np.shape(v)), "jitter")])[0]
            v = self.values[t]
        ranged = spec.low != _DEFAULT.low or spec.high != _DEFAULT.high or spec.gap
        if not ranged and (not v.size or np.max(np.abs(v)) <= 8):
            return t
        mean, std = float(np.mean(v)), float(np.std(v))
        z = self.add("Mul", [self.add("Sub", [t, self.const(np.array(mean))])[0],
                            self.const(np.array(1.0 / max(std, 0.5)))])[0]  # not steep: central differences stay exact
        s = self.add("Sigmoid", [z])[0]
        low, high, gap = (spec.low, spec.high, spec.gap) if ranged else (-2.0, 2.0, 0.0)
        if gap and low < 0 < high:
            sign = np.where(self.rng.random(np.shape(v)) < 0.5, -1.0, 1.0)
            a, b = sign * gap, np.where(sign > 0, high - gap, low + gap)
        else:
            a = max(low, gap) if gap and low >= 0 else (min(high, -gap) if gap and high <= 0 else low)
            b = (high - a) if not (gap and high <= 0) else (low - a)
            a, b = np.array(a), np.array(b)
        return self.add("Add", [self.add("Mul", [s, self.const(b)])[0], self.const(a)])[0]

    # ---- templates ------------------------------------------------------------------------------------
    def place(self, tpl: NodeTemplate) -> bool:
        """Place one template (its drawn shapes and attributes, else its case's); False when neither runs."""
        for varied in (True, False):
            mark = self.mark()
            try:
                shapes = self.draw_shapes(tpl) if varied else [s.shape for s in tpl.slots]
                attrs = self.draw_attrs(tpl, shapes) if varied else dict(tpl.case.attrs)
                self.emit(tpl, shapes, attrs, cross_check=varied)
                self.placed.append(tpl.name)
                self.case_of[self.placed_node] = tpl.case
                return True
            except Invalid:
                self.rollback(mark)
        return False

    def emit(self, tpl: NodeTemplate, shapes, attrs, cross_check: bool = False) -> None:
        """The template's node on fed inputs, run by onnxruntime and onnx's reference evaluator. Where they
        disagree, a node whose shapes or attributes differ from its case's (``cross_check``) is not valid
        (onnxruntime runs some nodes the spec does not allow, such as an RNN whose weights disagree with
        hidden_size); a case's own node is, and the graph is checked on onnxruntime only (the reference
        evaluator of onnx 1.23 divides by the plain sum in LpNormalization with p=1)."""
        edges = sum(s.kind == "feed" for s in tpl.slots)
        inputs, edge = [], 0
        for slot, shape in zip(tpl.slots, shapes):
            if slot.kind == "absent":
                inputs.append("")
            elif slot.kind == "const":
                inputs.append(self.const(slot.value))
            elif slot.kind == "input":
                inputs.append(self.fresh_input(shape, slot.spec, grad=False))
            else:
                inputs.append(self.feed(shape, slot.spec, tpl.piecewise, edge, edges))
                edge += 1
        outs = self.add(tpl.op, inputs, len(tpl.output_shapes), tpl.domain, **attrs)
        self.placed_node = self.nodes[-1].name
        ran = self.root.runtimes[-1]
        try:
            self.cross_check(self.nodes[-1], ran)
        except Invalid as e:
            if cross_check or ran != "onnxruntime":
                raise
            self.root.unlike_reference.append(str(e))
        kept = [outs[k] for k in tpl.outputs if self.values[outs[k]].size]
        if not kept:
            raise Invalid(f"{tpl.op}: empty outputs")
        self.pool.extend(kept)
        self.made.extend(kept)

    def cross_check(self, node: onnx.NodeProto, ran: str) -> None:
        """The node once more on the other runtime: onnx's reference evaluator where onnxruntime ran it, or
        onnxruntime in float32 where it has no float64 kernel (it checks the node where the reference
        evaluator does not: an index tensor of another shape than MaxUnpool's input). Invalid where that
        fails or the values disagree."""
        reads = list(dict.fromkeys(_reads(node)))
        outs = [o for o in node.output if o]
        feeds = {i: self.values[i] for i in reads}
        if ran == "onnxruntime":
            from onnx.reference import ReferenceEvaluator

            model, tol = self.one_node_model(node, feeds), dict(rtol=1e-6, atol=1e-9)
            run = lambda: ReferenceEvaluator(model).run(None, feeds)  # noqa: E731
        else:
            import onnxruntime as ort

            node32 = onnx.NodeProto()
            node32.CopyFrom(node)
            shell = helper.make_graph([node32], "one", [], [])
            graph_to_float32(shell)
            for a in node32.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    for g in walk_graphs(helper.make_model(a.g)):
                        graph_to_float32(g)
            feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
            model, tol = self.one_node_model(node32, feeds), dict(rtol=1e-3, atol=1e-4)
            so = session_options(log_severity_level=4)
            run = lambda: ort.InferenceSession(model.SerializeToString(), so,  # noqa: E731
                                               providers=["CPUExecutionProvider"]).run(None, feeds)
        try:
            got = run()
        except Exception as e:
            raise Invalid(f"{node.op_type}: not run by the other runtime: {e}") from None
        for o, v in zip(outs, got):
            mine = self.values[o]
            same = (np.allclose(v, mine, **tol) if np.issubdtype(mine.dtype, np.floating)
                    else np.array_equal(v, mine))  # indices too: MaxPool's differ in onnx 1.23's reference
            if np.shape(v) != np.shape(mine) or not same:
                raise Invalid(f"{node.op_type}: onnxruntime and onnx.reference disagree")

    def one_node_model(self, node: onnx.NodeProto, feeds) -> onnx.ModelProto:
        inputs = [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(v.dtype), np.shape(v))
                  for i, v in feeds.items()]
        model = helper.make_model(helper.make_graph([node], "one", inputs, [onnx.ValueInfoProto(name=o)
                                                                            for o in node.output if o]),
                                  opset_imports=list(self.opsets(node.domain)))
        model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
        return model

    def draw_shapes(self, tpl: NodeTemplate) -> list[tuple[int, ...]]:
        st = self.st
        if tpl.elementwise:
            if self.pool and self.draw(st.integers(0, 9)) < 7:
                full = self.shape(self.draw(st.sampled_from(self.pool)))
            else:
                full = tuple(self.draw(st.lists(st.integers(1, 4), max_size=4)))
            feeds = [k for k, s in enumerate(tpl.slots) if s.kind == "feed"]
            out = [s.shape for s in tpl.slots]
            for n, k in enumerate(feeds):
                out[k] = full if n == 0 or self.draw(st.booleans()) else self.derive(full)
            return out
        if self.draw(st.integers(0, 4)) < 2:
            return [s.shape for s in tpl.slots]
        sizes = {1: 1}  # and a size the case's attributes name keeps its value (hidden_size, kernel_shape)
        for v in tpl.case.attrs.values():
            for d in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(d, int) and not isinstance(d, bool) and d > 1:
                    sizes[d] = d
        feeds = [k for k, s in enumerate(tpl.slots) if s.kind == "feed"]
        anchors = [p for p in self.pool if len(self.shape(p)) == len(tpl.slots[feeds[0]].shape)]
        if anchors and self.draw(st.booleans()):
            target = self.shape(self.draw(st.sampled_from(anchors)))
            if len(target) >= 2 and self.draw(st.integers(0, 2)) == 0:
                target = target[:-2] + (target[-1], target[-2])  # fed as a transpose of that tensor
            trial = dict(sizes)
            for d, want in zip(tpl.slots[feeds[0]].shape, target):
                if (d == 1) != (want == 1) or trial.get(d, want) != want:
                    break
                trial[d] = want
            else:
                sizes = trial
        for s in tpl.slots:
            for d in s.shape:
                if d not in sizes:
                    sizes[d] = self.draw(st.integers(2, 5))
        return [tuple(sizes[d] for d in s.shape) if s.kind in ("feed", "input") else s.shape for s in tpl.slots]

    def derive(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """A shape that broadcasts to ``full``: a trailing part of it with some dims 1."""
        st = self.st
        rank = self.draw(st.integers(0, len(full)))
        return tuple(1 if self.draw(st.booleans()) else d for d in full[len(full) - rank:])

    def draw_attrs(self, tpl: NodeTemplate, shapes) -> dict:
        st = self.st
        attrs = dict(tpl.case.attrs)
        for name, value in tpl.float_attrs:
            if self.draw(st.integers(0, 2)) == 0:
                attrs[name] = float(value * self.draw(st.sampled_from([0.5, 0.75, 1.25, 1.5])))
        for name, value in tpl.flag_attrs:
            if self.draw(st.integers(0, 3)) == 0:
                attrs[name] = 1 - value
        rank = len(shapes[0]) if shapes else 0
        if tpl.has_axis and rank and self.draw(st.booleans()):
            attrs["axis"] = self.draw(st.integers(-rank, rank - 1))
        return attrs

    # ---- the finished graph ---------------------------------------------------------------------------
    def inferred_as_run(self, model: onnx.ModelProto) -> bool:
        """Whether every static dim onnx's shape inference gives the graph's tensors is the one they have when
        run (onnx 1.23 infers [2, 3, 0] for a 3-D Attention whose V has symbolic dims; a gradient built on
        such a shape cannot be right, and the graph is not the fuzz's to check)."""
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
            shape = info_from_type(vi.type).shape
            have = self.values.get(vi.name)
            if shape is None or have is None:
                continue
            if len(shape) != np.ndim(have) or any(isinstance(d, int) and d != n for d, n in zip(shape, np.shape(have))):
                return False
        return True

    def finish(self) -> FuzzGraph | None:
        read = {i for n in self.nodes for i in _reads(n)}
        leaves = [t for t in self.made if t not in read]
        if not leaves:
            return None
        of = leaves[-3:]
        nodes = _needed(self.nodes, of)
        read = {i for n in nodes for i in _reads(n)}
        inputs = [vi for vi in self.inputs if vi.name in read]
        inits = [t for t in self.inits if t.name in read]
        outputs = [helper.make_tensor_value_info(o, D, None) for o in of]
        graph = helper.make_graph(nodes, "fuzz", inputs, outputs, inits)
        opsets = [helper.make_opsetid("", self.opset)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = helper.find_min_ir_version_for(opsets)
        inferred = onnx.shape_inference.infer_shapes(model)
        del model.graph.output[:]
        model.graph.output.extend(  # the inferred type, else the rank the values have (dims unknown)
            o if o.type.tensor_type.HasField("shape") else
            helper.make_tensor_value_info(o.name, D, [None] * np.ndim(self.values[o.name]))
            for o in inferred.graph.output)
        try:
            onnx.checker.check_model(model, full_check=True)
            if not self.inferred_as_run(model):
                return None
            if "onnx.reference" in self.runtimes:  # gradcheck will run it all there: every node must run there
                if has_loop(model) or self.unlike_reference:
                    return None  # (check_graph checks these on onnxruntime only)
                from onnx.reference import ReferenceEvaluator

                ReferenceEvaluator(model).run(None, {vi.name: self.feeds[vi.name] for vi in inputs})
        except Exception:
            return None
        # the tolerances of the cases whose nodes the graph kept (in bodies too)
        kept = {n.name for g in walk_graphs(model) for n in g.node}
        cases = [c for name, c in self.case_of.items() if name in kept] or [RuleCase("", [])]
        return FuzzGraph(model, {vi.name: self.feeds[vi.name] for vi in inputs},
                         [w for w in self.wrt if w in read], of,
                         rtol=max(1e-5, *(c.rtol for c in cases)), atol=max(1e-8, *(c.atol for c in cases)),
                         eps=max(1e-6, *(c.eps for c in cases)), placed=list(self.placed),
                         onnxruntime_only="; ".join(self.unlike_reference))


def _reads(node: onnx.NodeProto) -> list[str]:
    return node_inputs(node)


def _needed(nodes: list[onnx.NodeProto], outputs: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes the outputs depend on, in order."""
    want, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in want for o in n.output):
            keep.append(n)
            want.update(_reads(n))
    return keep[::-1]


def _broadcasts_to(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    if len(small) > len(big):
        return False
    return all(s in (1, b) for s, b in zip(small[::-1], big[::-1]))


def _perm_to(have: tuple[int, ...], want: tuple[int, ...]) -> list[int]:
    """A permutation p with have[p[k]] == want[k] (the first free axis of each size)."""
    free, perm = list(range(len(have))), []
    for d in want:
        k = next(k for k in free if have[k] == d)
        free.remove(k)
        perm.append(k)
    return perm


def _opsets_of(templates: Sequence[NodeTemplate]) -> list[int]:
    found = sorted({t.case.opset for t in templates if t.case.opset >= 13})
    return found or [17]


def rule_graphs(cases: Sequence[RuleCase], *, opsets: Sequence[int] | None = None, ops: Sequence[str] | None = None,
                focus: Sequence[str] | None = None, max_nodes: int = 5, control_flow: bool = True,
                symbolic: bool = True):
    """Strategy: a ``FuzzGraph`` of 1 to ``max_nodes`` nodes made from ``cases`` (``RuleCase``; the built-in
    rules' are ``onnx_autodiff.conformance.cases.all_cases()`` in this repository), plus their glue.

    ``opsets``: the default-domain opsets graphs are drawn at (default: those of the cases, from 13 on); a
    case is placed only at an opset where its op has the same version. ``ops``: only these op types.
    ``focus``: each graph places one of these op types first (a new rule, fuzzed in the company of the
    others). ``control_flow``: If / Loop / Scan nodes around a few templates. ``symbolic``: some graph input
    dims are symbolic.
    """
    st = strategies()
    from hypothesis import assume

    templates = [t for t in node_templates(cases) if ops is None or t.op in ops]
    levels = sorted(opsets) if opsets else _opsets_of(templates)
    by_level = {v: [t for t in templates if t.usable_at(v)] for v in levels}
    wanted = set(focus or ())
    levels = [v for v in levels if by_level[v] and (not wanted or wanted & {t.op for t in by_level[v]})]
    if not levels:
        raise ValueError(f"no case {'of ' + str(sorted(wanted)) + ' ' if wanted else ''}can be placed at any of "
                         f"the opsets asked for")

    @st.composite
    def graph(draw):
        opset = draw(st.sampled_from(levels))
        usable = by_level[opset]
        by_op: dict[str, list[NodeTemplate]] = {}
        for t in usable:
            by_op.setdefault(t.op, []).append(t)
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        b = _Builder(draw, rng, opset, _Names(), symbolic)
        for _ in range(draw(st.integers(1, 2))):
            shape = tuple(draw(st.lists(st.integers(1, 4), max_size=4)))
            b.pool.append(b.fresh_input(shape, _DEFAULT))
        first = sorted(wanted & set(by_op))
        if first:
            b.place(draw(st.sampled_from(by_op[draw(st.sampled_from(first))])))
        for _ in range(draw(st.integers(1, max_nodes))):
            if control_flow and draw(st.integers(0, 9)) == 0:
                place_control(b, usable)
            else:
                b.place(draw(st.sampled_from(by_op[draw(st.sampled_from(sorted(by_op)))])))
        found = b.finish()
        assume(found is not None)
        return found

    return graph()


__all__ = ["rule_graphs"]

"""Every rule case at every opset where its forward op exists: the lowered gradient passes
onnx.checker (full_check) at that opset, or lower() converted the model once, with a warning, to the
opset the gradient needs. Values are checked at the lowest and the newest opset.

The default run lowers each case at its lowest opset, 9, 11, 13 and the newest, and checks values at
the lowest; ``pytest -m sweep tests/rules/test_opset_sweep.py`` lowers at every opset and checks values at the
newest too (about three minutes on one core).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import onnx
import onnxruntime as ort
import pytest
from onnx import defs
from onnx.reference import ReferenceEvaluator

import onnx_autodiff as oa
from onnx_autodiff.check.gradcheck import gradient_model
from onnx_autodiff.conformance.cases import all_cases
from onnx_autodiff.graph import infer_tensor_info
from onnx_autodiff.testing import check_rule_case, rule_case_model

NEWEST = defs.onnx_opset_version()
BREAKPOINTS = (9, 11, 13)
# ops of the default domain that onnx defines (onnxruntime's SimplifiedLayerNormalization has no onnx schema
# to version it by)
CASES = [c for c in all_cases() if not c.domain and defs.has(c.op)]
_VARIADIC = {"Max", "Min", "Sum", "Mean"}  # multidirectional broadcasting from opset 8 (the checker misses it)


@functools.cache
def _runs(case_index, opset):
    """Whether the forward model runs (onnxruntime, else onnx's reference evaluator): the checker
    accepts some nodes of another version's form (Squeeze with negative axes before opset 11)."""
    model, feeds, _ = rule_case_model(dataclasses.replace(CASES[case_index], opset=opset))
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        got = ort.InferenceSession(model.SerializeToString(), so).run(None, feeds)
        return _as_declared(model, got)
    except Exception as e:
        if "NOT_IMPLEMENTED" not in str(e) and "Could not find an implementation" not in str(e):
            return False
    try:
        return _as_declared(model, ReferenceEvaluator(model).run(None, feeds))
    except Exception:
        return False


def _as_declared(model, values):
    """Whether run-time shapes match the inferred ones (onnxruntime runs some nodes of another
    version's form, shape inference then gets them wrong)."""
    for vi, v in zip(model.graph.output, values):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        if len(dims) != v.ndim or any(d is not None and d != n for d, n in zip(dims, v.shape)):
            return False
    return True


def forward_at(case, opset):
    """(model, wrt) of the case at ``opset``, or None when its forward node is not valid there."""
    found = _forward_at(_index(case), opset)
    if found is None:
        return None
    model, wrt = found
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy, list(wrt)


@functools.cache
def _forward_at(index, opset):
    case = CASES[index]
    c = dataclasses.replace(case, opset=opset)
    if opset < 8 and case.op in _VARIADIC and len({tuple(i.shape) for i in case.inputs if i is not None}) > 1:
        return None
    try:
        if set(case.attrs) - set(defs.get_schema(case.op, opset).attributes):
            return None  # an attribute of another version of the op (Clip's min/max before opset 11)
        model, _, wrt = rule_case_model(c)
        onnx.checker.check_model(model, full_check=True)
    except Exception:
        return None
    same_version = defs.get_schema(case.op, opset).since_version == defs.get_schema(case.op, case.opset).since_version
    if not same_version and not _runs(_index(case), opset):
        return None
    return model, wrt


def _index(case):
    return next(i for i, c in enumerate(CASES) if c is case)


def valid_opsets(case):
    return [v for v in range(7, NEWEST + 1) if forward_at(case, v) is not None]


def gradient_at(case, opset):
    found = forward_at(case, opset)
    if found is None:
        return None
    model, wrt = found
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}
    picks = case.check_outputs if case.check_outputs is not None else range(case.outputs)
    outs = [model.graph.output[k].name for k in picks if model.graph.output[k].type.tensor_type.elem_type in floats]
    if not outs or not wrt:
        return None
    info = infer_tensor_info(model)
    return gradient_model(model, outs, wrt, {n: list(info[n].shape) for n in outs + wrt})


def lower_at(case, opset):
    """Lower the case's gradient at ``opset``; returns the opset of the result (checked by lower())."""
    model = gradient_at(case, opset)
    if model is None:
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = oa.lower(model)
    got = next(o.version for o in lowered.opset_import if o.domain == "")
    said = [w for w in caught if "Converted it to opset" in str(w.message)]
    if got == opset:
        assert not said, str(said[0].message)
    else:
        assert got > opset and len(said) == 1, f"opset {opset} -> {got} with {len(said)} warnings"
        assert f"Converted it to opset {got}" in str(said[0].message)
    return got


def _opsets(case, every):
    first = next((v for v in range(7, NEWEST + 1) if forward_at(case, v) is not None), None)
    if first is None:
        return []
    wanted = range(first, NEWEST + 1) if every else sorted({first, NEWEST, *BREAKPOINTS})
    return [v for v in wanted if v >= first and forward_at(case, v) is not None]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_case_lowers_at_each_opset(case):
    lowered = [v for v in _opsets(case, every=False) if lower_at(case, v) is not None]
    assert lowered or case.op in ("Dropout",), f"{case.name} lowered at no opset"


@pytest.mark.sweep
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_case_lowers_at_every_opset(case):
    for v in _opsets(case, every=True):
        lower_at(case, v)


# where onnxruntime has no float64 kernel for the backward (Conv) and onnx's reference evaluator is wrong
NO_FLOAT64_RUNTIME = {
    "MaxPool-1d-dilated-ceil": "onnx.reference's MaxPool crashes on dilated ceil_mode windows; "
                               "tests/rules/test_conv_torch.py checks this case at opset 10 against torch",
    "MaxPool-3d-same-upper": "onnx.reference's MaxPool crashes on auto_pad windows here; "
                             "tests/rules/test_conv_torch.py checks this case at opset 9 against torch",
}


def _check_values(case, which):
    if case.name in NO_FLOAT64_RUNTIME:
        pytest.skip(NO_FLOAT64_RUNTIME[case.name])
    ops = _opsets(case, every=False)
    for opset in sorted({ops[which]} - {case.opset}) if ops else []:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = check_rule_case(dataclasses.replace(case, opset=opset))
        assert report.ok and report.checks, f"opset {opset}\n{report}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_case_gradient_at_lowest_opset(case):
    _check_values(case, 0)


@pytest.mark.sweep
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_case_gradient_at_newest_opset(case):
    _check_values(case, -1)

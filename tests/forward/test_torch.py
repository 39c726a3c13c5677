"""jvp, hvp and jacobian of five exported PyTorch models against torch.func.jvp,
torch.autograd.functional.hvp and torch.autograd.functional.jacobian: float32 models in stock onnxruntime,
float64 references, each result within 2e-4 of the max abs of its reference."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import onnx_autodiff as oa
from onnx_autodiff.engine.registry import find_jvp_rule, is_non_differentiable
from tests.forward.torch_models import INPUTS, Exported
from tests.torch_export import session, with_gradient

RTOL = 2e-4
NAMES = list(INPUTS)
_CACHE: dict = {}


def exported(name: str, scalar: bool) -> Exported:
    if (name, scalar) not in _CACHE:
        _CACHE[(name, scalar)] = Exported(name, scalar)
    return _CACHE[(name, scalar)]


def close(got: np.ndarray, want: torch.Tensor, what: str):
    want = want.detach().numpy()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = float(np.abs(want).max())
    assert scale > 0, f"the reference {what} is zero: the check would be vacuous"
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= RTOL, f"{what} off by {err:.2e} relative to max |ref| {scale:.3g}"


def plain(model: onnx.ModelProto):
    onnx.checker.check_model(model, full_check=True)
    added = {(n.domain, n.op_type) for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    assert not added, f"non-standard ops in the result: {sorted(added)}"


def tangents(e: Exported, names: list[str], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((e.x if n == "x" else e.inits[n]).shape).astype(np.float32) for n in names}


@pytest.mark.parametrize("name", NAMES)
def test_jvp_matches_torch(name):
    e = exported(name, scalar=False)
    wrt = list(e.inits) + ["x"]
    model = oa.jvp(e.onnx, wrt)
    plain(model)
    v = tangents(e, wrt)
    y, ydot = session(model).run(["y", "y.tangent"], {"x": e.x, **{f"{n}.tangent": t for n, t in v.items()}})
    ref_y, ref_ydot = torch.func.jvp(e.function(wrt), e.values(wrt),
                                     tuple(torch.tensor(v[n].astype(np.float64)) for n in wrt))
    close(y, ref_y, "y")
    close(ydot, ref_ydot, "y.tangent")


@pytest.mark.parametrize("name", NAMES)
def test_hvp_matches_torch(name):
    e = exported(name, scalar=True)
    wrt = list(e.inits) + ["x"]
    model = oa.hvp(e.onnx, wrt)
    plain(model)
    v = tangents(e, wrt, seed=1)
    outs = session(model).run(None, {"x": e.x, **{f"{n}.tangent": t for n, t in v.items()}})
    got = dict(zip([o.name for o in model.graph.output], outs))
    ref_grad = torch.autograd.functional.jacobian(e.function(wrt), e.values(wrt))
    _, ref_hvp = torch.autograd.functional.hvp(e.function(wrt), e.values(wrt),
                                               tuple(torch.tensor(v[n].astype(np.float64)) for n in wrt))
    for n, g, h in zip(wrt, ref_grad, ref_hvp):
        close(got[f"{n}.grad"], g, f"{n}.grad")
        if float(h.abs().max()) > 0:  # a parameter the loss is linear in (the last bias) has a zero row
            close(got[f"{n}.hvp"], h, f"{n}.hvp")
        else:
            assert np.abs(got[f"{n}.hvp"]).max() <= 1e-6, n


@pytest.mark.parametrize("name", NAMES)
def test_jacobian_matches_torch(name):
    e = exported(name, scalar=False)
    w = [k for k in e.inits if "weight" in k][0]
    model = oa.jacobian(e.onnx, "y", ["x", w])
    plain(model)
    got = dict(zip([o.name for o in model.graph.output], session(model).run(None, {"x": e.x})))
    ref = torch.autograd.functional.jacobian(e.function(["x", w]), e.values(["x", w]))
    close(got["dy/dx"], ref[0], "dy/dx")
    close(got[f"dy/d{w}"], ref[1], f"dy/d{w}")


@pytest.mark.parametrize("name", NAMES)
def test_every_op_on_the_way_has_a_direct_jvp_rule(name):
    """No op of these models, nor of their lowered gradients (what hvp pushes tangents through), goes
    through the fallback."""
    e = exported(name, scalar=True)
    wrt = list(e.inits) + ["x"]
    gradient, _ = with_gradient(e.onnx, "loss", wrt)
    lowered = oa.lower(gradient)
    opset = {o.domain or "": o.version for o in lowered.opset_import}[""]
    ops = {n.op_type for n in lowered.graph.node}
    fallback = sorted(op for op in ops if find_jvp_rule("", op, opset) is None and not is_non_differentiable("", op))
    assert not fallback, f"{name}: ops without a direct JVP rule: {fallback}"

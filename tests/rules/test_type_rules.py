"""Type rules (engine/type_rules.py): for every op with one, on every rule case of that op, the types and
shapes inference tells through the stand-in are what onnxruntime's kernel returns; and the builder's models
keep every tensor typed through their contrib ops without the value_info the builder wrote."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff.engine.registry import load_rules
from onnx_autodiff.graph import STAND_INS, infer_tensor_info
from onnx_autodiff.testing import In, RuleCase, rule_case_model
from tests.rules.cases import all_cases

load_rules()
# GatherBlockQuantized has no rule case (nothing of it is differentiable): a 4-bit embedding of 10 x 64
_EMBEDDING = RuleCase("GatherBlockQuantized", [In(value=np.arange(320).reshape(10, 32) % 256, dtype="uint8"),
                                               In(value=np.array([[1, 4, 9], [0, 0, 2]]), dtype="int64"),
                                               In(value=np.full((10, 2), 0.1), dtype="float32")],
                      attrs={"bits": 4, "block_size": 32, "quantize_axis": 1}, domain="com.microsoft", opset=21,
                      id="uint8-4bit")
TYPED = [c for c in all_cases() + [_EMBEDDING] if (c.domain or "", c.op) in STAND_INS]


def test_every_type_rule_has_cases():
    # onnxruntime has no com.microsoft SimplifiedLayerNormalization kernel to compare with; its type rule is the
    # default domain's (test_contrib.py holds the two registrations to one function)
    kernel_less = {("com.microsoft", "SimplifiedLayerNormalization")}
    assert {(c.domain or "", c.op) for c in TYPED} == set(STAND_INS) - kernel_less


@pytest.mark.parametrize("case", TYPED, ids=[c.name for c in TYPED])
def test_type_rule_tells_what_the_kernel_returns(case):
    model, feeds, _ = rule_case_model(case)
    assert {n.domain for n in model.graph.node} == {case.domain or ""}
    for o in model.graph.output:
        o.ClearField("type")
    got = infer_tensor_info(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for o, value in zip(model.graph.output, sess.run(None, feeds)):
        info = got[o.name]
        assert info.dtype == onnx.helper.np_dtype_to_tensor_dtype(value.dtype), o.name
        assert info.shape is not None and len(info.shape) == value.ndim, (o.name, info.shape, value.shape)
        assert all(d == v for d, v in zip(info.shape, value.shape) if isinstance(d, int)), (o.name, info.shape)


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_builder_models_stay_typed_without_their_value_info(builder_models, precision):
    model = onnx.load(str(builder_models.get("llama", precision)), load_external_data=False)
    del model.graph.value_info[:]
    info = infer_tensor_info(model)
    untyped = [o for n in model.graph.node for o in n.output if o and (o not in info or info[o].dtype is None)]
    assert not untyped
    assert info["logits"].shape == ("batch_size", "sequence_length", 1000)
    present = info["present.0.key"]
    assert present.dtype == onnx.TensorProto.FLOAT and len(present.shape) == 4 and present.shape[1] == 2

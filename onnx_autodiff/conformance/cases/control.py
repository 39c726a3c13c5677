from onnx import TensorProto, helper

from onnx_autodiff.testing import In, RuleCase


def _cell():
    """(h, W, x_t) -> (tanh(h W + x_t), W, tanh(...)^2)."""
    d = TensorProto.DOUBLE
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("MatMul", ["h", "W"], ["hw"]), helper.make_node("Add", ["hw", "x_t"], ["a"]),
             helper.make_node("Tanh", ["a"], ["h_new"]), helper.make_node("Identity", ["W"], ["W_out"]),
             helper.make_node("Mul", ["h_new", "h_new"], ["y_t"])]
    return helper.make_graph(nodes, "cell", [vi("h", d, [2, 3]), vi("W", d, [3, 3]), vi("x_t", d, [2, 3])],
                             [vi("h_new", d, [2, 3]), vi("W_out", d, [3, 3]), vi("y_t", d, [2, 3])])


_SMALL = dict(low=-0.7, high=0.7)
CASES = [
    RuleCase("Scan", [In((2, 3), **_SMALL), In((3, 3), **_SMALL), In((4, 2, 3), **_SMALL)],
             attrs={"body": _cell(), "num_scan_inputs": 1}, outputs=3),
    RuleCase("Scan", [In((2, 3), **_SMALL), In((3, 3), **_SMALL), In((2, 4, 3), **_SMALL)],
             attrs={"body": _cell(), "num_scan_inputs": 1, "scan_input_axes": [1], "scan_input_directions": [1],
                    "scan_output_axes": [1], "scan_output_directions": [1]}, outputs=3, id="reverse-axis1"),
]

NOT_CASED = {
    "If": "an If takes only its condition as input and its branches read the differentiated tensors from the "
          "outer scope, which a one-node case (every input an input of the node) cannot declare; "
          "tests/rules/test_control_flow.py gradchecks it in float64 (constant and dynamic condition, both branches, "
          "nested, second order, inside a Scan body, opset 11)",
    "Loop": "a Loop needs a trip-count/condition body with int64/bool inputs the one-node harness cannot type; "
            "tests/rules/test_control_flow.py gradchecks it in float64 (full trip, short trip, early stop, opset 11)",
}

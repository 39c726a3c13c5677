from onnx_autodiff.testing import In, RuleCase

# onnxruntime 1.31 CPU has no float64 kernel for these: gradcheck's runtime="auto" runs them in float64
# through onnx's reference evaluator (tests/rules/test_conv_torch.py also holds them against torch autograd).
# onnx.reference's grouped ConvTranspose (op_conv_transpose.py) slices W per group by output channels,
# writes each group's output to channel ``group_id`` only and adds B[:M/group] to every group: it is right
# only for one input and one output channel per group, without bias. A grouped Conv's input gradient is a
# grouped ConvTranspose, so the grouped cases here are depthwise (channels == group); channel multipliers
# > 1 are checked against torch in tests/rules/test_conv_torch.py.
CASES = [
    RuleCase("Conv", [In((2, 3, 7)), In((4, 3, 3)), In((4,))], id="1d-bias"),
    RuleCase("Conv", [In((2, 4, 6, 5)), In((4, 1, 3, 2))],
             attrs={"group": 4, "strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]},
             id="2d-group-stride-dil"),
    RuleCase("Conv", [In((1, 3, 5, 5)), In((3, 1, 3, 3)), In((3,))], attrs={"group": 3, "pads": [1, 1, 1, 1]},
             id="depthwise"),
    RuleCase("Conv", [In((1, 2, 9, 7)), In((3, 2, 3, 3))], attrs={"strides": [2, 3]}, id="stride-not-dividing"),
    RuleCase("Conv", [In((1, 2, 7, 6)), In((3, 2, 3, 2))], attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
             id="same-upper"),
    RuleCase("Conv", [In((1, 2, 6, 6)), In((3, 2, 4, 3))], attrs={"auto_pad": "SAME_LOWER"}, id="same-lower"),
    RuleCase("Conv", [In((1, 2, 6, 5)), In((2, 2, 2, 2))], attrs={"auto_pad": "VALID", "strides": [2, 2]}, id="valid"),
    RuleCase("Conv", [In((1, 2, 5, 4, 6)), In((2, 1, 2, 3, 2)), In((2,))],
             attrs={"group": 2, "strides": [1, 2, 2], "pads": [1, 0, 1, 0, 1, 0]}, id="3d-group"),
    RuleCase("Conv", [In((3, 4, 7), dims=["N", 4, 7]), In((4, 1, 3)), In((4,))], attrs={"group": 4, "strides": [2]},
             id="symbolic-batch-group"),
    RuleCase("Conv", [In((1, 3, 6, 6)), In((4, 3, 3, 3))], attrs={"strides": [2, 2], "pads": [1, 1, 1, 1]},
             opset=11, id="opset11"),
    RuleCase("Conv", [In((2, 3, 7, 6), dims=["N", 3, "H", "W"]), In((4, 3, 3, 2)), In((4,))],
             attrs={"strides": [2, 3], "pads": [1, 0, 2, 1]}, id="symbolic-spatial-stride-pads"),
    RuleCase("Conv", [In((1, 2, 9, 8), dims=[1, 2, "H", "W"]), In((3, 2, 2, 3))],
             attrs={"dilations": [2, 1], "strides": [1, 2]}, id="symbolic-spatial-dilated"),
    RuleCase("Conv", [In((2, 3, 7, 6), dims=["N", "C", 7, 6]), In((4, 3, 3, 2)), In((4,))],
             attrs={"strides": [2, 1], "dilations": [1, 2], "pads": [1, 2, 0, 1]}, id="symbolic-batch-channels-dil"),
    RuleCase("Conv", [In((2, 3, 5, 5)), In((4, 3, 1, 1))], attrs={"strides": [2, 2]}, id="pointwise-stride"),
    RuleCase("ConvTranspose", [In((2, 3, 5)), In((3, 2, 3)), In((2,))], attrs={"strides": [2], "pads": [1, 1]},
             id="1d-stride"),
    RuleCase("ConvTranspose", [In((1, 4, 4, 3)), In((4, 1, 3, 2))],
             attrs={"group": 4, "strides": [2, 3], "output_padding": [1, 2], "dilations": [2, 1]},
             id="2d-group-outpad"),
    RuleCase("ConvTranspose", [In((2, 2, 3, 3)), In((2, 3, 2, 2)), In((3,))],
             attrs={"strides": [1, 2], "pads": [0, 1, 1, 0], "dilations": [2, 1]}, id="2d-bias-pads-dil"),
    # Col2Im (opset 18), the Conv input gradient's scatter at few output positions (gradient_rules/conv.py):
    # second order through a Conv differentiates it. Columns [N, C*K, L]; image_shape and block_shape constant.
    # 2-D cases only: onnxruntime 1.32's Col2Im is wrong with dilations in 1-D and 3-D, OpenVINO converts 2-D only.
    RuleCase("Col2Im", [In((2, 8, 4)), In(value=[3, 4], dtype="int64"), In(value=[2, 2], dtype="int64")],
             attrs={"strides": [1, 2], "pads": [0, 1, 1, 0], "dilations": [2, 1]}, opset=18,
             id="col2im-2d-stride-pads-dil"),
    RuleCase("Col2Im", [In((1, 6, 4)), In(value=[5, 3], dtype="int64"), In(value=[3, 1], dtype="int64")],
             attrs={"strides": [2, 2]}, opset=18, id="col2im-2d-stride"),
]

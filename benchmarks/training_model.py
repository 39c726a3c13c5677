"""A spec training model from an inference model: cross entropy, one Gradient node, SGD or Adam.

The algorithm graph follows the released spec (domain ``ai.onnx.preview.training``):
``loss = SoftmaxCrossEntropyLoss(logits, labels)``, ``Gradient(xs=trainable, y=loss)``, then per weight
``W_new = W - lr * G`` (SGD, plain ops) or one spec ``Adam`` node over every weight with an iteration
counter starting at 1 (so it matches torch.optim.Adam, see docs/training.md), and ``update_binding``.
The trainable tensors are the float initializers other than BatchNorm running statistics.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PREVIEW = "ai.onnx.preview.training"
_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16}


def trainable_names(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer
            if t.data_type in _FLOATS and not t.name.endswith(("running_mean", "running_var"))]


def make_training_model(model: onnx.ModelProto, logits: str, optimizer: str = "sgd", lr: float = 0.01,
                        betas=(0.9, 0.999), eps: float = 1e-8, trainable: list[str] | None = None) -> onnx.ModelProto:
    params = trainable if trainable is not None else trainable_names(model)
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    grads = [f"{p}__grad" for p in params]
    new = [f"{p}__new" for p in params]
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", [logits, "labels"], ["loss"], name="bench/xent", reduction="mean"),
        helper.make_node("Gradient", params, grads, name="bench/grad", domain=PREVIEW, xs=params, y="loss"),
    ]
    inits = [numpy_helper.from_array(np.array(lr, np.float32), "bench/lr")]
    update = list(zip(params, new))
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[p]) for p, n in zip(params, new)]
    if optimizer == "sgd":
        for p, gname, n in zip(params, grads, new):
            nodes.append(helper.make_node("Mul", ["bench/lr", gname], [f"{p}__step"], name=f"bench/sgd/{p}/mul"))
            nodes.append(helper.make_node("Sub", [p, f"{p}__step"], [n], name=f"bench/sgd/{p}/sub"))
    elif optimizer == "adam":
        v = [f"{p}__V" for p in params]
        h = [f"{p}__H" for p in params]
        v_new = [f"{x}_new" for x in v]
        h_new = [f"{x}_new" for x in h]
        # torch adds eps to sqrt(H / (1 - b^t)); ONNX after the correction: the same update for t = 1 with
        # eps * sqrt(1 - b); for eps = 1e-8 the difference afterwards is far below float32 rounding of the step
        nodes.append(helper.make_node("Adam", ["bench/lr", "bench/T"] + params + grads + v + h, new + v_new + h_new,
                                      name="bench/adam", domain=PREVIEW, alpha=betas[0], beta=betas[1], epsilon=eps))
        nodes.append(helper.make_node("Add", ["bench/T", "bench/one"], ["bench/T_new"], name="bench/count"))
        inits += [numpy_helper.from_array(np.array(1, np.int64), "bench/T"),
                  numpy_helper.from_array(np.array(1, np.int64), "bench/one")]
        for p, a, b in zip(params, v, h):
            z = np.zeros(shapes[p], np.float32)
            inits += [numpy_helper.from_array(z, a), numpy_helper.from_array(z, b)]
        for p, a, b in zip(params, v_new, h_new):
            outputs += [helper.make_tensor_value_info(a, TensorProto.FLOAT, shapes[p]),
                        helper.make_tensor_value_info(b, TensorProto.FLOAT, shapes[p])]
        outputs.append(helper.make_tensor_value_info("bench/T_new", TensorProto.INT64, []))
        update += list(zip(v, v_new)) + list(zip(h, h_new)) + [("bench/T", "bench/T_new")]
    else:
        raise ValueError(f"optimizer {optimizer!r}: expected 'sgd' or 'adam'")
    batch = [d.dim_value or d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim][:1]
    algorithm = helper.make_graph(nodes, "bench_train",
                                  [helper.make_tensor_value_info("labels", TensorProto.INT64, batch)], outputs, inits)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.training_info.append(helper.make_training_info(algorithm, update, None, None))
    if not any(o.domain == PREVIEW for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(PREVIEW, 1))
    return out


def inference_only(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.training_info[:]
    return out

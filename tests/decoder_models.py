"""A tiny decoder exported for generation, made by hand: token ids, an attention mask, position ids and a KV cache
(``past_key_values.0.key`` concatenated with the new keys into ``present.0.key``, as Optimum's exports do), so
that the driver's made feeds (the empty past, positions from the mask) matter to the loss and are quick to run."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, DIM, POSITIONS = 11, 4, 16


def with_past_decoder(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    inits = [weight("embed", VOCAB, DIM), weight("pos_embed", POSITIONS, DIM), weight("Wk", DIM, DIM),
             weight("head", DIM, VOCAB), numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array([2], np.int64), "axis2")]
    n = helper.make_node
    nodes = [n("Gather", ["embed", "input_ids"], ["tok"]), n("Gather", ["pos_embed", "position_ids"], ["pos"]),
             n("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
             n("Unsqueeze", ["maskf", "axis2"], ["mask3"]), n("Add", ["tok", "pos"], ["h0"]),
             n("Mul", ["h0", "mask3"], ["h"]), n("MatMul", ["h", "Wk"], ["k"]), n("Unsqueeze", ["k", "axis1"], ["k4"]),
             n("Concat", ["past_key_values.0.key", "k4"], ["present.0.key"], axis=2),
             n("ReduceMean", ["present.0.key", "axis2"], ["kmean"], keepdims=1),
             n("Squeeze", ["kmean", "axis1"], ["kctx"]), n("Add", ["h", "kctx"], ["hk"]),
             n("Tanh", ["hk"], ["t"]), n("MatMul", ["t", "head"], ["logits"])]
    i64 = TensorProto.INT64
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("position_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch", 1, "past", DIM])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", VOCAB]),
               helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", 1, "total", DIM])]
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model


def token_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """3 rows of 6 tokens, the second left-padded by 2 (its positions start at its first token)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((3, 6), np.int64)
    mask[1, :2] = 0
    return {"input_ids": rng.integers(0, VOCAB, (3, 6)).astype(np.int64), "attention_mask": mask}

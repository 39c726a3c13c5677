"""The standard-ONNX forms of onnxruntime's contrib ops the rule cases check against (they live in the package,
``onnx_autodiff/check/contrib_forms.py``, where ``onnx-autodiff check`` uses them too)."""
from onnx_autodiff.check.contrib_forms import (
    dynamic_quantize_matmul,
    group_query_attention,
    rotary_embedding,
    simplified_layer_norm,
    skip_norm,
)

__all__ = ["dynamic_quantize_matmul", "group_query_attention", "rotary_embedding", "simplified_layer_norm",
           "skip_norm"]

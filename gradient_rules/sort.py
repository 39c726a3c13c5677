"""TopK: the values output is a gather of the input, so its gradient scatters dy back to the chosen
positions (the indices output tells them; they are distinct along the axis). Indices get none."""
from __future__ import annotations

from onnx_autodiff.rule_api import GradBuilder, Grads, NodeView, gradient_rule, jvp_rule


@gradient_rule("TopK")
def topk_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dv = dy[0]
    if dv is None:
        return [None]
    x = node.inputs[0]
    return [g.scatter_elements(g.zeros_like(x), node.outputs[1], dv, axis=node.attr("axis", -1))]


@jvp_rule("TopK")
def topk_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dx at the chosen positions."""
    return [g.GatherElements(dx[0], node.outputs[1], axis=node.attr("axis", -1)), None]

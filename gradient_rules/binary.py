"""Binary and variadic elementwise ops with numpy broadcasting."""
from onnx_autodiff.registry import gradient_rule


@gradient_rule("Add")
def add_grad(g, node, dy):
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    return [g.unbroadcast(dz, a, z) if node.needs_grad(0) else None,
            g.unbroadcast(dz, b, z) if node.needs_grad(1) else None]


@gradient_rule("Sub")
def sub_grad(g, node, dy):
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    return [g.unbroadcast(dz, a, z) if node.needs_grad(0) else None,
            g.unbroadcast(g.Neg(dz), b, z) if node.needs_grad(1) else None]


@gradient_rule("Mul")
def mul_grad(g, node, dy):
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    return [g.unbroadcast(g.Mul(dz, b), a, z) if node.needs_grad(0) else None,
            g.unbroadcast(g.Mul(dz, a), b, z) if node.needs_grad(1) else None]


@gradient_rule("Sum")
def sum_grad(g, node, dy):
    dz, = dy
    z = node.outputs[0]
    return [g.unbroadcast(dz, x, z) if node.needs_grad(i) else None for i, x in enumerate(node.inputs)]

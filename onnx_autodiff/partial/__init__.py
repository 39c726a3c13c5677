"""Partial training: an ONNX graph as one layer of a larger model (``build_vjp``), the PyTorch bridge, and
``ForwardBackwardTrainer``."""

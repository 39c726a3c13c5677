"""Federated learning on Flower (``pip install 'onnx-autodiff[federated]'``): a fleet of clients trains one
ONNX training model, each on its own runtime. ``client_app`` and ``server_app`` return Flower's own
``ClientApp`` / ``ServerApp``; run them with ``flwr.simulation.run_simulation`` or ``flwr run`` (docs/federated.md).
"""
from .client import client_app
from .model import FederatedModel, load_partition
from .proximal import with_proximal_term
from .server import STRATEGIES, make_strategy, server_app

__all__ = ["client_app", "server_app", "make_strategy", "STRATEGIES", "FederatedModel", "load_partition",
           "with_proximal_term"]

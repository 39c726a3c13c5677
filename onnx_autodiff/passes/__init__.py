"""Model-to-model passes. Each takes a ModelProto it may change in place and returns whether it did."""
from .cleanup import cleanup
from .gradient import TRAINING_DOMAINS, lower_gradient_node, lower_gradients
from .naming import name_nodes, used_names

__all__ = ["cleanup", "lower_gradients", "lower_gradient_node", "name_nodes", "used_names", "TRAINING_DOMAINS"]

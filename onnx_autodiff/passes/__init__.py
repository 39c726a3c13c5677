"""Model-to-model passes of the lowering pipeline.

Contract: a pass is ``run(model: ModelProto, ctx: LoweringContext) -> bool``: it changes ``model`` in
place, makes new names fresh against ``ctx.taken``, records the nodes it adds in ``ctx.added``, and
returns whether it changed the model. ``lower.PIPELINE`` lists them in the order they run.
"""
from .context import LoweringContext
from .gradient import lower_gradient_node, lower_gradients
from .optimizers import lower_optimizers
from .training import check_no_training_ops, lower_training_info

__all__ = ["LoweringContext", "lower_gradients", "lower_gradient_node", "lower_optimizers", "lower_training_info",
           "check_no_training_ops"]

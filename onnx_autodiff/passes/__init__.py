"""Model-to-model passes, run in named pipelines.

Contract: a pass is ``run(model: ModelProto, ctx) -> bool``: it changes ``model`` in place, makes new names
fresh against ``ctx.taken``, records the nodes it adds in ``ctx.added``, and returns whether it changed the
model. The pipelines: ``pipeline.PIPELINE`` (``lower``: training ops to standard ONNX, then the forms the
target runtime has; postcondition ``ENSURES``), ``inference.INFERENCE`` (a trained model for inference), and
each runtime's ``Target.step_fixes`` (named in ``runtimes/targets.py``, resolved by ``step_quirks.step_fixes``,
run on a bundle's step). Node-for-node replacements are rules of one mechanism (``rewrite.py``).
"""
from .context import LoweringContext
from .gradient import lower_gradient_node, lower_gradients
from .optimizers import lower_optimizers
from .training import check_no_training_ops, lower_training_info

__all__ = ["LoweringContext", "lower_gradients", "lower_gradient_node", "lower_optimizers", "lower_training_info",
           "check_no_training_ops"]

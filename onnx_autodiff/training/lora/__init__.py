"""LoRA in one place: the rewrite that adds adapters (``rewrite.py``), their inference form (``merge.py``: merged
into the weights or kept as zero-default inputs; ``passes/inference.py`` runs it as the ``lora_for_inference``
pass), LoRA over quantized bases (``quantized.py``) and the adapters written out for PEFT or onnxruntime
(``adapters.py``). ``onnx_autodiff.training.lora`` keeps the names the rewrite module had at this path."""
from .rewrite import (
    PRESETS,
    LoraTarget,
    MergedWeights,
    add_lora,
    find_targets,
    lora_config,
    lora_delta,
    lora_inference,
    lora_record,
    merge_lora,
    module_path,
)

__all__ = ["PRESETS", "LoraTarget", "add_lora", "find_targets", "lora_config", "lora_delta", "lora_inference",
           "lora_record", "merge_lora", "module_path", "MergedWeights"]

"""PEFT export of a model builder's model never guesses its family silently. The family (genai_config.json's
model.type) names the Hugging Face modules: Phi-3 fuses the builder's gate_proj / up_proj into gate_up_proj (and
q/k/v into qkv_proj), Llama keeps them apart. make_training_model records it in the LoRA record, so a checkpoint
exports right with its builder folder gone; a record without one, from a builder whose folder is not found, is an
AdapterError naming the modules (``--base`` or ``--family``). Before, such a Phi-3 checkpoint was written with
Llama's names, which PEFT loads with no warning onto no module."""
import json

import numpy as np
import onnx
import pytest

from onnx_autodiff.cli import main
from onnx_autodiff.errors import AdapterError
from onnx_autodiff.model import metadata
from onnx_autodiff.training.lora.adapters import export_peft


def _record(builder: bool) -> tuple[dict, dict]:
    """Two MLP layers of rank 2, as the builder (``<module>.MatMul.weight``) or torch.onnx names the weights."""
    layers, arrays = [], {}
    rng = np.random.default_rng(0)
    for part in ("gate_proj", "up_proj"):
        module = f"model.layers.0.mlp.{part}"
        weight = f"{module}.MatMul.weight_Q4" if builder else f"{module}.weight"
        layers.append({"module": module, "weight": weight, "lora_A": f"{part}.A", "lora_B": f"{part}.B",
                       "n_out": 16, "output": f"{part}.out", "layout": "in_out"})
        arrays[f"{part}.A"], arrays[f"{part}.B"] = rng.standard_normal((2, 8)), rng.standard_normal((16, 2))
    return {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["mlp"], "layers": layers}, arrays


def _targets(folder) -> list[str]:
    return json.loads((folder / "adapter_config.json").read_text())["target_modules"]


def test_a_builder_record_of_unknown_family_is_refused(tmp_path):
    record, arrays = _record(builder=True)
    with pytest.raises(AdapterError, match=r"mlp\.gate_proj.*mlp\.up_proj.*family is not known") as err:
        export_peft(record, arrays, str(tmp_path / "none"))
    assert "--family" in err.value.hint and "--base" in err.value.hint
    assert not (tmp_path / "none").exists()  # nothing written
    export_peft(record, arrays, str(tmp_path / "phi3"), family="phi3")
    export_peft(record, arrays, str(tmp_path / "llama"), family="llama")
    export_peft(record, arrays, str(tmp_path / "Phi3"), family="Phi3")  # as a person may type it
    assert _targets(tmp_path / "phi3") == _targets(tmp_path / "Phi3") == ["gate_up_proj"]
    assert _targets(tmp_path / "llama") == ["gate_proj", "up_proj"]


def test_a_torch_export_needs_no_family(tmp_path):
    record, arrays = _record(builder=False)  # the module names are the transformers model's own
    export_peft(record, arrays, str(tmp_path / "peft"))
    assert _targets(tmp_path / "peft") == ["gate_proj", "up_proj"]


def _drop_family(path) -> None:
    model = onnx.load(str(path), load_external_data=False)
    record = json.loads(next(p.value for p in model.metadata_props if p.key == metadata.LORA))
    record.pop("family")
    metadata.write(model, {metadata.LORA: json.dumps(record)})
    onnx.save(model, str(path))


def test_the_recorded_family_exports_without_the_builder_folder(builder_models, tmp_path, capsys):
    pytest.importorskip("peft")
    from safetensors.numpy import load_file

    from tests.integration.test_peft_fused import _trained

    _, training = _trained(builder_models.get("phi3", "fp32"), tmp_path, ["mlp"], steps=2)
    ckpt = tmp_path / "ckpt" / "checkpoint.onnx"
    assert main(["export-adapter", str(ckpt), str(tmp_path / "found"), "--base", str(training)]) == 0
    (tmp_path / "builder" / "genai_config.json").unlink()  # the folder the family was read from: gone
    assert main(["export-adapter", str(ckpt), str(tmp_path / "recorded"), "--base", str(training)]) == 0
    assert _targets(tmp_path / "recorded") == _targets(tmp_path / "found") == ["down_proj", "gate_up_proj"]
    found, recorded = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("found", "recorded"))
    assert found.keys() == recorded.keys() and all(np.array_equal(found[k], recorded[k]) for k in found)

    _drop_family(ckpt)  # a checkpoint made before the family was recorded
    capsys.readouterr()
    assert main(["export-adapter", str(ckpt), str(tmp_path / "unknown"), "--base", str(training)]) != 0
    assert "mlp.gate_proj" in capsys.readouterr().err and not (tmp_path / "unknown").exists()
    assert main(["export-adapter", str(ckpt), str(tmp_path / "named"), "--base", str(training),
                 "--family", "phi3"]) == 0
    named = load_file(str(tmp_path / "named" / "adapter_model.safetensors"))
    assert named.keys() == found.keys() and all(np.array_equal(found[k], named[k]) for k in found)

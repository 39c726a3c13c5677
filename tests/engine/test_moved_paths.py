"""Public paths moved by REVIEW-5 change 3 still work for one release, each name with a DeprecationWarning that
names its new path, and give the very object of the new path."""
from __future__ import annotations

import importlib

import pytest

MOVED = [  # (old module, name, new module)
    ("onnx_autodiff.runners", "BundleTrainer", "onnx_autodiff.runtimes"),
    ("onnx_autodiff.runners.loop", "BundleTrainer", "onnx_autodiff.runtimes.loop"),
    ("onnx_autodiff.runners.train", "train_bundle", "onnx_autodiff.runtimes.train"),
    ("onnx_autodiff.runners.state_file", "import_state", "onnx_autodiff.runtimes.state_file"),
    ("onnx_autodiff.training.adapters", "export_adapter", "onnx_autodiff.training.lora.adapters"),
    ("onnx_autodiff.gradcheck", "gradient_model", "onnx_autodiff.check.gradcheck"),
]


@pytest.mark.parametrize("old, name, new", MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_old_path_warns_and_gives_the_new_object(old, name, new):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


def test_a_name_the_new_module_lacks_is_an_attribute_error():
    module = importlib.import_module("onnx_autodiff.runners")
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_the_lora_module_path_keeps_its_names():
    """``onnx_autodiff.training.lora`` became a package; the names the rewrite module had there stay, unwarned."""
    import warnings

    from onnx_autodiff.training.lora import rewrite

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lora = importlib.import_module("onnx_autodiff.training.lora")
        assert all(getattr(lora, n) is getattr(rewrite, n) for n in rewrite.__all__)


def test_the_function_keeps_the_name_gradcheck():
    """``onnx_autodiff.gradcheck`` is the function, before and after the old module path is imported."""
    import onnx_autodiff
    from onnx_autodiff.check.gradcheck import gradcheck

    assert onnx_autodiff.gradcheck is gradcheck
    with pytest.warns(DeprecationWarning, match=r"onnx_autodiff\.check\.gradcheck"):
        from onnx_autodiff.gradcheck import jvp_check  # noqa: F401
    assert onnx_autodiff.gradcheck is gradcheck

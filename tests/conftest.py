"""Hypothesis in CI (``CI`` set, as .ci/run's runner does) draws the same examples every run, so a red
CI means a change broke something, not that the dice found an old case; local runs keep exploring."""
import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# the onnxruntime-node runner (onnx_autodiff/runtimes/node.py) finds the packages tests/js installs
os.environ.setdefault("ONNX_AUTODIFF_NODE_MODULES", os.path.join(os.path.dirname(__file__), "js", "node_modules"))


@pytest.fixture(scope="session")
def builder_models(tmp_path_factory):
    """onnxruntime-genai model-builder output (tests/genai_models.py), each model built on first use."""
    pytest.importorskip("onnxruntime_genai")
    from tests.genai_models import BuilderModels

    return BuilderModels(tmp_path_factory.mktemp("genai"))


@pytest.fixture(scope="session")
def optimum_models(tmp_path_factory):
    """The LLM files Optimum / transformers.js publish (tests/optimum_models.py), each built on first use."""
    pytest.importorskip("transformers")
    from tests.optimum_models import OptimumModels

    return OptimumModels(tmp_path_factory.mktemp("optimum"))

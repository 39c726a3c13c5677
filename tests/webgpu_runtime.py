"""onnxruntime's WebGPU plugin EP (``onnxruntime-ep-webgpu``) for the tests, on a machine without a GPU too.

Unless ``ONNX_AUTODIFF_WEBGPU=hardware`` (a machine with a GPU), the tests use SwiftShader's software Vulkan
driver from Debian's chromium package (``VK_ICD_FILENAMES``) and let the plugin take a software adapter
(``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1``), set before the plugin is registered in this process. A piece that is
missing skips with what to install, unless ``ONNX_AUTODIFF_REQUIRE_WEBGPU=1``, where it fails: CI must run them.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SWIFTSHADER = Path("/usr/lib/chromium/vk_swiftshader_icd.json")
INSTALL = ("pip install 'onnx-autodiff[webgpu]'; apt-get install -y libvulkan1 chromium (SwiftShader's software "
           "Vulkan driver comes with chromium)")


def _missing(reason: str):
    if os.environ.get("ONNX_AUTODIFF_REQUIRE_WEBGPU") == "1":
        pytest.fail(f"{reason} (ONNX_AUTODIFF_REQUIRE_WEBGPU=1: CI must run the WebGPU tests)")
    pytest.skip(reason)


def software_adapter_env() -> dict[str, str]:
    """The environment that gives the plugin (and Chromium's Dawn) SwiftShader's adapter."""
    return {"VK_ICD_FILENAMES": str(SWIFTSHADER), "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER": "1"}


def webgpu_device():
    """The WebGPU ``Device`` (driver/devices.py), or a skip saying what is missing."""
    pytest.importorskip("onnxruntime_ep_webgpu", reason=INSTALL) if os.environ.get(
        "ONNX_AUTODIFF_REQUIRE_WEBGPU") != "1" else None
    if os.environ.get("ONNX_AUTODIFF_WEBGPU") != "hardware":
        if not SWIFTSHADER.is_file():
            _missing(f"no software Vulkan driver at {SWIFTSHADER}: {INSTALL}")
        for key, value in software_adapter_env().items():
            os.environ.setdefault(key, value)
    from onnx_autodiff.driver.devices import WEBGPU, resolve_device
    from onnx_autodiff.errors import DeviceError, MissingRuntimeError

    try:
        return resolve_device([WEBGPU])
    except (DeviceError, MissingRuntimeError) as e:
        _missing(f"{e} ({e.hint})")

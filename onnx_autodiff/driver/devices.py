"""Where a step runs: the onnxruntime execution provider a ``TrainingSession`` was given, as a device.

``resolve_device(providers)`` turns the ``providers`` argument into a ``Device``: the OrtValue device the
state lives on (``cpu``, ``cuda``, ``webgpu``), how sessions get the provider (a providers list, or for a
plugin EP the ``OrtEpDevice`` that ``SessionOptions.add_provider_for_devices`` takes) and the target the
step is lowered for (``runtimes/targets.py``). Every device but the CPU keeps the state on the device
(``state.py``); only the batch, the hyper-parameters and the scalars a step reads back cross the bus.

WebGPU is onnxruntime's WebGPU plugin EP (PyPI ``onnxruntime-ep-webgpu``, the ``webgpu`` extra), registered
once per process with ``onnxruntime.register_execution_provider_library``. Its sessions get
``enableInt64``: without it every int64 node (a step counter, class labels compared) falls back to the CPU.
On a machine without a GPU, a software Vulkan adapter works (docs/gpu.md: SwiftShader, with
``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnxruntime as ort

from ..errors import DeviceError, MissingRuntimeError

WEBGPU = "WebGpuExecutionProvider"
CUDA = "CUDAExecutionProvider"
FALLBACK_OFF = "session.disable_cpu_ep_fallback"
WEBGPU_OPTIONS = {"enableInt64": "1"}  # int64 kernels (counter, labels) on the device, not the CPU
_registered: dict[str, str] = {}


@dataclass
class Device:
    """An execution provider as the place a step's tensors live.

    ``name``/``device_id``: the OrtValue device (``cpu``, ``cuda``, ``webgpu``). ``providers``: what
    ``InferenceSession(providers=...)`` takes (None for a plugin EP, which ``options`` adds instead).
    ``ep_devices``/``ep_options``: the plugin EP's devices and options. ``target``: what the step is
    lowered for."""

    name: str = "cpu"
    device_id: int = 0
    providers: list | None = field(default_factory=lambda: ["CPUExecutionProvider"])
    ep_devices: list = field(default_factory=list)
    ep_options: dict = field(default_factory=dict)
    target: str | None = None

    @property
    def on_host(self) -> bool:
        return self.name == "cpu"

    def add_to(self, options: ort.SessionOptions) -> ort.SessionOptions:
        """``options`` (changed in place, once) with the plugin EP, where this device is one."""
        if self.ep_devices and not options.has_providers():
            options.add_provider_for_devices(self.ep_devices, dict(self.ep_options))
        return options

    def session(self, model: bytes | str, options: ort.SessionOptions) -> ort.InferenceSession:
        """An onnxruntime session of ``model`` on this device (``options`` must have been through ``add_to``);
        refused with the CPU fallback off, the error names the nodes that would run on the CPU."""
        try:
            return ort.InferenceSession(model, options, providers=self.providers)
        except Exception as e:  # onnxruntime raises its own types (EPFail, Fail, ...) with the reason in the text
            if self.on_host:
                raise
            reason = str(e).splitlines()[0][:400]
            if _config(options, FALLBACK_OFF) == "1":
                nodes = [f"{op} {name!r}" for ep, op, name in self.placement(model) if ep == "CPUExecutionProvider"]
                if nodes:
                    reason = (f"with {FALLBACK_OFF}=1 it refuses the {len(nodes)} node(s) that would run on the CPU: "
                              + ", ".join(nodes[:12]) + (" ..." if len(nodes) > 12 else ""))
            raise DeviceError(f"onnxruntime could not make a session on {self.name}: {reason}",
                              hint=_HINTS.get(self.name, "")) from None

    def placement(self, model: bytes | str) -> list[tuple[str, str, str]]:
        """``(execution provider, op type, node name)`` of every node onnxruntime runs for ``model`` on this
        device, after its graph optimizations (it records them with ``session.record_ep_graph_assignment_info``;
        nodes it folds into constants are not there)."""
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        sess = self.session(model, self.add_to(options))
        return [(sub.ep_name, n.op_type, n.name) for sub in sess.get_provider_graph_assignment_info()
                for n in sub.get_nodes()]


_HINTS = {"webgpu": "check that a WebGPU adapter is there (docs/gpu.md); where a node is refused with "
                    "session.disable_cpu_ep_fallback, `onnx-autodiff check MODEL --target webgpu` lists the nodes "
                    "that would run on the CPU"}


def _config(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:
        return None


def _wants(providers, name: str) -> tuple[bool, dict]:
    for p in providers or ():
        if isinstance(p, tuple) and p[0] == name:
            return True, dict(p[1] or {})
        if p == name:
            return True, {}
    return False, {}


def webgpu_ep_device() -> ort.OrtEpDevice:
    """The WebGPU plugin EP's device, its library registered once per process."""
    try:
        import onnxruntime_ep_webgpu
    except ImportError:
        raise MissingRuntimeError("the WebGPU execution provider is not installed",
                                  hint="pip install 'onnx-autodiff[webgpu]' (onnxruntime-ep-webgpu)") from None
    if WEBGPU not in _registered:
        try:
            ort.register_execution_provider_library("webgpu", onnxruntime_ep_webgpu.get_library_path())
        except Exception as e:
            raise DeviceError(f"onnxruntime refused the WebGPU plugin library: {str(e).splitlines()[0][:300]}",
                              hint="onnxruntime-ep-webgpu 0.4 needs onnxruntime >= 1.24.4") from None
        _registered[WEBGPU] = "webgpu"
    found = [d for d in ort.get_ep_devices() if d.ep_name == WEBGPU]
    if not found:
        raise DeviceError("the WebGPU execution provider found no device (no GPU with a Vulkan, Metal or D3D12 "
                          "driver)", hint="on a machine without a GPU a software adapter works: see docs/gpu.md "
                                          "(VK_ICD_FILENAMES, ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1)")
    return found[0]


def fallback_nodes(model, target: str, dims: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """``(op, node name)`` of every node onnxruntime would run on the CPU instead of ``target``'s execution
    provider (``Target.ep``): of the step a training model's bundle for ``target`` runs, or of an inference
    model as lowered for ``target``. Asks onnxruntime itself (it records where each node goes), so the EP
    must be installed and find a device; nodes onnxruntime folds into constants are not listed."""
    from ..model.carrier import LightModel, open_model
    from ..runtimes.targets import get_target
    from .step import assemble, lowered

    t = get_target(target)
    if t.ep is None:
        raise DeviceError(f"target {t.name!r} is no onnxruntime execution provider: nothing to place")
    light = open_model(model)
    if len(light.proto.training_info):
        step = assemble(light, t.name, dims=dims, plain=True)
        light = LightModel(step.model, step.light.arrays)
    else:
        light = lowered(light, t.name, dims)
    device = resolve_device([t.ep])
    return [(op, name) for ep, op, name in device.placement(light.whole().SerializeToString())
            if ep == "CPUExecutionProvider"]


def resolve_device(providers) -> Device:
    """The device of a providers list: WebGPU (the plugin EP) where it is asked for, CUDA where it is asked
    for and available, else the CPU (as onnxruntime itself falls back from an unavailable CUDA)."""
    webgpu, options = _wants(providers, WEBGPU)
    if webgpu:
        return Device("webgpu", 0, None, [webgpu_ep_device()], {**WEBGPU_OPTIONS, **options}, "webgpu")
    cuda, options = _wants(providers, CUDA)
    if cuda and CUDA in ort.get_available_providers():
        return Device("cuda", int(options.get("device_id", 0)), list(providers))
    return Device()


__all__ = ["Device", "resolve_device", "webgpu_ep_device", "fallback_nodes", "WEBGPU", "CUDA", "WEBGPU_OPTIONS",
           "FALLBACK_OFF"]

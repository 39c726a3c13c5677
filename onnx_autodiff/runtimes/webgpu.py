"""onnxruntime's WebGPU execution provider (the ``onnxruntime-ep-webgpu`` plugin, the ``webgpu`` extra) as a bundle
runner. ``train --runtime webgpu`` trains through ``TrainingSession`` on the same EP instead, with the state on the
device (``driver/devices.py``); this runner follows the bundle loop, which hands the state through numpy at
every step, as a check that the bundle itself trains there. ``strict``: the CPU fallback off (every node on
the GPU, or onnxruntime refuses the session and our error names the nodes)."""
from __future__ import annotations

from ..driver.devices import FALLBACK_OFF, WEBGPU, resolve_device
from ..ort_options import session_options
from .loop import check_feeds


def load(path: str, *, strict: bool = False):
    device = resolve_device([WEBGPU])
    options = session_options()
    if strict:
        options.add_session_config_entry(FALLBACK_OFF, "1")
    sess = device.session(path, device.add_to(options))
    names = [o.name for o in sess.get_outputs()]
    takes = {i.name for i in sess.get_inputs()}

    def run(feeds):
        check_feeds(path, "webgpu", takes, feeds)
        return dict(zip(names, sess.run(None, dict(feeds))))
    return run


__all__ = ["load"]

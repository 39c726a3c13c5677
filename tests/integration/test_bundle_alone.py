"""A step bundle trains from ``bundle.json`` alone (issue 35): drivers that import nothing of onnx-autodiff, the loop
of docs/runtimes.md, on onnx.reference, OpenVINO and tract (``tests/bundle_alone/drive.py``, run in a process of its
own, which checks that no ``onnx_autodiff`` module was imported) and on onnxruntime-node and onnxruntime-web (wasm,
headless Chromium; ``tests/js/bundle_alone.mjs``, which imports only the ``ort`` it is given). Each trains 3 steps;
the loss of each step and every state tensor after them match ``TrainingSession`` (onnxruntime) within 1e-5
relative, the runtimes' agreement (docs/runtimes.md's parity table).

Subjects: every target's bundle of the demo CNN (each on the runtimes of its target: ``portable`` on all five,
``onnxruntime`` and ``webgpu`` on onnxruntime-node, whose kernels they are written for), an MLP, a torch
``TransformerEncoderLayer`` (TorchScript, d_model 16) and a tiny ViT of ``transformers`` (hidden 16, 2 layers, 16x16
images), with Adam and SGD. The default run keeps the CNN and the MLP on the Python runtimes and onnxruntime-node
(a few seconds each); the transformer, the ViT and Chromium are ``slow``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_autodiff import TrainingSession
from onnx_autodiff.driver.bundle import export_step
from onnx_autodiff.training import OptimizerSpec, make_training_model
from tests.js_runtime import read_result, run_node, web_routes, write_batches
from tests.runtime_models import training_case

DRIVER = Path(__file__).resolve().parents[1] / "bundle_alone" / "drive.py"
RTOL = 1e-5
STEPS = 3
PYTHON = ("reference", "openvino", "tract")
JS = ("node", "web")
# the runtimes a target's bundle is for (onnxruntime-node runs onnxruntime's kernels: the onnxruntime and webgpu
# targets' bundles too; onnxruntime-web's wasm is the same kernels in the browser)
ON = {"portable": PYTHON + JS, "reference": ("reference",), "openvino": ("openvino",), "tract": ("tract",),
      "onnxruntime": ("node",), "onnxruntime-node": ("node",), "onnxruntime-web": ("node", "web"),
      "webgpu": ("node", "web")}
FAST = [("cnn", "adam", t) for t in ON] + [("cnn", "sgd", "portable"), ("mlp", "adam", "portable"),
                                           ("mlp", "sgd", "portable")]
SLOW = [(m, o, "portable") for m in ("transformer", "vit") for o in ("adam", "sgd")]
IMPORTS = {"reference": "onnx.reference", "openvino": "openvino", "tract": "tract"}


def vit_case(optimizer: str):
    """A tiny ViT (transformers, random weights) exported by TorchScript, MSE on its last hidden state."""
    pytest.importorskip("transformers")
    from tests.hf_models import build, export

    module, inputs = build("vit")
    # the attention key biases get exactly zero gradient: their Adam moments are rounding noise on every runtime,
    # which no relative comparison can hold (frozen, as BERT's in tests/runtime_models.py)
    options = {"eps": 1e-4} if optimizer == "adam" else None
    training = make_training_model(export(module, inputs, "ts17-nofold"), "mse", OptimizerSpec(optimizer, options),
                                   lr=0.01, frozen=["*k_proj.bias"])
    rng = np.random.default_rng(1)
    return training, [{"pixel_values": rng.standard_normal((2, 3, 16, 16)).astype(np.float32),
                       "labels": rng.standard_normal((2, 5, 16)).astype(np.float32)} for _ in range(STEPS)]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    diff = float(np.max(np.abs(a - b))) if b.size else 0.0
    return diff / scale if scale else diff


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """{(model, optimizer, target): (bundle dir, batches, TrainingSession's losses and state)}, built on demand."""
    root = tmp_path_factory.mktemp("bundle_alone")
    refs, built = {}, {}

    def get(model, optimizer, target):
        if (model, optimizer) not in refs:
            training, batches = vit_case(optimizer) if model == "vit" else training_case(model, optimizer, STEPS)
            sess = TrainingSession(training, progress=False)
            losses = [float(np.asarray(sess.step(b)[sess.loss_name]).reshape(-1)[0]) for b in batches]
            refs[model, optimizer] = training, batches, losses, {k: np.asarray(sess.state[k]) for k in sess.state}
        key = (model, optimizer, target)
        if key not in built:
            training, batches, losses, state = refs[model, optimizer]
            folder = root / "-".join(key)
            export_step(training, folder / "bundle", target=target)
            np.savez(folder / "batches.npz", **{f"{s}/{k}": v for s, b in enumerate(batches) for k, v in b.items()})
            write_batches(folder / "batches", batches, {})
            built[key] = folder, losses, state
        return built[key]
    get.root = root
    return get


def _train_python(runtime: str, folders: list[Path]) -> list[tuple[list[float], dict]]:
    """The bundles trained by drive.py on ``runtime``, in a process without this checkout on its path."""
    pytest.importorskip(IMPORTS[runtime])
    jobs = [{"bundle": str(f / "bundle"), "batches": str(f / "batches.npz"), "out": str(f / f"{runtime}.npz")}
            for f in folders]
    jobs_file = folders[0] / f"jobs-{runtime}.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-I", str(DRIVER), runtime, str(jobs_file)], capture_output=True, text=True,
                       cwd=folders[0], env=env, timeout=600)
    assert p.returncode == 0, f"drive.py {runtime} exited {p.returncode}:\n{p.stdout}\n{p.stderr[-4000:]}"
    out = []
    for job in jobs:
        data = np.load(job["out"])
        out.append(([float(data[f"loss/{k}"]) for k in range(STEPS)],
                    {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith("state/")}))
    return out


def _train_js(runtime: str, folders: list[Path], root: Path) -> list[tuple[list[float], dict]]:
    if runtime == "node":
        jobs = [{"bundle": str(f / "bundle"), "batches": str(f / "batches"), "out": str(f / "node.json")}
                for f in folders]
        origin, server = None, None
    else:
        from onnx_autodiff.web.serve import start_server
        from tests.js_runtime import chromium

        exe = chromium()
        jobs = [{"bundle": f"/work/{f.name}/bundle", "batches": f"/work/{f.name}/batches", "out": str(f / "web.json")}
                for f in folders]
        server = start_server(web_routes(root))
        origin = f"http://127.0.0.1:{server.server_address[1]}"
    jobs_file = root / f"jobs-{runtime}.json"
    jobs_file.write_text(json.dumps({"origin": origin, "jobs": jobs}))
    try:
        run_node(["run_bundle_alone.mjs", runtime, str(jobs_file)], env={"CHROMIUM": exe} if server else None)
    finally:
        if server is not None:
            server.shutdown()
    return [read_result(Path(j["out"])) for j in jobs]


def _check(work, cases, runtime):
    cases = [c for c in cases if runtime in ON[c[2]]]
    folders = [work(*c)[0] for c in cases]
    got = _train_js(runtime, folders, work.root) if runtime in JS else _train_python(runtime, folders)
    for case, (losses, state) in zip(cases, got):
        _, ref_losses, ref_state = work(*case)
        assert set(state) == set(ref_state), (case, sorted(set(state) ^ set(ref_state)))
        loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses))
        errs = {k: rel(state[k], ref_state[k]) for k in ref_state}
        worst = max(errs, key=errs.get)
        print(f"\nalone {'-'.join(case)} {runtime}: loss {loss_err:.1e}, state {errs[worst]:.1e} ({worst})")
        assert len(losses) == STEPS and loss_err <= RTOL, (case, runtime, losses, ref_losses)
        assert errs[worst] <= RTOL, (case, runtime, worst, errs[worst])


@pytest.mark.parametrize("runtime", [*PYTHON, "node"])
def test_bundle_trains_from_its_manifest_alone(work, runtime):
    _check(work, FAST, runtime)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", [*PYTHON, *JS])
def test_transformers_train_from_the_manifest_alone(work, runtime):
    _check(work, SLOW + (FAST if runtime == "web" else []), runtime)


@pytest.mark.parametrize("target,op,dtype", [("portable", "Identity", "int64"), ("tract", "Identity", "int64"),
                                             ("webgpu", "Cast", "int32"), ("onnxruntime", "Cast", "int32")])
def test_the_counter_comes_back_as_int64_on_tract(tmp_path, target, op, dtype):
    """tract types a Cast to int64 as TDim, which its API does not hand out: the tract and portable steps take the
    counter's next value fed as int64 and pass it through; the webgpu step casts an int32 (WebGPU runs an int64
    Identity on the CPU). drive.py trains the tract and portable bundles on tract's own API."""
    from tests.cli_models import mlp

    bundle = tmp_path / "bundle"
    training = make_training_model(mlp(hidden=8, features=4, classes=3), "cross_entropy", "adam")
    manifest = json.loads(export_step(training, bundle, target=target).read_text())
    step = onnx.load(bundle / "step.onnx")
    new = manifest["state"]["train/iteration"]
    assert [n.op_type for n in step.graph.node if new in n.output] == [op]
    fed = [k for k, h in manifest["host_scalars"].items() if "factors" not in h]
    assert [manifest["host_scalars"][k]["dtype"] for k in fed] == [dtype]
    assert [i.type.tensor_type.elem_type for i in step.graph.input if i.name in fed] == [
        onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))]
    if "tract" not in ON[target]:
        return
    pytest.importorskip("tract")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "batches.npz", **{f"{s}/x": rng.standard_normal((2, 4)).astype(np.float32) for s in range(3)},
             **{f"{s}/labels": rng.integers(0, 3, 2) for s in range(3)})
    (_, state), = _train_python("tract", [tmp_path])
    assert state["train/iteration"].dtype == np.int64 and int(state["train/iteration"]) == STEPS


def test_a_bundle_written_before_trains_on_our_runner_but_not_from_its_manifest(tmp_path):
    """A bundle whose step casts the counter from int32 (as every bundle did before) still trains on our tract
    runner, which converts the TDim; a driver of tract's API alone cannot, which is what the bundle now avoids."""
    pytest.importorskip("tract")
    from onnx_autodiff.runtimes import BundleTrainer
    from tests.cli_models import mlp

    bundle = tmp_path / "bundle"
    manifest = json.loads(export_step(make_training_model(mlp(hidden=8, features=4, classes=3), "cross_entropy",
                                                          "sgd"), bundle).read_text())
    step = onnx.load(bundle / "step.onnx")
    fed = next(k for k, h in manifest["host_scalars"].items() if "factors" not in h)
    for k, n in enumerate(step.graph.node):
        if n.op_type == "Identity" and n.input[0] == fed:
            step.graph.node[k].CopyFrom(onnx.helper.make_node("Cast", [fed], list(n.output), to=onnx.TensorProto.INT64))
    next(i for i in step.graph.input if i.name == fed).type.tensor_type.elem_type = onnx.TensorProto.INT32
    onnx.save(step, bundle / "step.onnx")
    manifest["host_scalars"][fed]["dtype"] = "int32"
    (bundle / "bundle.json").write_text(json.dumps(manifest))

    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((2, 4)).astype(np.float32), "labels": rng.integers(0, 3, 2)}
               for _ in range(STEPS)]
    trainer = BundleTrainer(bundle, "tract")
    for b in batches:
        trainer.step(b)
    assert int(np.asarray(trainer.state["train/iteration"])) == STEPS
    np.savez(tmp_path / "batches.npz", **{f"{s}/{k}": v for s, b in enumerate(batches) for k, v in b.items()})
    with pytest.raises(AssertionError, match="TDim"):
        _train_python("tract", [tmp_path])

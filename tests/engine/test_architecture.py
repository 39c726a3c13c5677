"""The import directions of the house (docs/architecture.md), read from the source with ``ast``.

Rules depend on the small rule API only; nothing imports another module's private name; our modules
import each other without a cycle; and every import goes down the layers of
../shared/design/intended-architecture.json as ``LAYERS`` maps today's modules onto them.
"""
from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("onnx_autodiff", "gradient_rules")

# What a rule may import of ours: the one rule API, and the engine's verbs for subgraph bodies (control.py).
RULE_API = {"onnx_autodiff.rule_api", "onnx_autodiff.engine.subgraph"}
# Modules of gradient_rules that register no rule but hold what two families share; rule files import
# only these of their siblings.
RULE_HELPERS = {"gradient_rules.window", "gradient_rules.conv_dynamic", "gradient_rules.lstm_tangent",
                "gradient_rules.lstm_backward"}

# The floors of intended-architecture.json, keyed by folder (or by module for the flat top level, or by a
# dotted path where one module of a folder stands on a lower floor than its folder; the longest key wins).
# ``Graph`` is the ground floor: the graph view and what every floor may use (errors, light models, files).
LAYERS = {
    # tensor_info: types and shape inference, under graph; ort_options: the session settings every floor shares
    "Graph": ["graph", "tensor_info", "errors", "ort_options"],
    "Model": ["model"],  # a model whose tensors live outside protobuf: weights, files, metadata, the door
    "Engine": ["engine", "rule_api"],  # rule_api: the engine's face for rule authors
    # runtimes.targets: one record per runtime (lacks, step fixes by name, runner module by name, extra, EP); the
    # lowering reads it, so it stands under the passes and imports none (its runners stand on the Driver floor)
    "Records": ["runtimes.targets"],
    # training.lora.merge / .quantized: LoRA's inference form and its quantized bases, which the inference pass
    # lora_for_inference runs; LoRA's package (training/lora/) keeps them, under the passes (they import none)
    "LoRA forms": ["training.lora.merge", "training.lora.quantized"],
    "Passes": ["passes"],
    "Forward": ["forward"],  # jvp, hvp, jacobian: models built on the lowered gradient and the forward walk
    "Partial": ["partial"],  # partial training: build_vjp, the PyTorch bridge, ForwardBackwardTrainer
    # runtimes: each runtime's runner beside its record (the step bundle's loop, check --target, train --runtime);
    # runners: the deprecated path of runtimes (shims, one release)
    "Driver": ["driver", "runtimes", "runners"],
    "Builder": ["training"],
    # check: gradcheck, input dims, LLM files' feeds and float reference, contrib ops' float64 forms (tests/check/
    # mirrors it); gradcheck: its deprecated module path (a shim); conformance: rule cases and random graphs per runtime
    # runtimes.check: check --target, which runs its probe on the batch check/input_dims makes as the driver feeds it
    "Check": ["check", "gradcheck", "testing", "conformance", "runtimes.check"],
    "Federated": ["federated"],  # Flower's ClientApp / ServerApp over the driver's one fit (issue 36)
    "CLI": ["cli", "__main__", "web"],  # web: the browser demo's server (demo --web)
}
ARROWS = [("Rules", "Engine"), ("Model", "Graph"), ("Engine", "Graph"), ("Passes", "Engine"), ("Passes", "Model"),
          ("Passes", "Records"), ("Records", "Graph"), ("Passes", "LoRA forms"), ("LoRA forms", "Model"),
          ("Driver", "Passes"), ("Builder", "Passes"), ("Check", "Passes"), ("Check", "Driver"), ("Partial", "Passes"),
          ("Partial", "Builder"), ("CLI", "Driver"), ("CLI", "Builder"), ("CLI", "Check"), ("CLI", "Partial"),
          ("Forward", "Passes"), ("Check", "Forward"), ("CLI", "Forward"), ("Federated", "Driver"),
          ("Federated", "Builder"), ("CLI", "Federated")]
KNOWN_CYCLES: dict[tuple[str, str], str] = {}  # (demo -> cli went with issue 14: the session owns the epoch loop)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def imports_of(name: str, path: Path, local: bool = True) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for each import of ours in a module; with
    ``local=False`` only the imports at module level."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = ast.walk(tree) if local else tree.body
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            taken = [a.name for a in node.names]
            submodules = [f"{base}.{t}" for t in taken if f"{base}.{t}" in MODULES]
            if submodules:
                found += [(m, [], node.lineno) for m in submodules]
                taken = [t for t in taken if f"{base}.{t}" not in MODULES]
            if taken or not submodules:
                found.append((base, taken, node.lineno))
    return [(m, t, line) for m, t, line in found if m.split(".")[0] in PACKAGES and m in MODULES]


def edges(local: bool = True):
    for name, path in MODULES.items():
        for target, taken, line in imports_of(name, path, local):
            if target != name:
                yield name, target, taken, f"{path.relative_to(ROOT)}:{line}"


def layer_of(module: str) -> str | None:
    if module.startswith("gradient_rules"):
        return "Rules"
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package facade (onnx_autodiff/__init__) re-exports every floor
    for key in (".".join(parts[1:k]) for k in range(len(parts), 1, -1)):
        for layer, names in LAYERS.items():
            if key in names:
                return layer
    return None


def _allowed() -> set[tuple[str, str]]:
    arrows = set(ARROWS)
    layers = set(LAYERS) | {"Rules"}
    allowed = {(a, a) for a in layers}
    for a in layers:
        stack, seen = [a], set()
        while stack:
            here = stack.pop()
            for x, y in arrows:
                if x == here and y not in seen:
                    seen.add(y)
                    stack.append(y)
        allowed |= {(a, b) for b in seen}
    return allowed | {(a, "Graph") for a in layers}


def test_every_module_has_a_floor():
    unplaced = [m for m in MODULES if m not in PACKAGES and layer_of(m) is None]
    assert not unplaced, f"place these modules in LAYERS (and docs/architecture.md): {unplaced}"


def test_rules_import_only_the_rule_api():
    bad = [f"{where}: {src} imports {dst}" for src, dst, _, where in edges()
           if src.startswith("gradient_rules") and dst.startswith("onnx_autodiff") and dst not in RULE_API]
    assert not bad, "a rule may import only " + ", ".join(sorted(RULE_API)) + ":\n" + "\n".join(bad)


def test_rule_files_import_no_other_rule_file():
    bad = [f"{where}: {src} imports {dst}" for src, dst, _, where in edges()
           if src.startswith("gradient_rules.") and dst.startswith("gradient_rules.") and dst not in RULE_HELPERS]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_from_another_module():
    bad = [f"{where}: {src} takes {t} from {dst}" for src, dst, taken, where in edges()
           for t in taken if t.startswith("_") and not t.startswith("__")]
    assert not bad, "\n".join(bad)


def test_graph_imports_nothing_of_ours():
    """graph.py reads only tensor_info.py (types and shape inference, split out of it), which reads nothing of ours."""
    assert {dst for src, dst, _, _ in edges() if src == "onnx_autodiff.graph"} <= {"onnx_autodiff.tensor_info"}
    assert not [dst for src, dst, _, _ in edges() if src == "onnx_autodiff.tensor_info"]


@pytest.mark.parametrize("local", [False, True], ids=["module-level", "with-function-local"])
def test_no_import_cycle(local):
    """Module-level imports form no cycle; neither do they with the imports hidden inside functions."""
    sorter = TopologicalSorter()
    for name in MODULES:
        sorter.add(name)
    for src, dst, _, _ in edges(local):
        if dst.startswith(src + ".") or src == dst or (src, dst) in KNOWN_CYCLES:
            continue  # a package importing its own submodules; a known cycle
        sorter.add(src, dst)
    try:
        sorter.prepare()
    except CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_known_cycles_are_still_there():
    present = {(src, dst) for src, dst, _, _ in edges()}
    assert not set(KNOWN_CYCLES) - present, "remove these from KNOWN_CYCLES: they are gone"


def test_imports_go_down_the_floors():
    allowed = _allowed()
    bad = []
    for src, dst, _, where in edges():
        a, b = layer_of(src), layer_of(dst)
        if a is None or b is None or (a, b) in allowed:
            continue
        bad.append(f"{where}: {src} ({a}) imports {dst} ({b})")
    assert not bad, "imports against intended-architecture.json:\n" + "\n".join(bad)


def test_no_function_local_import_of_ours_in_passes():
    """Imports inside functions hide cycles; the passes have none to hide."""
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("onnx_autodiff.passes"):
            continue
        top = {(m, line) for m, _, line in imports_of(name, path, local=False)}
        bad += [f"{path.relative_to(ROOT)}:{line}: {m}" for m, _, line in imports_of(name, path)
                if (m, line) not in top]
    assert not bad, "\n".join(bad)


def test_every_module_is_named_in_the_architecture_page():
    """docs/architecture.md names every module of the package by its path under onnx_autodiff/ (package
    faces, ``__init__.py`` below the top, excepted) and every rule family file stands under gradient_rules."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in MODULES.values():
        rel = path.relative_to(ROOT)
        if rel.parts[0] != "onnx_autodiff" or (path.name == "__init__.py" and len(rel.parts) > 2):
            continue
        named = Path(*rel.parts[1:]).as_posix()
        if f"{named}`" not in page:
            missing.append(named)
    assert not missing, f"name these modules in docs/architecture.md (table 'Modules'): {missing}"


# The modules of passes/ that are not the home of a pass but serve one (the pass named beside each).
PASS_HELPERS = {"context": "every pass (LoweringContext)", "pipeline": "the pipelines' runner (run_pipeline)",
                "rewrite": "split_cross_entropy, rewrite_for_target, constant_weight_on_the_left (Rule)",
                "remat_plan": "rematerialize", "static_shapes": "the lowering pipeline (shape_hints)",
                "opset": "lower (the opset upgrade)", "graphcall": "lower_training_info", "eval_mode": "eval_mode"}


def test_every_module_of_passes_is_in_a_pipeline_or_serves_one():
    from onnx_autodiff.passes.inference import INFERENCE
    from onnx_autodiff.passes.pipeline import ENSURES, PIPELINE
    from onnx_autodiff.passes.step_quirks import step_fixes
    from onnx_autodiff.runtimes.targets import TARGETS

    fixes = {f for t in TARGETS.values() for f in step_fixes(t)}
    passes = set(PIPELINE) | set(ENSURES) | set(INFERENCE) | fixes
    homes = {p.__module__.rsplit(".", 1)[-1] for p in passes}
    modules = {name.rsplit(".", 1)[-1] for name in MODULES if name.startswith("onnx_autodiff.passes.")}
    stray = sorted(modules - homes - set(PASS_HELPERS))
    assert not stray, f"these modules of passes/ hold no pass of a pipeline and serve none: {stray}"
    assert not set(PASS_HELPERS) - modules, "PASS_HELPERS names a module that is gone"


def test_ruff_is_clean():
    """The lint rules in pyproject.toml ([tool.ruff]) hold over the whole tree."""
    import shutil
    import subprocess

    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    p = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr

"""What a newcomer met on the command line (issue 29), each fixed: --version; --loss names its choices and aliases
and refuses other spellings with a suggestion; every choice of --target is listed; every positional argument has
help; "not an ONNX model" is said once; export-adapter's errors name export-adapter."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import __version__, save_model
from onnx_autodiff.cli import build_parser, main
from onnx_autodiff.runtimes.targets import TARGETS
from onnx_autodiff.training import make_training_model
from onnx_autodiff.training.losses import LOSSES


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"onnx-autodiff {__version__}"


def test_every_positional_argument_has_help():
    missing = [f"{name} {a.dest}" for name, sub in _subparsers(build_parser()).items() for a in sub._actions
               if not a.option_strings and not a.help]
    assert not missing, missing


def test_loss_help_names_every_loss_and_its_aliases():
    text = _subparsers(build_parser())["make-training"].format_help()
    flat = " ".join(text.split())
    for name, loss in LOSSES.items():
        assert name in flat
        for alias in loss.aliases:
            assert alias in flat
    assert "causal_lm" in flat and "Any other name is refused" in flat


def test_targets_are_listed_in_export_step_and_check_help():
    for command in ("export-step", "check"):
        flat = " ".join(_subparsers(build_parser())[command].format_help().split())
        for name in TARGETS:
            assert name in flat, (command, name)


def _mlp(tmp_path):
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
    path = tmp_path / "mlp.onnx"
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def test_a_loss_alias_is_accepted_and_said_and_a_typo_is_refused(tmp_path, capsys):
    path = _mlp(tmp_path)
    assert main(["make-training", str(path), str(tmp_path / "t.onnx"), "--loss", "crossentropy"]) == 0
    assert "--loss crossentropy: an alias of cross_entropy" in capsys.readouterr().out
    assert main(["make-training", str(path), str(tmp_path / "t2.onnx"), "--loss", "cross_entopy"]) == 2
    err = capsys.readouterr().err
    assert "unknown loss 'cross_entopy' (did you mean 'cross_entropy'?)" in err
    assert not (tmp_path / "t2.onnx").exists()


def test_not_an_onnx_model_is_said_once(tmp_path, capsys):
    bad = tmp_path / "x.onnx"
    bad.write_bytes(b"not a model")
    assert main(["lower", str(bad), str(tmp_path / "y.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("is not an ONNX model") == 1, err


def test_export_adapter_prefix_error_names_export_adapter(tmp_path, capsys):
    path = _mlp(tmp_path)
    tm = make_training_model(str(path), "mse", "sgd", lora={"rank": 2, "targets": ["W"]})
    save_model(tm, tmp_path / "t.onnx")
    assert main(["export-adapter", str(tmp_path / "t.onnx"), str(tmp_path / "out"), "--prefix", "nothing."]) == 2
    err = capsys.readouterr().err
    assert "export_adapter(prefix='nothing.')" in err and "hint: " in err, err
    assert "make_training_model" not in err and "make-training --help" not in err, err


# ---- issue 35's newcomer list -------------------------------------------------------------------

@pytest.mark.parametrize("command", [["jvp", "--wrt", "W"], ["hvp", "--wrt", "W", "--of", "s"],
                                     ["jacobian", "--of", "y", "--wrt", "W"]])
def test_forward_commands_refuse_to_overwrite_their_input(tmp_path, capsys, command):
    path = _mlp(tmp_path)
    before = path.read_bytes()
    assert main([command[0], str(path), str(path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"onnx-autodiff {command[0]}: error: output ") and \
        "is the file being read" in err[0], err
    assert path.read_bytes() == before


def test_forward_commands_take_the_path_through_the_door(tmp_path, capsys):
    import subprocess
    out = subprocess.run(["git", "grep", "-n", "load_onnx", "--", "onnx_autodiff/cli/forward.py"],
                         capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.stdout == "", out.stdout
    path = _mlp(tmp_path)
    assert main(["jvp", str(path), str(tmp_path / "j.onnx"), "--wrt", "W"]) == 0
    assert "outputs y, y.tangent" in capsys.readouterr().out


def _report(*checks):
    from onnx_autodiff.check.gradcheck import GradcheckReport, TensorCheck

    return GradcheckReport(["y"], [TensorCheck(*c) for c in checks])


def test_gradcheck_report_ends_with_one_overall_line():
    ok = str(_report(("a", 2.0, 2.0 + 1e-9, 1e-9, 5e-10, True), ("b", 1.0, 1.0 + 1e-8, 1e-8, 1e-8, True)))
    assert ok.splitlines()[-1] == "ok: 2 tensor(s) agree with finite differences; worst 'b': rel err 1.00e-08"
    bad = str(_report(("a", 2.0, 2.0, 0.0, 0.0, True), ("b", 1.0, 3.0, 2.0, 2 / 3, False)))
    assert bad.splitlines()[-1] == ("not ok: 1 of 2 tensor(s) disagree with finite differences; worst 'b': "
                                    "analytic 1, numeric 3, rel err 6.67e-01")
    assert sum(line.startswith(("ok:", "not ok:")) for line in bad.splitlines()) == 1


def test_gradcheck_report_says_both_zero_instead_of_a_relative_error():
    text = str(_report(("w", 0.0, 1e-18, 1e-18, 1.0, True), ("v", 0.0, 0.0, 0.0, 0.0, True)))
    assert "1.00e+00" not in text and text.count("gradient zero, finite differences zero") == 3, text
    # a zero against a real value is no "both zero"
    assert "gradient zero" not in str(_report(("w", 0.0, 5.0, 5.0, 1.0, False)))


def test_gradcheck_of_a_dead_relu_says_gradient_zero(tmp_path):
    from onnx_autodiff import gradcheck

    b = numpy_helper.from_array(np.full((4,), -100, np.float32), "B")
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    graph = helper.make_graph([helper.make_node("Add", ["x", "B"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                               helper.make_node("MatMul", ["r", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w, b])
    text = str(gradcheck(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)))
    assert text.splitlines()[-1] == "ok: 3 tensor(s), each gradient zero, finite differences zero", text


def _every_option():
    parsers = {"onnx-autodiff": build_parser(), **_subparsers(build_parser())}
    for name, parser in parsers.items():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                yield name, parser, action


def test_every_option_has_help_and_shows_its_default():
    missing, hidden = [], []
    for name, parser, action in _every_option():
        if not (action.help or "").strip():
            missing.append(f"{name} {action.option_strings[0]}")
        # a flag (store_true/store_false) is off unless given: only options taking a value have a default to show
        if action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            shown = " ".join(parser._get_formatter()._expand_help(action).split())
            default = " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
            if f"default: {default}" not in shown:
                hidden.append(f"{name} {action.option_strings[0]}: {shown!r}")
    assert not missing, missing
    assert not hidden, hidden


def test_every_quiet_says_one_thing():
    quiet = {name: action.help for name, _, action in _every_option() if action.dest == "quiet"}
    assert set(quiet) == {"train", "conformance", "demo"}, quiet  # a new --quiet gets a case below
    assert len(set(quiet.values())) == 1 and "nothing on stderr but errors" in next(iter(quiet.values()))


def test_quiet_train_writes_nothing_on_stderr(tmp_path, capsys):
    path = _mlp(tmp_path)
    assert main(["make-training", str(path), str(tmp_path / "t.onnx"), "--loss", "mse"]) == 0
    np.savez(tmp_path / "d.npz", X=np.ones((8, 4), np.float32), y=np.zeros((8, 3), np.float32))
    capsys.readouterr()
    for runtime in ("onnxruntime", "reference"):
        assert main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs", "1",
                     "--batch-size", "4", "--checkpoint", str(tmp_path / f"ck-{runtime}"), "--quiet",
                     "--runtime", runtime]) == 0
        out, err = capsys.readouterr()
        assert err == "", (runtime, err)
        assert "epoch 1/1" in out, (runtime, out)  # the results still print
        assert main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs", "1",
                     "--batch-size", "4", "--checkpoint", str(tmp_path / f"ck2-{runtime}"),
                     "--runtime", runtime]) == 0
        assert "epoch 1/1" in capsys.readouterr().err, runtime  # and without --quiet the progress is on stderr


def test_quiet_conformance_writes_nothing_on_stderr(capsys):
    assert main(["conformance", "--runtime", "reference", "--graphs", "0", "--ops", "Relu", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "Relu" in out, err


@pytest.mark.slow
def test_cli_doc_shows_what_the_demo_prints(tmp_path, monkeypatch, capsys):
    """docs/cli.md's demo block is what ``onnx-autodiff demo --quiet`` prints with seed 0, but the seconds (~10 s)."""
    import re

    pytest.importorskip("matplotlib")  # without it the last line says how to get the plot instead
    doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    block = re.search(r"What `onnx-autodiff demo` prints.*?```text\n(.*?)```", doc, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # --quiet: nothing on stderr but errors

    def masked(text):
        return [re.sub(r"in \d+\.\d s$", "in S s", line) for line in text.strip().splitlines()]

    assert masked(out) == masked(block)


def test_the_torch_extra_brings_what_the_dynamo_exporter_imports():
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {req.split(">")[0].split("=")[0].strip(): req for req in extras["torch"]}
    assert {"torch", "onnxscript"} <= set(names), extras["torch"]
    pinned = {req for reqs in extras.values() for req in reqs if req.startswith("torch==")}
    assert pinned == {"torch==2.13.0"}, pinned  # where torch is pinned, it is the one version the tests run
    assert "onnxscript" in " ".join(extras["test"])


def _lora_training_model(tmp_path, dropout):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in
             (("W1", (4, 8)), ("W2", (8, 3)))]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
                               helper.make_node("Relu", ["h"], ["r"]),
                               helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
               tmp_path / "base.onnx")
    tm = make_training_model(str(tmp_path / "base.onnx"), "mse", "sgd",
                             lora={"rank": 2, "targets": ["W1", "W2"], "dropout": dropout})
    save_model(tm, tmp_path / "lora.onnx")
    return tmp_path / "lora.onnx"


def test_adapters_as_inputs_load_with_only_the_warnings_the_design_needs(tmp_path, capfd):
    import onnxruntime as ort

    path = _lora_training_model(tmp_path, 0.05)
    assert main(["export", str(path), str(tmp_path / "serve.onnx"), "--adapters", "inputs"]) == 0
    capfd.readouterr()
    options = ort.SessionOptions()
    options.log_severity_level = 2  # warnings and above: what a user sees by default
    sess = ort.InferenceSession(str(tmp_path / "serve.onnx"), options, providers=["CPUExecutionProvider"])
    log = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    adapters = {f"{w}.lora_{k}" for w in ("W1", "W2") for k in "AB"}
    needed = [line for line in log if re.search(r"Initializer (\S+) appears in graph inputs", line)
              and re.search(r"Initializer (\S+) appears", line).group(1) in adapters]
    assert len(needed) == len(adapters) and len(log) == len(needed), log  # docs/llm.md names these
    assert adapters <= {i.name for i in sess.get_overridable_initializers()}
    base = ort.InferenceSession(str(tmp_path / "base.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], base.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("target", ["openvino", "portable"])
def test_check_target_of_a_lora_dropout_says_one_thing_and_names_the_flag(tmp_path, capsys, target):
    path = _lora_training_model(tmp_path, 0.05)
    assert main(["check", str(path), "--target", target]) == 1
    out = capsys.readouterr().out
    assert "lowered to standard ops" not in out, out  # the lacks line and the verdict agree
    assert f"{target} lacks Dropout" in out and "MISSING: no standard form for a training-mode Dropout (ratio 0.05)" \
        in out, out
    assert "--lora-dropout 0" in out and "0.0500000" not in out, out
    assert out.strip().splitlines()[-1].startswith("not ok"), out


def test_float32_values_print_as_written():
    from onnx_autodiff.passes.standard_forms import float32_text

    for text in ("0.05", "0.1", "0.3", "0.00000001", "2", "-0.75"):
        assert float32_text(float(np.float32(float(text)))) == text


@pytest.mark.slow
def test_llm_builder_section_runs_without_a_clone(tmp_path):
    """docs/llm.md's section 6, as a user runs it: from a scratch folder, with the package importable and the
    repository's tests/ not (about 30-60 s: the builder, 4 epochs of a tiny int4 Llama, genai's generation)."""
    import subprocess
    import sys

    pytest.importorskip("onnxruntime_genai")
    root = Path(__file__).parents[2]
    text = (root / "docs" / "llm.md").read_text()
    section = text[text.index("## 6."):text.index("### Other families")]
    code = "\n\n".join(re.findall(r"^```python\n(.*?)^```", section, re.S | re.M))
    assert "from onnx_autodiff.testing.genai_models import build" in code and "tests" not in code
    site, work = tmp_path / "site", tmp_path / "work"
    site.mkdir()
    work.mkdir()
    for package in ("onnx_autodiff", "gradient_rules"):  # what the wheel installs
        (site / package).symlink_to(root / package)
    (work / "section6.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    check = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('tests'))"],
                           cwd=work, env=env, capture_output=True, text=True)
    assert check.stdout.strip() == "None", check.stdout  # the repository's tests/ is out of reach
    run = subprocess.run([sys.executable, "section6.py"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (work / "llama-int4" / "genai_config.json").exists() and (work / "llama-int4-lora").is_dir()


def test_quiet_demo_writes_nothing_on_stderr(tmp_path, capsys):
    assert main(["demo", "--epochs", "1", "--quiet", "--out", str(tmp_path / "demo")]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "epoch  1/1" in out, err


def test_export_step_of_a_lora_dropout_names_the_flag(tmp_path, capsys):
    path = _lora_training_model(tmp_path, 0.05)
    assert main(["export-step", str(path), str(tmp_path / "bundle"), "--target", "openvino"]) == 2
    err = capsys.readouterr().err
    assert "(ratio 0.05)" in err and "--lora-dropout 0" in err, err

"""What a newcomer met on the command line (issue 29), each fixed: --version; --loss names its choices and aliases
and refuses other spellings with a suggestion; every choice of --target is listed; every positional argument has
help; "not an ONNX model" is said once; export-adapter's errors name export-adapter."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import __version__, save_model
from onnx_autodiff.cli import build_parser, main
from onnx_autodiff.passes.targets import TARGETS
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

"""onnx-autodiff jvp / hvp / jacobian: files in, files out, one-line errors of ours."""
from __future__ import annotations

import numpy as np
import onnx

from onnx_autodiff.cli import main
from tests.forward.test_api import X, mlp
from tests.torch_export import session


def test_the_three_commands_write_models_that_run(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(mlp(), src)
    assert main(["jvp", str(src), str(tmp_path / "jvp.onnx"), "--wrt", "x", "W"]) == 0
    assert main(["hvp", str(src), str(tmp_path / "hvp.onnx"), "--wrt", "W", "--of", "s"]) == 0
    assert main(["jacobian", str(src), str(tmp_path / "jac.onnx"), "--of", "y", "--wrt", "x"]) == 0
    printed = capsys.readouterr().out
    assert "outputs y, s, y.tangent, s.tangent" in printed and "outputs s, W.grad, W.hvp" in printed
    jvp = onnx.load(tmp_path / "jvp.onnx")
    out = session(jvp).run(["y.tangent"], {"x": X, "x.tangent": np.ones_like(X), "W.tangent": np.zeros((3, 4))})[0]
    assert out.shape == (2, 4)
    jac = session(onnx.load(tmp_path / "jac.onnx")).run(["dy/dx"], {"x": X})[0]
    assert jac.shape == (2, 4, 2, 3)


def test_errors_are_one_line(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(mlp(), src)
    assert main(["hvp", str(src), str(tmp_path / "o.onnx"), "--wrt", "W"]) == 2
    assert main(["jvp", str(src), str(tmp_path / "o.onnx"), "--wrt", "nope"]) == 2
    assert main(["jacobian", str(tmp_path / "missing.onnx"), str(tmp_path / "o.onnx"), "--of", "y", "--wrt", "x"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all("error:" in line and "hint:" in line for line in lines), lines
    assert "name the scalar one" in lines[0] and "'nope'" in lines[1] and "does not exist" in lines[2]
    assert not (tmp_path / "o.onnx").exists()

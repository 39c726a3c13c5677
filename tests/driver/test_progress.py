"""The one progress helper: a tqdm bar in a terminal, plain lines (no carriage returns) in a log."""
from __future__ import annotations

import io

from onnx_autodiff.driver.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_in_a_log():
    log = io.StringIO()
    with Progress(3, "epoch 1/2", stream=log, interval=0.0) as bar:
        for loss in (1.10886, 1.1088, 0.5):
            bar.update(loss=loss)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[:3] == ["epoch 1/2: 1/3 steps, step loss 1.109", "epoch 1/2: 2/3 steps, step loss 1.109",
                         "epoch 1/2: 3/3 steps, step loss 0.5"]


def test_a_terminal_gets_a_tqdm_bar_that_leaves_no_stale_digits():
    tty = Terminal()
    bar = Progress(2, "epoch 1/1", stream=tty, interval=0.0)
    assert type(bar._bar).__name__ == "tqdm"
    bar.update(loss=1.10886)
    bar.update(loss=1.1)
    frames = tty.getvalue().split("\r")[1:]
    bar.close()
    longer = next(f for f in frames if "loss 1.109" in f)
    shorter = next(f for f in frames if "loss 1.1" in f and "loss 1.109" not in f)
    # the shorter redraw is padded over the longer one: no digit of "1.109" survives after "1.1"
    assert len(shorter) >= len(longer.rstrip()) and shorter[shorter.index("loss 1.1") + 8:].strip() == "]"


def test_disabled_writes_nothing():
    log = io.StringIO()
    with Progress(2, "x", stream=log, enabled=False) as bar:
        bar.update(loss=1.0)
    assert log.getvalue() == ""


def test_the_demo_plot_has_titled_axes_ticks_and_a_legend(tmp_path):
    from onnx_autodiff.cli.demo import loss_figure, plot_losses

    fig = loss_figure([2.0, 1.5, 1.0, 0.8, 0.5, 0.4], [1.5, 0.57])
    ax = fig.axes[0]
    assert ax.get_xlabel() == "training step" and ax.get_ylabel() == "cross-entropy loss" and ax.get_title()
    assert len(ax.get_xticks()) >= 3 and len(ax.get_yticks()) >= 3
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss per step", "mean loss per epoch"]
    png = tmp_path / "curve.png"
    assert plot_losses([2.0, 1.0], [1.5], str(png)) == str(png) and png.read_bytes()[:4] == b"\x89PNG"


def test_the_demo_plot_without_matplotlib_writes_nothing(tmp_path, monkeypatch):
    import sys

    from onnx_autodiff.cli.demo import plot_losses

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_losses([2.0, 1.0], [1.5], str(tmp_path / "c.png")) is None
    assert not (tmp_path / "c.png").exists()


def test_stage_is_silent_when_quick_and_says_what_and_how_long_when_slow():
    import io
    import time

    from onnx_autodiff.driver.progress import stage

    quick = io.StringIO()
    with stage("lowering m.onnx", stream=quick, after=0.5):
        pass
    assert quick.getvalue() == ""
    slow = io.StringIO()
    with stage("lowering big.onnx", stream=slow, after=0.05):
        time.sleep(0.2)
    lines = slow.getvalue().splitlines()
    assert lines[0] == "lowering big.onnx ..." and lines[1].startswith("lowering big.onnx: done in ")

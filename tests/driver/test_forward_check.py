"""The first step's forward against a plain onnxruntime run of the same graph (driver/forward_check.py): a
step that does not compute what the model computes stops with ForwardMismatchError before it changes
anything; random ops are left out of the comparison, so a training-mode Dropout raises no false alarm. The
case that made it (an int4 model trained from its file against a base of zeros) is planted in
tests/integration/test_genai_builder.py."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession, make_training_model
from onnx_autodiff.driver.forward_check import ForwardCheck, compared_outputs, foreign_readers, is_random
from onnx_autodiff.errors import DataError, ForwardMismatchError

F = TensorProto.FLOAT


def linear(dropout: float | None = None) -> onnx.ModelProto:
    """y = x @ W (+ a Dropout of x in training mode), x [4, 3], W [3, 2]."""
    nodes, x = [], "x"
    inits = [numpy_helper.from_array(np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32), "W")]
    if dropout is not None:
        inits += [numpy_helper.from_array(np.array(dropout, np.float32), "ratio"),
                  numpy_helper.from_array(np.array(True), "train")]
        nodes.append(helper.make_node("Dropout", ["x", "ratio", "train"], ["xd"], name="drop"))
        x = "xd"
    nodes.append(helper.make_node("MatMul", [x, "W"], ["y"], name="mm"))
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", F, [4, 3])],
                              [helper.make_tensor_value_info("y", F, [4, 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(4, 3)).astype(np.float32), "labels": rng.normal(size=(4, 2)).astype(np.float32)}


def test_random_ops():
    g = linear(0.5).graph
    drop = g.node[0]
    assert is_random(drop, g)
    for ratio, train in ((0.0, True), (0.5, False)):
        g2 = linear(ratio).graph
        g2.initializer[2].CopyFrom(numpy_helper.from_array(np.array(train), "train"))
        assert not is_random(g2.node[0], g2)
    assert not is_random(helper.make_node("Dropout", ["x"], ["y"]), g)  # inference mode
    assert is_random(helper.make_node("Dropout", ["x", "ratio", "fed"], ["y"]), g)  # a mode fed at run time
    assert is_random(helper.make_node("RandomNormalLike", ["x"], ["y"]), g)


def test_a_step_that_computes_something_else_stops(monkeypatch):
    """A weight changed between the reference run and the step's: the step's y is not the model's."""
    sess = TrainingSession(make_training_model(linear(), "mse", "sgd", lr=0.1), check_forward=True)
    before = sess.get_state("W")
    run = ForwardCheck.run

    def run_then_tamper(self, *args):
        out = run(self, *args)
        sess.get_ortvalue("W").numpy()[...] = 0.0  # the buffer the step reads
        return out

    monkeypatch.setattr(ForwardCheck, "run", run_then_tamper)
    with pytest.raises(ForwardMismatchError, match=r"'y' differs from a plain onnxruntime run .* by up to") as e:
        sess.step(feeds())
    assert e.value.output == "y" and e.value.step == 1 and e.value.exit_code == 1
    assert sess.steps == 0 and "check_forward=False" in e.value.hint
    sess.set_state("W", before)
    sess.step(feeds())  # the check ran once: later steps are not compared
    assert sess.steps == 1


def test_the_check_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(ForwardCheck, "run", lambda *a: pytest.fail("the reference ran"))
    TrainingSession(make_training_model(linear(), "mse", "sgd", lr=0.1), check_forward=False).step(feeds())


def test_outputs_of_a_training_mode_dropout_are_not_compared():
    model = make_training_model(linear(0.5), "mse", "sgd", lr=0.1)
    sess = TrainingSession(model)
    names, skipped = compared_outputs(sess.step_model, ["y", sess.loss_name])
    assert names == [] and skipped == ["y", sess.loss_name]
    losses = [float(sess.step(feeds(k))["loss"]) for k in range(3)]
    assert all(np.isfinite(losses))


def test_lora_dropout_steps_without_a_false_alarm():
    model = make_training_model(linear(), "mse", "adam", lr=0.1, lora={"rank": 2, "dropout": 0.3, "targets": ["mm"]})
    sess = TrainingSession(model)
    for k in range(3):
        sess.step(feeds(k))
    assert sess.steps == 3



def test_a_frozen_weight_mapped_from_its_file_is_read_there(tmp_path, monkeypatch):
    """A frozen weight that is a memory map of a file reaches the reference session as a reference into that
    file (onnxruntime maps it: no copy of a 2 GB embedding; tests/integration/test_large_model.py), and the
    reference computes with the file's bytes: the model's own y, and a mismatch where the file holds others."""
    import onnx_autodiff.driver.forward_check as fc

    model = linear()
    model.graph.node[0].output[0] = "xw"
    model.graph.node.append(helper.make_node("Add", ["xw", "b"], ["y"], name="add"))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(2, np.float32), "b"))
    W = numpy_helper.to_array(model.graph.initializer[0])
    onnx.save(make_training_model(model, "mse", "sgd", lr=0.1, trainable=["b"]), tmp_path / "train.onnx",
              save_as_external_data=True, location="train.data", size_threshold=0)
    batch = feeds()

    references, outputs, set_reference, run = [], [], fc.set_reference, ForwardCheck.run
    monkeypatch.setattr(fc, "set_reference", lambda t, *ref: (references.append((t.name, *ref)),
                                                              set_reference(t, *ref)))
    monkeypatch.setattr(ForwardCheck, "run", lambda *args: outputs.append(run(*args)) or outputs[-1])
    TrainingSession(str(tmp_path / "train.onnx"), check_forward=True).step(batch)
    assert [r[:2] for r in references] == [("W", "train.data")]  # mapped from its file, in the folder set
    np.testing.assert_allclose(outputs[0]["y"], batch["x"] @ W, rtol=1e-6, atol=1e-6)

    other = tmp_path / "other.bin"
    (2 * W).tofile(other)

    def from_other(self, feeds_, value, state):
        return run(self, feeds_, lambda n: np.memmap(other, np.float32, "r", shape=W.shape) if n == "W"
                   else value(n), state)

    monkeypatch.setattr(ForwardCheck, "run", from_other)
    with pytest.raises(ForwardMismatchError, match="'y' differs"):
        TrainingSession(str(tmp_path / "train.onnx"), check_forward=True).step(batch)


def normed() -> onnx.ModelProto:
    """linear() then onnxruntime's contrib SkipSimplifiedLayerNormalization of y + s with a trained scale g."""
    model = linear()
    g = model.graph
    g.node[0].output[0] = "h"
    g.node.append(helper.make_node("SkipSimplifiedLayerNormalization", ["h", "s", "g"], ["y"], name="norm",
                                   domain="com.microsoft", epsilon=1e-5))
    g.initializer.extend([numpy_helper.from_array(np.full((4, 2), 0.5, np.float32), "s"),
                          numpy_helper.from_array(np.array([1.5, 0.5], np.float32), "g")])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_auto_makes_no_reference_for_standard_ops_but_checks_the_first_batch(monkeypatch):
    """A model of standard ops only: "auto" (the default) builds no reference session; a NaN in the first batch
    is still the data's error, as the reference's run says it."""
    monkeypatch.setattr(ForwardCheck, "__init__", lambda *a: pytest.fail("a reference was built"))
    sess = TrainingSession(make_training_model(linear(), "mse", "sgd", lr=0.1))
    bad = feeds()
    bad["x"][2, 1] = np.nan
    with pytest.raises(DataError, match=r"the feed 'x' holds 1 NaN value\(s\), the first in sample 2"):
        sess.step(bad)
    assert sess.steps == 0
    sess.step(feeds())
    assert sess.steps == 1


def test_auto_checks_where_a_contrib_node_reads_a_fed_weight(monkeypatch):
    """SkipSimplifiedLayerNormalization (com.microsoft) reads the trained g, which the step feeds at run time:
    "auto" builds the reference, and a tampered g stops the step. Fed tensors no contrib node reads do not count."""
    runs = []
    run = ForwardCheck.run
    monkeypatch.setattr(ForwardCheck, "run", lambda self, *a: runs.append(self.names) or run(self, *a))
    TrainingSession(make_training_model(normed(), "mse", "sgd", lr=0.1)).step(feeds())
    assert len(runs) == 1
    sess = TrainingSession(make_training_model(normed(), "mse", "sgd", lr=0.1))

    def run_then_tamper(self, *args):
        out = run(self, *args)
        sess.get_ortvalue("g").numpy()[...] = 0.0
        return out

    monkeypatch.setattr(ForwardCheck, "run", run_then_tamper)
    with pytest.raises(ForwardMismatchError, match="'y' differs"):
        sess.step(feeds())
    step_model = sess.step_model
    names = compared_outputs(step_model, ["y"])[0]
    assert foreign_readers(step_model, names, {"g", "W"}) == ["com.microsoft.SkipSimplifiedLayerNormalization 'norm'"]
    assert foreign_readers(step_model, names, {"W", "x"}) == []  # read by standard nodes only


def test_check_forward_takes_true_false_or_auto():
    with pytest.raises(ValueError, match="check_forward='yes': give True, False or 'auto'"):
        TrainingSession(make_training_model(linear(), "mse", "sgd", lr=0.1), check_forward="yes")

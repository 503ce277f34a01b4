"""The step report (issue 39): a known delay lands in the right phase, FLOPs match the closed form, every zoo model.

The 2-worker cases (a straggler's delay is its peer's exchange; the merged
timeline; a timed-out collective naming the late worker) are in
tests/test_timeline.py, which runs one job for all of them.
"""

from __future__ import annotations

import json
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import DEVICES
from tests.models.zoo import ZOO
from tfdist.callbacks import StepReport
from tfdist.report import trace

# Long enough that a step of the small MLP, even on a loaded 2-core host (the suite's other
# process, 2 replicas), stays far shorter: the pipeline is the bottleneck.
SLEEP_S = 0.1


def dense_stack(widths):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((widths[0],))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths[1:-1]] + [keras.layers.Dense(widths[-1])]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build(strategy_name, widths):
    if strategy_name is None:
        return dense_stack(widths)
    strategy = tfdist.get_strategy(strategy_name, devices=DEVICES[2])
    with strategy.scope():
        return dense_stack(widths)


def batches(batch, width=64, sleep=0.0):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 8, width)).astype("float32")
    y = rng.integers(0, 10, batch * 8).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    if sleep:
        def slow(features, labels):
            def wait(t):
                time.sleep(sleep)
                return t

            features = tf.py_function(wait, [features], tf.float32)
            features.set_shape([batch, width])
            return features, labels

        dataset = dataset.map(slow)
    return dataset.repeat()


def assert_phases_sum_to_the_median_step(result):
    assert set(result["phases_s"]) == {"input", "compute", "exchange", "update", "other"}
    assert sum(result["phases_s"].values()) == pytest.approx(result["step_s"]["median"], rel=0.1)


@pytest.mark.parametrize("strategy_name", [None, "mirrored"])
def test_a_sleep_in_the_input_pipeline_is_reported_as_input(strategy_name):
    model = build(strategy_name, [64, 128, 10])
    report = StepReport(verbose=0)
    model.fit(batches(32, sleep=SLEEP_S), epochs=1, steps_per_epoch=14, verbose=0, callbacks=[report])
    result = report.result
    assert_phases_sum_to_the_median_step(result)
    phases = result["phases_s"]
    # The pipeline cannot run ahead of a step waiting 100 ms for each batch: the wait is the step's.
    assert phases["input"] == pytest.approx(SLEEP_S, abs=0.02)
    assert phases["input"] > 0.7 * result["step_s"]["median"]
    assert phases["input"] > 5 * (phases["compute"] + phases["exchange"] + phases["update"])
    assert result["replicas"] == (1 if strategy_name is None else 2)
    assert result["samples_per_step"] == 32
    # Throughput over the measured steps: no faster than the pipeline's rate with the batches its
    # buffers (prefetch, transfer) filled while earlier steps ran, no slower than the p90 step.
    assert 32 / result["step_s"]["p90"] / 1.15 <= result["samples_per_s"] <= 2 * 32 / SLEEP_S


@pytest.mark.parametrize("strategy_name", [None, "mirrored"])
def test_dense_stack_flops_per_step_match_the_closed_form(strategy_name):
    widths, batch = [64, 256, 256, 10], 32
    model = build(strategy_name, widths)
    report = StepReport(verbose=0, profile_steps=2)
    model.fit(batches(batch), epochs=1, steps_per_epoch=6, verbose=0, callbacks=[report])
    # Forward 2·B·in·out per layer; backward twice that, less the first layer's input gradient.
    pairs = list(zip(widths, widths[1:]))
    closed_form = 6 * batch * sum(a * b for a, b in pairs) - 2 * batch * widths[0] * widths[1]
    assert report.result["flops_per_step"] == pytest.approx(closed_form, rel=0.05)
    assert report.result["mfu"] == pytest.approx(
        report.result["flops_per_step"] / report.result["step_s"]["median"]
        / (report.result["peak_flops_per_s"] * report.result["replicas"]), rel=1e-6)
    assert report.result["peak"].startswith("measured: float32 512x512 matmul on /device:CPU:0")
    assert report.result["peak_memory_bytes"] == {d: None for d in report.result["devices"]}  # CPUs: not reported


def test_every_zoo_model_gets_a_report_under_mirrored():
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[2])
    failures = []
    for name, entry in ZOO.items():
        x, y = entry.data(entry.batch_size * 8)
        with strategy.scope():
            model = entry.make(seed=0)
        report = StepReport(verbose=0, warmup_steps=1, profile_steps=2)
        model.fit(x, y, batch_size=entry.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=[report])
        result = report.result
        try:
            assert_phases_sum_to_the_median_step(result)
            assert result["replicas"] == 2
            assert result["phases_s"]["compute"] > 0
            assert result["phases_s"]["exchange"] > 0  # two replicas sum their gradients
            if result["samples_per_step"] is not None:  # a custom train_step may not count its loss
                assert result["samples_per_step"] == entry.batch_size
                assert result["flops_per_step"] > 0
        except (AssertionError, TypeError) as e:
            failures.append(f"{name}: {e}; flops: {result['flops_method']}")
    assert failures == []


def test_every_n_steps_reports_each_period_and_path_gets_the_json(tmp_path):
    model = build(None, [64, 32, 10])
    path = tmp_path / "report.json"
    report = StepReport(every=8, path=str(path), verbose=0, profile_steps=2)
    model.fit(batches(16), epochs=1, steps_per_epoch=24, verbose=0, callbacks=[report])
    assert [p["steps_timed"] for p in report.result["periods"]] == [3, 5, 5]  # less warm-up and profiled calls
    with open(path) as f:
        assert json.load(f)["step_s"] == report.result["step_s"]
    assert report.result["steps_timed"] == 24 - 2 - 3 * 3


def test_report_prints_a_table(capsys):
    model = build(None, [64, 32, 10])
    model.fit(batches(16), epochs=1, steps_per_epoch=10, verbose=0, callbacks=[StepReport(profile_steps=2)])
    out = capsys.readouterr().out
    assert "Step report — this process: none (plain Keras), 1 replica(s) (1 here)" in out
    for phase in ("input", "compute", "exchange", "update", "other"):
        assert f"    {phase:<12}" in out


def test_breakdown_is_one_fit_with_a_report():
    model = build(None, [64, 32, 10])
    before = int(model.optimizer.iterations.numpy())
    result = tfdist.report.breakdown(model, batches(16), steps=12)
    assert int(model.optimizer.iterations.numpy()) - before == 12
    assert result["steps_timed"] == 12 - 2 - 6  # warm-up, then 5 profiled calls and the one that closes them
    assert_phases_sum_to_the_median_step(result)


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "Argument 'every' must be None or an integer >= 1 (steps). Received: every=0"),
    ({"batch_size": -1}, "Argument 'batch_size' must be None or an integer >= 1. Received: batch_size=-1"),
    ({"profile_steps": 1.5}, "Argument 'profile_steps' must be an integer >= 0. Received: profile_steps=1.5"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError) as e:
        StepReport(**kwargs)
    assert str(e.value) == message


def test_split_gives_each_instant_to_one_phase_in_priority_order():
    events = [trace.Interval(0, 40, "input", "IteratorGetNextOp::DoCompute"),
              trace.Interval(30, 60, "compute", "MatMul"),
              trace.Interval(50, 90, "exchange", "CollectiveReduceV2"),
              trace.Interval(95, 98, "update", "AssignSubVariableOp")]
    (window,) = trace.split(events, [(10, 100)])
    assert window["phases"] == {"input": 20, "compute": 30, "exchange": 30, "update": 3, "other": 7}
    assert window["runs"] == [(10, 30, "input"), (30, 60, "compute"), (60, 90, "exchange"), (90, 95, "other"),
                              (95, 98, "update"), (98, 100, "other")]


def test_op_events_are_classified_by_type_and_the_optimizers_scope():
    assert trace.classify("cond/sgd/update_0/AssignSubVariableOp:AssignSubVariableOp", "AssignSubVariableOp",
                          ["sgd"]) == "update"
    assert trace.classify("cond/sgd_1/Mul:Mul", "Mul", ["sgd"]) == "update"
    assert trace.classify("cond/sgdx/Mul:Mul", "Mul", ["sgd"]) == "compute"
    assert trace.classify("cond/CollectiveReduceV2:CollectiveReduceV2", "CollectiveReduceV2") == "exchange"
    assert trace.classify("IteratorGetNextAsOptionalOp::DoCompute", "") == "input"
    assert trace.classify("ExecutorState::Process", "") is None

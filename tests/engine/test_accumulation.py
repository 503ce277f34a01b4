"""Gradient accumulation: the `accumulation_steps` option and Keras's `gradient_accumulation_steps`."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.engine.common import branch_graphs, make_strategy, max_relative_difference, op_counts, tiny_model
from tfdist.engine.step import TrainStep


@pytest.mark.parametrize("name,collective,per_step", [
    ("mirrored", "CollectiveReduceV2", 4),
    ("central_storage", "AddN", 1),
])
def test_no_collective_on_the_accumulation_micro_steps(name, collective, per_step, digits):
    x, y = digits
    strategy = make_strategy(name, accumulation_steps=4, bucket_bytes=1024)
    with strategy.scope():
        model = tiny_model()
        model.optimizer.build(model.trainable_variables)
    step = TrainStep(model)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:8], y[:8])).batch(8))))
    graph = tf.function(step).get_concrete_function(batch).graph
    (communicate, accumulate), = branch_graphs(graph)
    # 2 buckets (see test_bucketing) on the last micro-step, nothing on the others.
    assert op_counts(communicate)[collective] == per_step * 2
    assert op_counts(accumulate)[collective] == 0
    # The engine's own trace-time count agrees (all_reduce counts per replica).
    assert step.accumulation.traced_collectives == {"accumulate": 0, "communicate": per_step * 2}


@pytest.mark.parametrize("how", ["option", "keras"])
def test_k_micro_batches_equal_one_adam_step_on_k_times_the_batch(how, digits):
    x, y = digits
    x, y = x[:64], y[:64]  # 8 micro-batches of 8 = 2 steps of 32

    reference = tiny_model(lambda: keras.optimizers.Adam(1e-2))
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)

    if how == "option":
        strategy = make_strategy("mirrored", accumulation_steps=4)
        optimizer_fn = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    else:
        strategy = make_strategy("mirrored")
        optimizer_fn = lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4)  # noqa: E731
    with strategy.scope():
        model = tiny_model(optimizer_fn)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    # Adam's bias correction counts optimizer steps, not micro-batches.
    assert int(np.asarray(model.optimizer.iterations)) == 2
    assert max_relative_difference(reference, model) < 1e-5


def test_keras_accumulation_matches_keras_on_one_device(digits):
    # Upstream, Adam(gradient_accumulation_steps=4) under a MirroredStrategy fails
    # with "RuntimeError: Exception encountered when calling Cond.call()".
    x, y = digits
    x, y = x[:64], y[:64]
    optimizer_fn = lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4)  # noqa: E731
    reference = tiny_model(optimizer_fn)
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    with make_strategy("central_storage").scope():
        model = tiny_model(optimizer_fn)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(np.asarray(model.optimizer._iterations)) == 8
    assert max_relative_difference(reference, model) < 1e-5


def test_accumulation_set_twice_raises():
    with make_strategy("mirrored", accumulation_steps=2).scope():
        with pytest.raises(NotImplementedError) as info:
            tiny_model(lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=4))
    assert str(info.value) == (
        "Gradient accumulation is set twice: Optimizer(gradient_accumulation_steps=4) and "
        "the strategy option accumulation_steps=2. Set one of them."
    )


@pytest.mark.parametrize("how", ["option", "keras"])
def test_saving_mid_window_warns_once_and_at_a_boundary_not(how, digits, tmp_path, monkeypatch):
    # The accumulators are not in any checkpoint: a run resumed from one
    # written mid-window loses that window's micro-batches (0.17-0.26 relative
    # from never stopping, measured with BackupAndRestore, .keras and
    # tf.train.Checkpoint).
    from tfdist import checkpointing

    monkeypatch.setattr(checkpointing, "_warned_open_window", False)
    x, y = digits
    if how == "option":
        strategy = make_strategy("mirrored", 2, accumulation_steps=2)
        optimizer_fn = lambda: keras.optimizers.SGD(0.05)  # noqa: E731
    else:
        strategy = make_strategy("mirrored", 2)
        optimizer_fn = lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2)  # noqa: E731
    with strategy.scope():
        model = tiny_model(optimizer_fn)
    model.fit(x[:64], y[:64], batch_size=16, shuffle=False, verbose=0)  # 4 micro-steps: a boundary
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Saving a checkpoint with a gradient-accumulation")
        model.save_weights(str(tmp_path / "boundary.weights.h5"))
    model.fit(x[:80], y[:80], batch_size=16, shuffle=False, verbose=0)  # 5 more: one pending
    with pytest.warns(UserWarning, match=r"window open \(1 of 2 micro-steps accumulated\)") as caught:
        model.save(str(tmp_path / "mid.keras"))
    assert "multiple of accumulation_steps=2" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Saving a checkpoint with a gradient-accumulation")  # once
        model.save_weights(str(tmp_path / "mid.weights.h5"))

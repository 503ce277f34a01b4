"""Gradient accumulation: the `accumulation_steps` option and Keras's `gradient_accumulation_steps`."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("name,options", [
    ("mirrored", {}),
    ("central_storage", {}),
    ("sharded_optimizer", {"stage": 2}),
    ("sharded_optimizer", {"stage": 3}),
])
def test_keras_accumulation_with_ema_matches_keras_on_one_device(name, options, digits):
    # Keras moves the average on every micro-step, the k - 1 that only
    # accumulate included; moved at updates only, the final (averaged) weights
    # were 0.20 relative from one device here (SGD, k = 2, momentum 0.5, 4 updates).
    x, y = digits
    x, y = x[:64], y[:64]
    optimizer_fn = lambda: keras.optimizers.SGD(  # noqa: E731
        0.5, use_ema=True, ema_momentum=0.5, gradient_accumulation_steps=2
    )
    reference = tiny_model(optimizer_fn)
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    with make_strategy(name, replicas=2, **options).scope():
        model = tiny_model(optimizer_fn)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert max_relative_difference(reference, model) < 1e-5


def test_keras_accumulation_with_ema_overwrite_is_refused():
    # Keras overwrites the weights on a window's micro-steps that only
    # accumulate, under its later micro-batches (0.09 relative from one
    # device when tfdist overwrote at the update only).
    with make_strategy("mirrored", replicas=2).scope():
        with pytest.raises(NotImplementedError) as info:
            tiny_model(lambda: keras.optimizers.SGD(
                0.1, use_ema=True, ema_overwrite_frequency=3, gradient_accumulation_steps=2
            ))
    assert str(info.value) == (
        "Optimizer(use_ema=True, ema_overwrite_frequency=3) with gradient_accumulation_steps=2 is not "
        "supported under a tfdist strategy: Keras overwrites the weights with their average on the "
        "micro-steps that only accumulate, so the window's later micro-batches run on the average. Use "
        "the strategy option accumulation_steps=2 instead (the average then moves once per update, as "
        "for a 2-times larger batch), or ema_overwrite_frequency=None."
    )


def test_accumulation_set_twice_raises():
    with make_strategy("mirrored", accumulation_steps=2).scope():
        with pytest.raises(NotImplementedError) as info:
            tiny_model(lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=4))
    assert str(info.value) == (
        "Gradient accumulation is set twice: Optimizer(gradient_accumulation_steps=4) and "
        "the strategy option accumulation_steps=2. Set one of them."
    )


def _accumulating(name, options, how, optimizer_fn=lambda **k: keras.optimizers.Adam(1e-2, **k)):
    """A tiny model accumulating 2 micro-batches under `name`: tfdist's option, or Keras's own."""
    if how == "option":
        strategy = make_strategy(name, 2, accumulation_steps=2, **options)
        make = lambda: optimizer_fn()  # noqa: E731
    else:
        strategy = make_strategy(name, 2, **options)
        make = lambda: optimizer_fn(gradient_accumulation_steps=2)  # noqa: E731
    with strategy.scope():
        return tiny_model(make)


class _StopAtSecondEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("stopped")


@pytest.fixture(scope="module")
def never_stopped(digits):
    """One device, Keras's accumulation, 2 epochs of 5 micro-batches: the second window spans them."""
    x, y = digits
    model = tiny_model(lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2))
    model.fit(x[:80], y[:80], batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name, options, how, saved_as", [
    ("mirrored", {}, "option", ".weights.h5"),
    ("mirrored", {}, "keras", "BackupAndRestore"),
    ("central_storage", {}, "option", ".keras"),
    ("sharded_optimizer", {}, "keras", "tf.train.Checkpoint"),
    ("sharded_optimizer", {"stage": 3}, "option", "BackupAndRestore"),
])
def test_a_run_resumed_mid_window_ends_as_one_that_never_stopped(name, options, how, saved_as, never_stopped,
                                                                  digits, tmp_path):
    # The first epoch ends with 1 of 2 micro-batches accumulated. The window
    # (the replicas' summed accumulators, their weight, tfdist's micro-step)
    # is saved with the optimizer; before, no checkpoint held it, and the
    # resumed run dropped that micro-batch: 0.17-0.26 from never stopping.
    x, y = digits
    x, y = x[:80], y[:80]
    first = _accumulating(name, options, how)
    if saved_as == "BackupAndRestore":
        backup = str(tmp_path / "backup")
        with pytest.raises(RuntimeError, match="stopped"):  # a failure after the epoch's backup
            first.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup), _StopAtSecondEpoch()])
        resumed = _accumulating(name, options, how)
        resumed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup)])
    else:
        first.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        path = str(tmp_path / f"first{saved_as}")
        if saved_as == ".keras":
            first.save(path)
            with make_strategy(name, 2, **({"accumulation_steps": 2} if how == "option" else {}), **options).scope():
                resumed = keras.models.load_model(path)
        else:
            resumed = _accumulating(name, options, how)
            if saved_as == ".weights.h5":
                first.save_weights(path)
                with resumed.distribute_strategy.scope():  # as in Keras: an unbuilt optimizer loads nothing
                    resumed.optimizer.build(resumed.trainable_variables)
                resumed.load_weights(path)
            else:
                path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(path)
                tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).read(path).assert_consumed()
        resumed.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert max_relative_difference(never_stopped, resumed) < 1e-5


def test_a_window_saved_from_other_trainable_variables_is_skipped_with_a_warning(digits, tmp_path):
    # Saved mid-window while training every layer, resumed with the first
    # frozen: the sums do not fit. Keras skips the optimizer's state (its
    # variable count differs) with its warning; the window is skipped too.
    x, y = digits
    first = _accumulating("mirrored", {}, "option")
    first.fit(x[:48], y[:48], batch_size=16, shuffle=False, verbose=0)  # 3 micro-steps: 1 pending
    first.save_weights(str(tmp_path / "first.weights.h5"))
    resumed = _accumulating("mirrored", {}, "option")
    resumed.layers[0].trainable = False
    with resumed.distribute_strategy.scope():
        resumed.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy")
    resumed.fit(x[:16], y[:16], batch_size=16, shuffle=False, verbose=0)  # builds the window: 1 pending
    with pytest.warns(UserWarning, match=re.escape(
        "Skipping the checkpoint's gradient-accumulation window: it holds sums of shapes "
        "[(64, 16), (16,), (16, 10), (10,)], but this model accumulates gradients of shapes "
        "[(16, 10), (10,)] (its trainable variables differ from the saved model's). The window in "
        "progress was left as it was."
    )):
        resumed.load_weights(str(tmp_path / "first.weights.h5"))
    from tfdist.engine.update import AccumulationState

    state = AccumulationState.of(resumed.optimizer)
    assert int(tf.convert_to_tensor(state.micro_step)) == 1
    assert float(tf.convert_to_tensor(state.weight)) == 16.0

"""Data sinking: k training steps per host call (issue 8)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import build_model
from tests.engine.common import make_strategy, max_relative_difference
from tests.strategies.parity import relative_difference, strategy_for


class BatchEnds(keras.callbacks.Callback):
    """Records the step index Keras passes to each per-batch hook."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def fit_under(name, x, y, sink_size=None, epochs=1, batch_size=32, **fit_kwargs):
    options = {} if sink_size is None else {"sink_size": sink_size}
    with strategy_for(name, 2, **options).scope():
        model = build_model()
    ends = BatchEnds()
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[ends], **fit_kwargs
    )
    return model, history, ends.ends


def test_sink_size_32_matches_per_step_training_with_partial_last_chunk(digits):
    # 1797 examples in batches of 32: 57 steps, run as chunks of 32 and 25.
    x, y = digits
    per_step, per_step_history, per_step_ends = fit_under("mirrored", x, y)
    sunk, sunk_history, sunk_ends = fit_under("mirrored", x, y, sink_size=32)
    assert sunk.steps_per_execution == 32
    assert sunk.optimizer.iterations.numpy() == 57
    assert relative_difference(per_step, sunk) < 1e-6
    np.testing.assert_allclose(sunk_history.history["loss"], per_step_history.history["loss"], rtol=1e-6)
    assert per_step_ends == list(range(57))
    # Keras's documented steps_per_execution behaviour: one hook per host call,
    # given the chunk's last step index.
    assert sunk_ends == [31, 63]


def test_sink_size_epoch_runs_one_host_call_per_epoch_and_matches(digits):
    x, y = digits
    x, y = x[:320], y[:320]  # 10 steps
    per_step, per_step_history, _ = fit_under("central_storage", x, y, epochs=2, validation_data=(x[:100], y[:100]))
    sunk, sunk_history, ends = fit_under(
        "central_storage", x, y, sink_size="epoch", epochs=2, validation_data=(x[:100], y[:100])
    )
    assert ends == [9, 9]
    assert sunk.optimizer.iterations.numpy() == 20
    assert relative_difference(per_step, sunk) < 1e-6
    np.testing.assert_allclose(sunk_history.history["val_loss"], per_step_history.history["val_loss"], rtol=1e-6)


def test_sink_size_epoch_progress_bar_counts_every_step(digits, capsys):
    x, y = digits
    with strategy_for("mirrored", 2, sink_size="epoch").scope():
        model = build_model()
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "10/10" in out
    assert "1/10" not in out


def test_sink_size_epoch_with_steps_per_epoch_on_a_repeated_dataset(digits):
    x, y = digits
    ds = tf.data.Dataset.from_tensor_slices((x[:320], y[:320])).batch(32).repeat()
    with strategy_for("mirrored", 2, sink_size="epoch").scope():
        model = build_model()
    model.fit(ds, steps_per_epoch=7, epochs=2, verbose=0)
    assert model.optimizer.iterations.numpy() == 14


@pytest.mark.parametrize(
    "value, shown",
    [(0, "sink_size=0"), ("ep", "sink_size='ep'"), (True, "sink_size=True (type bool)"), (2.0, "sink_size=2.0 (type float)")],
)
def test_sink_size_must_be_a_positive_integer_or_epoch(value, shown):
    with pytest.raises(tfdist.OptionError) as info:
        tfdist.get_strategy("mirrored", sink_size=value)
    assert str(info.value) == (
        'option \'sink_size\' must be a positive integer or "epoch" (training steps per host call). '
        f"Received: {shown}"
    )


def test_sink_size_conflicting_with_steps_per_execution_is_an_error():
    with strategy_for("mirrored", 2, sink_size=8).scope():
        with pytest.raises(ValueError) as info:
            build_model(steps_per_execution=4)
    assert str(info.value) == (
        "The strategy's sink_size=8 and compile(steps_per_execution=4) disagree; both set "
        "the training steps per host call. Pass only one of them (or the same integer to both)."
    )


def test_sink_size_epoch_on_input_of_unknown_length_is_an_error(digits):
    x, y = digits
    ds = tf.data.Dataset.from_tensor_slices((x[:64], y[:64])).filter(lambda a, b: True).batch(32)
    with strategy_for("mirrored", 2, sink_size="epoch").scope():
        model = build_model()
    with pytest.raises(ValueError, match=r"sink_size='epoch' runs a whole epoch per host call .*assert_cardinality"):
        model.fit(ds, epochs=1, verbose=0)


def test_sink_size_in_a_preset_is_validated_with_the_file_named():
    assert tfdist.from_config({"strategy": "mirrored", "sink_size": "epoch"}).options.sink_size == "epoch"
    with pytest.raises(tfdist.PresetError) as info:
        tfdist.from_config({"strategy": "mirrored", "sink_size": 0})
    assert str(info.value) == (
        'preset mapping: option \'sink_size\' must be a positive integer or "epoch" (training steps per '
        "host call). Received: sink_size=0"
    )


def test_unknown_length_input_counts_exactly_the_steps_run():
    # Keras's own loop (and a plain get_next()) counts one optimizer step too
    # many per epoch on input of unknown length: 42 for 2 epochs of 20 steps.
    import keras
    import tensorflow as tf

    import tfdist
    from tests.conftest import DEVICES

    x, y = tfdist.datasets.load_digits()
    ds = tf.data.Dataset.from_tensor_slices((x[:640], y[:640])).filter(lambda a, b: True).batch(32)
    assert ds.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 40


def _embedding_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize(
    "name,sink_size",
    [("mirrored", 4), ("central_storage", "epoch"), ("sharded_optimizer", 4)],
)
def test_short_last_batch_beside_full_ones_with_sparse_gradients_matches_one_device(name, sink_size):
    # An Embedding's rows are all-gathered with a count that follows the batch,
    # and TensorFlow fixes a collective's shape per host call: a call holding
    # full batches and the short last one (100 samples = 3 x 32 + 4) aborted
    # with "Shape mismatch in the collective instance" until the short batch
    # got a step copy of its own. Adam over the sparse rows, 2 epochs.
    rng = np.random.RandomState(0)
    x, y = rng.randint(0, 50, (100, 6)), rng.randint(0, 2, 100)
    reference = _embedding_model()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with make_strategy(name, replicas=2, sink_size=sink_size).scope():
        model = _embedding_model()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert max_relative_difference(reference, model) < 1e-5


_THREE_SIZES_SCRIPT = """
import numpy as np, tfdist
tfdist.configure_local_devices(2)
import keras, tensorflow as tf
strategy = tfdist.get_strategy("mirrored", devices=["/cpu:0", "/cpu:1"], sink_size=4)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.RandomState(0)
x, y = rng.randint(0, 50, (56, 6)), rng.randint(0, 2, 56)
def part(a, b, n):
    return tf.data.Dataset.from_tensor_slices((x[a:b], y[a:b])).batch(n)
try:
    model.fit(part(0, 32, 32).concatenate(part(32, 48, 16)).concatenate(part(48, 56, 8)), verbose=0)
except ValueError as error:
    print("ValueError:", error)
"""


def test_three_batch_sizes_in_one_call_with_sparse_gradients_get_a_clear_error():
    # Batches of 32, 16 and 8 in one host call: the first size and one other
    # have step copies; the third meets a collective fixed to another shape.
    # The error names the fixes. In a child process: the aborted collective
    # poisons every later collective of its process.
    import os
    import subprocess
    import sys

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    completed = subprocess.run([sys.executable, "-c", _THREE_SIZES_SCRIPT], capture_output=True, text=True,
                               timeout=240, env=env)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "ValueError: A host call of 4 steps ran batches of more sizes than it has step copies" in completed.stdout
    assert "drop_remainder=True" in completed.stdout and "set sink_size=1" in completed.stdout

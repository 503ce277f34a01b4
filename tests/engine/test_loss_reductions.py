"""Replicas weighted by what each loss is a mean (or sum) over: parity with one device.

The engine weights each replica's loss and divides the replicas' sum by the
summed weights. By rows, that is exact for Keras's default reduction (a mean
over the rows) however unevenly a batch splits. Two other reductions need
other weights (`TrainStep._loss_weight`): a sum (reduction "sum" or "none",
which Keras does not divide by the replica count) and a mean over a padding
mask's unmasked entries (Keras divides by each replica's own count). Before,
both were weighted by rows: 0.76 relative from one device after 2 steps of a
summed MSE whose last batch split 2/1, 2.64 after 2 epochs of a masked LSTM
whose replicas held 2 and 10 tokens per row (stock tf.distribute: exact for
the sum, 2.64 for the mask), and 0.55 for a mean over sample weights
(reduction "mean_with_sample_weight", stock alike) when one replica's rows
weigh 15 times the other's.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

from tests.conftest import max_relative_difference
from tests.engine.common import make_strategy

STRATEGIES = [
    ("mirrored", {}), ("central_storage", {}), ("sharded_optimizer", {}),
    ("sharded_optimizer", {"stage": 3}),
]


def _fit(strategy, build, x, y, **fit_kwargs):
    keras.utils.set_random_seed(0)
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.fit(x, y, shuffle=False, verbose=0, **fit_kwargs)
    return model


class SummedSquares(keras.losses.Loss):
    """A custom loss of reduction "none": per-example values, summed by the tape."""

    def __init__(self):
        super().__init__(reduction="none")

    def call(self, y_true, y_pred):
        return keras.ops.sum(keras.ops.square(y_true - y_pred), axis=-1)


@pytest.mark.parametrize("name, options", STRATEGIES)
@pytest.mark.parametrize("loss", ["sum", "none"])
def test_a_summed_loss_matches_one_device_on_unevenly_split_batches(loss, name, options):
    rng = np.random.RandomState(0)
    x = rng.normal(size=(23, 6)).astype("float32")
    y = rng.normal(size=(23, 2)).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
        summed = keras.losses.MeanSquaredError(reduction="sum") if loss == "sum" else SummedSquares()
        model.compile(optimizer=keras.optimizers.SGD(0.005), loss=summed)
        return model

    # Batches of 8, 8 and 7: the last splits 4/3 over 2 replicas.
    one = _fit(None, build, x, y, batch_size=8, epochs=2)
    model = _fit(make_strategy(name, 2, **options), build, x, y, batch_size=8, epochs=2)
    assert max_relative_difference(one.get_weights(), model.get_weights()) < 1e-5


@pytest.mark.parametrize("name, options", STRATEGIES[:2])
def test_a_mean_over_sample_weights_matches_one_device(name, options):
    # Keras divides by each replica's total sample weight; weighted by rows the
    # replicas' means were 0.55 relative from one device after 2 epochs here.
    rng = np.random.RandomState(2)
    x = rng.normal(size=(40, 6)).astype("float32")
    y = rng.normal(size=(40, 2)).astype("float32")
    w = np.where(np.arange(40) % 16 < 8, 0.2, 3.0).astype("float32")  # replica 0 light, replica 1 heavy

    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
        return model

    one = _fit(None, build, x, y, sample_weight=w, batch_size=16, epochs=2)
    model = _fit(make_strategy(name, 2, **options), build, x, y, sample_weight=w, batch_size=16, epochs=2)
    assert max_relative_difference(one.get_weights(), model.get_weights()) < 1e-5


def _masked_tokens(n=64, steps=10):
    """Rows whose first half of every batch of 16 holds 2 tokens and second half 10: replica 0 and 1 differ."""
    rng = np.random.RandomState(7)
    x = rng.randint(1, 20, size=(n, steps)).astype("int32")
    for i, length in enumerate(np.where((np.arange(n) % 16) < 8, 2, 10)):
        x[i, length:] = 0
    return x, (x % 3).astype("int32")


def _masked_lstm(embedding: bool):
    layers = keras.layers
    if embedding:
        head = [keras.Input((10,), dtype="int32"), layers.Embedding(20, 8, mask_zero=True)]
    else:
        head = [keras.Input((10, 1)), layers.Masking(0.0)]
    model = keras.Sequential(head + [layers.LSTM(8, return_sequences=True), layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("name, options", STRATEGIES + [("mirrored", {"accumulation_steps": 2})])
def test_a_masked_sequence_loss_matches_one_device_when_replicas_hold_different_token_counts(name, options):
    x, y = _masked_tokens()
    kwargs = dict(batch_size=16, epochs=2)
    one = _fit(None, lambda: _masked_lstm(True), x, y, **kwargs)
    if options.get("accumulation_steps"):
        # Accumulation: a window of 2 micro-batches of 16 is one step of the 32-row batch.
        one = _fit(None, lambda: _masked_lstm(True), x, y, batch_size=32, epochs=2)
    model = _fit(make_strategy(name, 2, **options), lambda: _masked_lstm(True), x, y, **kwargs)
    assert max_relative_difference(one.get_weights(), model.get_weights()) < 1e-5


def test_a_masked_loss_under_xla_matches_one_device():
    # No Embedding: each replica's pass is one compiled program, and the weight
    # it chose leaves the program as an output.
    x, y = _masked_tokens()
    x = x[..., None].astype("float32")
    one = _fit(None, lambda: _masked_lstm(False), x, y, batch_size=16, epochs=1)
    model = _fit(make_strategy("mirrored", 2, jit_compile=True), lambda: _masked_lstm(False), x, y,
                 batch_size=16, epochs=1)
    assert max_relative_difference(one.get_weights(), model.get_weights()) < 1e-5


def test_losses_of_mixed_reductions_are_weighted_by_rows_with_a_warning():
    rng = np.random.RandomState(1)
    x = rng.normal(size=(16, 4)).astype("float32")
    ys = [rng.normal(size=(16, 1)).astype("float32") for _ in range(2)]

    def build():
        inputs = keras.Input((4,))
        outputs = [keras.layers.Dense(1, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)]
        model = keras.Model(inputs, outputs, name="two_heads")
        model.compile(optimizer="sgd", loss={"a": keras.losses.MeanSquaredError(reduction="sum"), "b": "mse"})
        return model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(make_strategy("mirrored", 2), build, x, {"a": ys[0], "b": ys[1]}, batch_size=8)
    messages = [str(w.message) for w in caught if "mix reductions" in str(w.message)]
    assert messages == [
        "The losses of model 'two_heads' mix reductions that need different weights across replicas (a sum, a "
        "mean over rows); tfdist weights each replica by its rows, which is exact only where every replica's "
        "share holds the same number of rows and of unmasked entries. Give every output a mean loss over rows, "
        "or the model one summed or masked loss, for gradients equal to one device's."
    ]


def _two_heads(reduction="sum_over_batch_size"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = {"cls": keras.layers.Dense(3, name="cls")(hidden), "reg": keras.layers.Dense(1, name="reg")(hidden)}
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
              "reg": keras.losses.MeanSquaredError(reduction=reduction)},
        loss_weights={"cls": 1.0, "reg": 0.3},
    )
    return model


@pytest.mark.parametrize("name, options, reduction", [
    ("mirrored", {}, "sum_over_batch_size"), ("mirrored", {"jit_compile": True}, "sum_over_batch_size"),
    ("sharded_optimizer", {"stage": 3}, "sum_over_batch_size"), ("mirrored", {}, "sum"),
])
def test_per_output_loss_logs_of_uneven_batches_match_one_device(name, options, reduction):
    # Keras logs `<output>_loss` counting each batch once (its static batch
    # dimension, None in a traced step). Per replica each share counted once:
    # a batch of 13 split 7/6 logged the unweighted mean of the two shares'
    # means, and an empty share (13 in batches of 4 end with 1 row on 2
    # replicas) added a zero: evaluate's cls_loss read 0.931 against one
    # device's 1.069, and fit's second-epoch cls_loss 1.118 against 1.138.
    rng = np.random.RandomState(0)
    x = rng.normal(size=(13, 6)).astype("float32")
    y = {"cls": rng.randint(0, 3, size=13).astype("int32"), "reg": rng.normal(size=(13, 1)).astype("float32")}

    def logs(strategy):
        model = _fit(strategy, lambda: _two_heads(reduction), x, y, batch_size=8, epochs=2)
        history = model.history.history
        evaluated = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
        return {**{k: history[k][-1] for k in ("cls_loss", "reg_loss", "loss")},
                **{f"val_{k}": evaluated[k] for k in ("cls_loss", "reg_loss", "loss")}}

    one = logs(None)
    replicas = logs(make_strategy(name, 2, **options))
    assert replicas == pytest.approx(one, rel=1e-5)


@pytest.mark.parametrize("name, options", STRATEGIES[:2] + [("mirrored", {"sink_size": 2})])
def test_a_summed_loss_is_logged_as_on_one_device(name, options):
    # The `loss` log weighs each batch by its rows. A summed loss reached it
    # as N times each replica's sum, weighted by the replica's rows: on a
    # batch split 3/2 (13 rows in batches of 8), fit's second epoch logged
    # 9.106 against one device's 9.192, and evaluate (batches of 4, the last
    # split 1/0) 4.296 against 4.266.
    rng = np.random.RandomState(0)
    x = rng.normal(size=(13, 6)).astype("float32")
    y = rng.normal(size=(13, 2)).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.MeanSquaredError(reduction="sum"))
        return model

    def logs(strategy):
        model = _fit(strategy, build, x, y, batch_size=8, epochs=2)
        return model.history.history["loss"] + [model.evaluate(x, y, batch_size=4, verbose=0)]

    assert logs(make_strategy(name, 2, **options)) == pytest.approx(logs(None), rel=1e-5)

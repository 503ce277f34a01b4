"""A custom `train_step`'s `optimizer.apply` runs the engine's reduction and update (issue 13).

The user's step runs as written on every replica; what its
`self.optimizer.apply(...)` does under a tfdist strategy is the engine's
phases 2–4, so accumulation, XLA, loss scaling and clipping on the summed
gradient reach it. Parity is with the same model trained by Keras on one
device.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.engine.common import make_strategy, max_relative_difference
from tests.engine.test_xla import _fit_and_collect_executed_ops


class GuideStep(keras.Model):
    """keras-io "customizing what happens in fit", scaling the loss as Keras's guide says."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


class TwoOptimizerStep(keras.Model):
    """A GAN-like step: the last layer has an optimizer of its own, the rest the model's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_optimizer = keras.optimizers.SGD(0.05)

    def train_step(self, data):
        x, y = data
        head = self.layers[-1].trainable_variables
        body = [v for v in self.trainable_variables if all(v is not h for h in head)]
        with tf.GradientTape(persistent=True) as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, body), body)
        self.head_optimizer.apply(tape.gradient(loss, head), head)
        return {"loss": loss}


def _model(cls=GuideStep, optimizer=None, seed=0):
    """`optimizer`: a callable making the optimizer (in the strategy's scope)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    model = cls(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(3)
    x = rng.normal(size=(96, 12)).astype("float32")
    return x, (x[:, :3] * 2.0 + 0.5).astype("float32")


def _train(strategy, data, batch_size=16, **kwargs):
    x, y = data
    if strategy is None:
        model = _model(**kwargs)
    else:
        with strategy.scope():
            model = _model(**kwargs)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name, options", [("mirrored", {}), ("central_storage", {}),
                                           ("sharded_optimizer", {}), ("mirrored", {"accumulation_steps": 2})])
def test_custom_step_on_unevenly_split_batches_matches_one_device(name, options, data):
    # 13 rows in batches of 8 end with 5, split 3/2 on 2 replicas. The step
    # sent each replica's gradient with weight 1, so the 3/2 split averaged
    # the two shares' means: 0.10 relative from one device after one epoch
    # (0.13 with accumulation_steps=2).
    x, y = data
    one = _train(None, (x[:13], y[:13]), batch_size=8)
    model = _train(make_strategy(name, replicas=2, **options), (x[:13], y[:13]), batch_size=8)
    if options:  # accumulation: a window of 2 micro-batches of 8 and 5 is Keras's one batch of 13
        one = _train(None, (x[:13], y[:13]), batch_size=13)
    assert max_relative_difference(one, model) < 1e-5


@pytest.mark.parametrize("name", ["mirrored", "central_storage", "sharded_optimizer"])
def test_accumulation_option_and_keras_accumulation_reach_a_custom_step(name, data):
    # Both spellings of accumulation match Keras's gradient_accumulation_steps=2 on one device.
    reference = _train(None, data, batch_size=8, optimizer=lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))
    option = _train(make_strategy(name, replicas=2, accumulation_steps=2), data, batch_size=8,
                    optimizer=lambda: keras.optimizers.Adam(0.01))
    assert max_relative_difference(reference, option) < 1e-5
    assert int(option.optimizer.iterations.numpy()) == 6  # 12 micro-batches, 6 updates
    if name != "sharded_optimizer":  # it takes the strategy option only
        keras_spelling = _train(make_strategy(name, replicas=2), data, batch_size=8,
                                optimizer=lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))
        assert max_relative_difference(reference, keras_spelling) < 1e-5
        assert int(keras_spelling.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


def test_custom_step_runs_under_xla_with_the_reduction_outside(data):
    reference = _train(None, data, batch_size=32)  # the helper's batch size
    with make_strategy("mirrored", replicas=2, jit_compile=True).scope():
        model = _model()
    nodes = _fit_and_collect_executed_ops(model, *data)
    xla_devices = {n.device.rsplit(":", 1)[-1] for n in nodes if n.op == "_XlaRun"}
    assert {"0", "1"} <= xla_devices, f"_XlaRun on devices {sorted(xla_devices)}"
    assert any(n.op.startswith("CollectiveReduce") for n in nodes)
    assert max_relative_difference(reference, model) < 1e-5


def test_custom_step_clips_the_summed_gradient_like_one_device(data):
    # Keras's own apply under tf.distribute clips each replica's share before
    # summing (two shares clipped to norm c sum to up to 2c); the engine clips
    # the sum, as one device does.
    clipped = lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05)  # noqa: E731
    reference = _train(None, data, optimizer=clipped)
    model = _train(make_strategy("mirrored", replicas=2), data, optimizer=clipped)
    assert max_relative_difference(reference, model) < 1e-5
    assert max_relative_difference(reference, _train(None, data)) > 1e-2  # clipping is active


def test_custom_step_under_a_loss_scale_optimizer_skips_non_finite_steps(data):
    x, y = data
    x = x.copy()
    x[20, 0] = np.inf  # the second batch of 16
    lso = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))  # noqa: E731
    reference = _train(None, (x, y), optimizer=lso)
    model = _train(make_strategy("mirrored", replicas=2), (x, y), optimizer=lso)
    assert max_relative_difference(reference, model) < 1e-5
    # One skipped step halved the scale on both.
    assert float(model.optimizer.dynamic_scale.numpy()) == float(reference.optimizer.dynamic_scale.numpy()) == 2.0**14
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


def test_a_step_with_another_optimizer_keeps_keras_apply_and_refuses_accumulation(data):
    reference = _train(None, data, cls=TwoOptimizerStep)
    model = _train(make_strategy("mirrored", replicas=2), data, cls=TwoOptimizerStep)
    assert max_relative_difference(reference, model) < 1e-5
    with pytest.raises(NotImplementedError) as info:
        _train(make_strategy("mirrored", replicas=2, accumulation_steps=2), data, cls=TwoOptimizerStep)
    assert str(info.value) == (
        "accumulation_steps=2 with a custom train_step applies the model's optimizer to all of "
        "model.trainable_variables in replica context; TwoOptimizerStep.train_step called "
        "optimizer.apply with 2 variables. Accumulate in the train_step yourself, or drop "
        "accumulation_steps."
    )


class LoggingStep(keras.Model):
    """A step (and test step) returning logs of its own, not the model's metrics (as a GAN's d_loss/g_loss)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"squared_error": tf.reduce_mean(tf.square(y_pred - y)), "answer": 42.0}

    def test_step(self, data):
        x, y = data
        return {"abs_error": tf.reduce_mean(tf.abs(self(x, training=False) - y))}


@pytest.mark.parametrize("options", [{}, {"sink_size": 3}])
def test_logs_a_custom_step_returns_reach_the_history_as_on_one_device(options, data):
    # tfdist dropped them: the history held {"loss": [0.0]} (the untouched
    # loss tracker). Now they are reduced as Keras reduces them (the mean over
    # the replicas), from the call's last step: equal to one device here,
    # where each replica's share is half of every batch.
    x, y = data
    histories, evaluations = [], []
    for strategy in (None, make_strategy("mirrored", 2, **options)):
        model = _model(LoggingStep) if strategy is None else _scoped(strategy, LoggingStep)
        histories.append(model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history)
        evaluations.append(model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True))
    one, tfdist_ = histories
    assert sorted(tfdist_) == ["answer", "squared_error"]
    assert tfdist_["answer"] == [42.0, 42.0]
    np.testing.assert_allclose(tfdist_["squared_error"], one["squared_error"], rtol=1e-5)
    assert sorted(evaluations[1]) == ["abs_error"]
    np.testing.assert_allclose(evaluations[1]["abs_error"], evaluations[0]["abs_error"], rtol=1e-5)


def _scoped(strategy, cls):
    with strategy.scope():
        return _model(cls)

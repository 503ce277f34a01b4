"""Shared parity harness: train on one device and under a strategy, compare weights."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tests.conftest import DEVICES, Classifier, build_model, max_relative_difference

# Tight: float32 sums in a different order, over 20+ SGD steps.
PARITY_RTOL = 1e-5


def strategy_for(name: str, replicas: int, **options):
    if name == "central_storage":
        return tfdist.get_strategy(name, compute_devices=DEVICES[replicas], **options)
    return tfdist.get_strategy(name, devices=DEVICES[replicas], **options)


def train_pair(name, replicas, x, y, kind="sequential", batch_size=32, epochs=1, optimizer_fn=None,
               fit_kwargs=None, compile_kwargs=None, strategy_options=None):
    """Returns (single-device model, distributed model) after identical training."""
    optimizer_fn = optimizer_fn or (lambda: keras.optimizers.SGD(0.1))
    fit_kwargs = dict(batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **(fit_kwargs or {}))
    compile_kwargs = compile_kwargs or {}
    reference = build_model(kind, optimizer=optimizer_fn(), **compile_kwargs)
    ref_history = reference.fit(x, y, **fit_kwargs)
    strategy = strategy_for(name, replicas, **(strategy_options or {}))
    with strategy.scope():
        model = build_model(kind, optimizer=optimizer_fn(), **compile_kwargs)
    history = model.fit(x, y, **fit_kwargs)
    return reference, ref_history, model, history


def relative_difference(reference, model) -> float:
    return max_relative_difference(reference.get_weights(), model.get_weights())


class OwnStepModel(Classifier):
    """keras-io "customizing what happens in fit": its own GradientTape and optimizer.apply."""

    def __init__(self):
        super().__init__(hidden=16)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def own_step_model():
    """An `OwnStepModel` built and compiled with AdamW, weights from seed 0."""
    keras.utils.set_random_seed(0)
    model = OwnStepModel()
    model(np.zeros((1, 64), np.float32))
    model.compile(
        optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class StopAfterFirstEpoch(keras.callbacks.Callback):
    """Interrupts `fit` after its first epoch (`RuntimeError("interrupted")`), as a crash would."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise RuntimeError("interrupted")

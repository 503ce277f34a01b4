"""A classic Estimator-shaped model_fn and input_fns on the bundled digits, shared by the tests."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdist import estimator as est

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_fn(features, labels, mode, params):
    """Dense(hidden, relu) -> Dense(10), like tests.conftest.build_model("sequential")."""
    hidden = keras.layers.Dense(params.get("hidden", 32), activation="relu")(features)
    logits = keras.layers.Dense(10)(hidden)
    if mode == est.ModeKeys.PREDICT:
        return est.EstimatorSpec(mode, predictions={"class": tf.argmax(logits, axis=1), "logits": logits})
    loss = LOSS(labels, logits)
    if mode == est.ModeKeys.EVAL:
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        accuracy.update_state(labels, logits)
        return est.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
    optimizer = params.get("optimizer_fn", lambda: keras.optimizers.SGD(0.1))()
    return est.EstimatorSpec(mode, loss=loss, optimizer=optimizer)


def input_fn_for(x, y=None, batch_size=32):
    def input_fn():
        data = (x, y) if y is not None else x
        return tf.data.Dataset.from_tensor_slices(data).batch(batch_size)

    return input_fn


def keras_weights_in_estimator_order(estimator) -> list[np.ndarray]:
    return [estimator.get_variable_value(n) for n in ("dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias")]

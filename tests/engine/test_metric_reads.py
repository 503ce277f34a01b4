"""Metrics read across processes in one all-reduce, or in the gradients' (issue 18, fewer messages).

The cluster tests (tests/strategies/test_multi_worker.py) count the all-reduces
of a 2-worker train function and compare its per-batch logs with mirrored's;
these check, in one process, that the summed state gives Keras's logs.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tests.engine.common import make_strategy
from tfdist.engine import step as step_lib


class MaxSeen(keras.metrics.Metric):
    """A metric whose state is not summed on read (Keras's "mean" aggregation)."""

    def __init__(self, name="max_seen"):
        super().__init__(name=name)
        self.value = self.add_variable((), "zeros", aggregation="mean", name="value")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.value.assign(tf.maximum(self.value, tf.reduce_max(tf.cast(y_pred, "float32"))))

    def result(self):
        return self.value


def _fitted(metrics):
    rng = np.random.RandomState(0)
    x, y = rng.rand(64, 8).astype("float32"), rng.randint(0, 3, 64)
    strategy = make_strategy("mirrored", replicas=2)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=metrics)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return strategy, model


def test_logs_from_the_replicas_summed_metric_state_are_kerass():
    strategy, model = _fitted(["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2)])
    variables = step_lib.metric_variables(model)
    assert [v.path for v in variables] == [
        "loss/total", "loss/count", "accuracy/total", "accuracy/count",
        "sparse_top_k_categorical_accuracy/total", "sparse_top_k_categorical_accuracy/count",
    ]

    @tf.function
    def logs_from_state():
        local = strategy.run(lambda: step_lib.local_metric_state(variables))
        summed = tf.add_n(strategy.experimental_local_results(local))
        return step_lib.metrics_result_from_state(model, variables, summed)

    expected = {k: float(v) for k, v in model.get_metrics_result().items()}
    assert {k: float(v) for k, v in logs_from_state().items()} == expected
    assert set(expected) == {"loss", "accuracy", "sparse_top_k_categorical_accuracy"}
    # Both replicas hold half of the 16 examples of the last batch: the state is a sum.
    assert float(tf.add_n(strategy.experimental_local_results(variables[1].value))) == 64.0


def test_metrics_not_summed_on_read_are_read_as_keras_reads_them():
    _, model = _fitted([MaxSeen()])
    assert step_lib.metric_variables(model) is None

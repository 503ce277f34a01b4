"""Test set-up: 4 logical CPU devices per test process, bundled data, shared model builders."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfdist  # noqa: E402

# Before TensorFlow initialises its devices: every test process has 4 replicas to use.
LOCAL_DEVICES = tfdist.configure_local_devices(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

DEVICES = {n: [f"/cpu:{i}" for i in range(n)] for n in (1, 2, 3, 4)}


@pytest.fixture(scope="session")
def digits():
    """The bundled digits: (x float32 [1797, 64], y int32 [1797])."""
    return tfdist.datasets.load_digits()


@pytest.fixture(scope="session")
def data50(digits):
    """The first 1600 digits: 50 steps of 32."""
    x, y = digits
    return x[:1600], y[:1600]


@pytest.fixture(scope="session")
def data10(digits):
    """The first 320 digits: 10 steps of 32."""
    x, y = digits
    return x[:320], y[:320]


class Classifier(keras.Model):
    """The subclassed digits classifier: one ReLU hidden layer of `hidden` units, 10 logits."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.hidden = keras.layers.Dense(hidden, activation="relu")
        self.out = keras.layers.Dense(10)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


def build_model(kind: str = "sequential", seed: int = 0, optimizer=None, metrics=("accuracy",), **compile_kwargs):
    """A small digits classifier of the given kind, compiled; deterministic weights."""
    keras.utils.set_random_seed(seed)
    if kind == "sequential":
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
    elif kind == "functional":
        inputs = keras.Input((64,))
        h = keras.layers.Dense(32, activation="tanh")(inputs)
        skip = keras.layers.Dense(32)(inputs)
        outputs = keras.layers.Dense(10)(keras.layers.Add()([h, skip]))
        model = keras.Model(inputs, outputs)
    elif kind == "batchnorm":
        # Non-synchronized BatchNorm: each replica normalises its own share.
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, use_bias=False),
             keras.layers.BatchNormalization(momentum=0.5), keras.layers.ReLU(), keras.layers.Dense(10)]
        )
    elif kind == "subclassed":
        model = Classifier()
        model(np.zeros((1, 64), np.float32))
    else:
        raise ValueError(kind)
    model.compile(
        optimizer=optimizer if optimizer is not None else keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
        **compile_kwargs,
    )
    return model


def max_relative_difference(a_weights, b_weights) -> float:
    """max over tensors of max|a-b| / max|a|."""
    worst = 0.0
    assert len(a_weights) == len(b_weights)
    for a, b in zip(a_weights, b_weights):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape
        worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-12)))
    return worst

"""Clipping on the reduced gradient: global_clipnorm sees the whole gradient."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.engine.common import make_strategy, max_relative_difference, tiny_model
from tfdist.engine import update as transforms


def test_clip_by_optimizer_takes_the_global_norm_of_all_gradients():
    grads = [tf.constant([3.0, 0.0]), tf.constant([[4.0]]), None]
    clip = transforms.clip_by_optimizer(keras.optimizers.SGD(global_clipnorm=1.0))
    out = clip.update(grads)
    np.testing.assert_allclose(out[0].numpy(), [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out[1].numpy(), [[0.8]], rtol=1e-6)
    assert out[2] is None
    assert transforms.clip_by_optimizer(keras.optimizers.SGD()) is None


@pytest.mark.parametrize(
    "optimizer_fn",
    [
        lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
        lambda: keras.optimizers.SGD(0.1, clipvalue=0.002),
    ],
    ids=["clipnorm", "clipvalue"],
)
def test_per_variable_clipping_on_4_replicas_matches_one_device(optimizer_fn, digits):
    # global_clipnorm on every strategy: tests/engine/test_matrix.py ("clipping").
    x, y = digits
    reference = tiny_model(optimizer_fn)
    reference.fit(x[:128], y[:128], batch_size=32, shuffle=False, verbose=0)
    with make_strategy("mirrored").scope():
        model = tiny_model(optimizer_fn)
    model.fit(x[:128], y[:128], batch_size=32, shuffle=False, verbose=0)
    assert max_relative_difference(reference, model) < 1e-4

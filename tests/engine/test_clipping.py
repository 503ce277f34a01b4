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


def test_global_clipnorm_squares_a_sparse_gradients_rows_apart_and_densifies_it_as_keras_does():
    # Keras's `clip_by_global_norm` squares an IndexedSlices' rows as they are
    # (row 0 looked up twice: 3 and 4, norm 5, not 7) and its `v * scale`
    # returns the gradient dense, rows looked up twice summed.
    grads = [tf.IndexedSlices(tf.constant([[3.0], [4.0]]), tf.constant([0, 0]), tf.constant([2, 1]))]
    values, factor = transforms.clip_by_optimizer(keras.optimizers.SGD(global_clipnorm=1.0)).scalar(grads, None)
    np.testing.assert_allclose(float(factor), 0.2, rtol=1e-6)
    assert not isinstance(values[0], tf.IndexedSlices)
    np.testing.assert_allclose(values[0].numpy(), [[7.0], [0.0]])


def _token_model(optimizer_fn):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,), dtype="int32"), keras.layers.Embedding(50, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
    ])
    model.compile(optimizer=optimizer_fn(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
@pytest.mark.parametrize(
    "optimizer_fn,tolerance",
    [
        (lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.01), 1e-5),
        # Adam divides by the root of tiny second moments: summation order shows at 5e-5.
        (lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.01), 2e-4),
    ],
    ids=["sgd", "adam"],
)
def test_global_clipnorm_on_an_embedding_matches_one_device(strategy, optimizer_fn, tolerance):
    # Before: the norm of the densified gradient, and the rows kept sparse:
    # 6.2e-3 (SGD) and 3.6e-1 (Adam, whose moments of rows not looked up
    # then did not decay) from one device, with one replica as with two.
    rng = np.random.RandomState(0)
    x = rng.randint(1, 50, size=(64, 8)).astype("int32")  # tokens repeat within a batch
    y = (x[:, :3].sum(axis=1) % 2).astype("int32")
    reference = _token_model(optimizer_fn)
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    with make_strategy(strategy, replicas=2).scope():
        model = _token_model(optimizer_fn)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert max_relative_difference(reference, model) < tolerance

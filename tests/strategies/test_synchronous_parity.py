"""Numerical parity of the synchronous strategies with single-device training (issue 3)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import build_model
from tests.strategies import custom_loop
from tests.strategies.parity import PARITY_RTOL, relative_difference, strategy_for, train_pair

STRATEGIES = ["mirrored", "central_storage"]


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("replicas", [2, 4])
def test_weights_match_single_device_after_20_sgd_steps(name, replicas, digits):
    x, y = digits
    x, y = x[:640], y[:640]  # 20 steps of 32
    reference, ref_history, model, history = train_pair(name, replicas, x, y)
    assert model.optimizer.iterations.numpy() == 20
    assert relative_difference(reference, model) < PARITY_RTOL
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"], ref_history.history["accuracy"], rtol=1e-6)


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_functional_and_subclassed_models_match_single_device(name, kind, digits):
    x, y = digits
    reference, _, model, _ = train_pair(name, 2, x[:640], y[:640], kind=kind)
    assert relative_difference(reference, model) < PARITY_RTOL


@pytest.mark.parametrize("name", STRATEGIES)
def test_tf_data_input_matches_single_device(name, digits):
    x, y = digits
    ds = tf.data.Dataset.from_tensor_slices((x[:640], y[:640])).batch(32)
    ref = strategy_for  # noqa: F841 (keeps the import used in one place)
    reference, _, model, _ = train_pair(name, 4, ds, None, batch_size=None)
    assert relative_difference(reference, model) < PARITY_RTOL


@pytest.mark.parametrize("name", STRATEGIES)
def test_uneven_global_batch_is_exact(name, digits):
    # 30 does not divide by 4 replicas (8, 8, 7, 7) and the epoch ends on a short
    # batch of 10: each replica's gradient is weighted by its batch size.
    x, y = digits
    reference, _, model, _ = train_pair(name, 4, x[:640], y[:640], batch_size=30)
    assert model.optimizer.iterations.numpy() == 22
    assert relative_difference(reference, model) < PARITY_RTOL


@pytest.mark.parametrize("name", STRATEGIES)
def test_steps_per_execution_with_partial_last_chunk_matches(name, digits):
    # Upstream Keras 3.15 fails here under MirroredStrategy ("You must feed a
    # value for placeholder tensor 'while/cond/Placeholder'"). 20 steps in
    # chunks of 3: the last chunk has 2 steps.
    x, y = digits
    reference, ref_history, model, history = train_pair(
        name, 2, x[:640], y[:640], compile_kwargs={"steps_per_execution": 3}
    )
    assert model.optimizer.iterations.numpy() == 20
    assert relative_difference(reference, model) < PARITY_RTOL
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize(
    "optimizer_fn",
    [
        lambda: keras.optimizers.Adam(1e-3),
        lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05),
        lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05),
    ],
    ids=["adam", "sgd_nesterov", "adamw_decay", "sgd_global_clipnorm"],
)
def test_optimizers_match_single_device(name, optimizer_fn, digits):
    # global_clipnorm is taken on the summed gradient, so it matches one device
    # (upstream Keras clips per replica and ends 60% away).
    x, y = digits
    reference, _, model, _ = train_pair(name, 2, x[:640], y[:640], optimizer_fn=optimizer_fn)
    assert relative_difference(reference, model) < 1e-4


@pytest.mark.parametrize("name", STRATEGIES)
def test_evaluate_and_predict_match_single_device(name, digits):
    x, y = digits
    reference, _, model, _ = train_pair(name, 4, x[:640], y[:640])
    ref_eval = reference.evaluate(x, y, batch_size=50, verbose=0, return_dict=True)
    dist_eval = model.evaluate(x, y, batch_size=50, verbose=0, return_dict=True)
    assert dist_eval["accuracy"] == pytest.approx(ref_eval["accuracy"], abs=1e-7)
    assert dist_eval["loss"] == pytest.approx(ref_eval["loss"], rel=1e-5)
    np.testing.assert_allclose(model.predict(x[:101], verbose=0), reference.predict(x[:101], verbose=0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", STRATEGIES)
def test_embedding_sparse_gradients_match_single_device(name):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50, size=(256, 6)).astype("int32")
    labels = (tokens.sum(axis=1) % 2).astype("int32")

    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential(
            [
                keras.Input((6,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(2),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    reference = build()
    reference.fit(tokens, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with strategy_for(name, 4).scope():
        model = build()
    model.fit(tokens, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert relative_difference(reference, model) < PARITY_RTOL


@pytest.mark.parametrize("name", STRATEGIES)
def test_custom_training_loop_built_first_matches_single_device(name, digits):
    # The README's custom-loop recipe: build model and optimizer in the scope,
    # divide by the global batch, optimizer.apply per replica.
    x, y = digits
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    batches = tf.data.Dataset.from_tensor_slices((x[:128], y[:128])).batch(32)

    def run(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(10)])
            optimizer = keras.optimizers.Adam(0.01)
            optimizer.build(model.trainable_variables)

        @tf.function
        def step(batch):
            def replica_fn(batch):
                xb, yb = batch
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=32)
                optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
                return loss

            return strategy.reduce("SUM", strategy.run(replica_fn, args=(batch,)), axis=None)

        losses = [float(step(b)) for b in strategy.experimental_distribute_dataset(batches)]
        return model, losses

    reference, ref_losses = run(tf.distribute.get_strategy())
    model, losses = run(strategy_for(name, 2))
    assert relative_difference(reference, model) < PARITY_RTOL
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


# What a custom loop written as Keras's guides write it may hold, and what
# Keras's own `apply` in a replica got wrong under tf.distribute (TensorFlow 2.21,
# Keras 3.15): an optimizer built at its first `apply` failed inside the traced
# step ("You must feed a value for placeholder tensor"); `global_clipnorm`
# clipped each replica's share (0.08 from one device); a position embedding's
# rows, the same on every replica, were concatenated, not summed (Adam: 0.15).
_LOOP_CASES = {
    "optimizer_built_in_step": (lambda: keras.optimizers.Adam(0.05), False, False),
    "global_clipnorm": (lambda: keras.optimizers.SGD(0.05, global_clipnorm=0.5), True, False),
    "position_embedding": (lambda: keras.optimizers.Adam(0.05), True, True),
}


@pytest.mark.parametrize("case", list(_LOOP_CASES))
@pytest.mark.parametrize("name", STRATEGIES + ["sharded_optimizer"])
def test_custom_training_loop_matches_single_device(name, case):
    optimizer_fn, build_first, position = _LOOP_CASES[case]
    reference, ref_optimizer, _ = custom_loop.train(tf.distribute.get_strategy(), optimizer_fn, build_first, position)
    model, optimizer, _ = custom_loop.train(strategy_for(name, 2), optimizer_fn, build_first, position)
    assert int(optimizer.iterations.numpy()) == int(ref_optimizer.iterations.numpy()) == 4
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("source", ["numpy_shuffle", "tf_data_shuffle_once"])
def test_shuffled_input_matches_single_device_when_the_order_is_fixed(source, digits):
    # The README's parity rule: Keras's own shuffling of arrays, or a seeded
    # tf.data shuffle that does not reshuffle per iteration, gives the
    # replicas the one-device order. (A reshuffling tf.data.shuffle does not,
    # under stock tf.distribute either.)
    x, y = digits
    x, y = x[:256], y[:256]

    def fit(model):
        keras.utils.set_random_seed(1)
        if source == "numpy_shuffle":
            model.fit(x, y, batch_size=32, epochs=2, shuffle=True, verbose=0)
        else:
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=7, reshuffle_each_iteration=False)
            model.fit(ds.batch(32), epochs=2, shuffle=False, verbose=0)
        return model

    reference = fit(build_model())
    with strategy_for("mirrored", 2).scope():
        model = build_model()
    assert relative_difference(reference, fit(model)) < PARITY_RTOL

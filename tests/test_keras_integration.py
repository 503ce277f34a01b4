"""Keras 3 (and tf-keras) under tfdist strategies: callbacks, saving, scope rules (issue 3)."""

from __future__ import annotations

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES, build_model, max_relative_difference
from tests.strategies.parity import PARITY_RTOL, strategy_for
from tfdist import keras_integration

STRATEGIES = ["mirrored", "central_storage"]


@pytest.fixture
def data(digits):
    x, y = digits
    return x[:512], y[:512]


@pytest.mark.parametrize("name", STRATEGIES)
def test_model_checkpoint_and_keras_file_round_trip(name, data, tmp_path):
    x, y = data
    with strategy_for(name, 2).scope():
        model = build_model()
    path = str(tmp_path / "epoch{epoch}.keras")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(path)])
    assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*.keras"))) == ["epoch1.keras", "epoch2.keras"]
    # Loaded on one device (outside any scope): same weights, same predictions.
    single = keras.models.load_model(str(tmp_path / "epoch2.keras"))
    assert max_relative_difference(model.get_weights(), single.get_weights()) == 0.0
    np.testing.assert_allclose(single.predict(x[:64], verbose=0), model.predict(x[:64], verbose=0), rtol=1e-5, atol=1e-6)
    # Loaded back under a strategy: variables are distributed and training goes on.
    strategy = strategy_for(name, 4)
    with strategy.scope():
        again = keras.models.load_model(str(tmp_path / "epoch2.keras"))
    assert isinstance(again.trainable_variables[0].value, tf.distribute.DistributedValues) or name == "central_storage"
    assert again.optimizer.iterations.numpy() == 32
    again.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert again.optimizer.iterations.numpy() == 48


@pytest.mark.parametrize("name", STRATEGIES)
def test_backup_and_restore_resumes_after_interruption(name, data, tmp_path):
    x, y = data

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with strategy_for(name, 2).scope():
        uninterrupted = build_model()
    uninterrupted.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)

    with strategy_for(name, 2).scope():
        model = build_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[backup, Interrupt()])
    with strategy_for(name, 2).scope():
        resumed = build_model()
    history = resumed.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
    assert history.epoch == [2, 3]
    assert resumed.optimizer.iterations.numpy() == 64
    assert max_relative_difference(uninterrupted.get_weights(), resumed.get_weights()) < PARITY_RTOL


@pytest.mark.parametrize("name", STRATEGIES)
def test_tensorboard_and_early_stopping(name, data, tmp_path):
    x, y = data
    with strategy_for(name, 2).scope():
        model = build_model()
    logdir = tmp_path / "tb"
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
    history = model.fit(
        x, y, batch_size=32, epochs=10, verbose=0,
        callbacks=[keras.callbacks.TensorBoard(str(logdir)), stop],
    )
    # min_delta=10 means no epoch counts as an improvement: stop after patience+1 epochs.
    assert len(history.history["loss"]) == 2
    events = glob.glob(str(logdir / "train" / "events.out.tfevents.*"))
    assert len(events) == 1
    tags = set()
    for record in tf.compat.v1.train.summary_iterator(events[0]):
        for value in record.summary.value:
            tags.add(value.tag)
    assert {"epoch_loss", "epoch_accuracy"} <= tags


@pytest.mark.parametrize("name", STRATEGIES)
def test_batch_normalization_trains_with_consistent_replicas(name, data):
    x, y = data
    with strategy_for(name, 4).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
             keras.layers.ReLU(), keras.layers.Dense(10)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0] * 0.8
    moving_mean = model.layers[1].moving_mean.value
    copies = moving_mean.values if isinstance(moving_mean, tf.distribute.DistributedValues) else [moving_mean]
    for copy in copies[1:]:
        np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())
    assert float(np.abs(copies[0].numpy()).sum()) > 0.0


def test_model_built_outside_the_scope_is_refused_and_left_unchanged():
    strategy = strategy_for("mirrored", 2)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)], name="outside")
    with strategy.scope():
        with pytest.raises(ValueError) as e:
            model.compile(optimizer="sgd", loss="mse")
    assert str(e.value).startswith(
        "The model 'outside' was built outside any strategy scope and is being compiled inside the scope of "
        "<tfdist MirroredStrategy name='mirrored' replicas=2, devices=['/cpu:0', '/cpu:1']>."
    )
    assert "Build the model inside the same scope you compile it in" in str(e.value)
    assert not model.compiled and getattr(model, "optimizer", None) is None


def test_model_built_inside_but_compiled_outside_is_refused():
    with strategy_for("central_storage", 2).scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)], name="inside")
    with pytest.raises(ValueError, match=r"^The model 'inside' was built inside the scope of <tfdist CentralStorageStrategy"):
        model.compile(optimizer="sgd", loss="mse")
    assert not model.compiled


def test_loaded_models_are_compiled_with_and_without_a_strategy(tmp_path, recwarn):
    plain = build_model()
    plain.save(str(tmp_path / "plain.keras"))
    loaded = keras.models.load_model(str(tmp_path / "plain.keras"))
    assert loaded.compiled and isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert not [w for w in recwarn if "compile()` was not called" in str(w.message)]


def test_models_outside_tfdist_keep_keras_own_functions(data):
    x, y = data
    plain = build_model()
    plain.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    assert plain.train_function.__qualname__.startswith("TensorFlowTrainer._make_function")
    keras_integration.uninstall()
    try:
        without = build_model()
        without.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    finally:
        keras_integration.install()
    assert max_relative_difference(plain.get_weights(), without.get_weights()) == 0.0
    with strategy_for("mirrored", 2).scope():
        distributed = build_model()
    distributed.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert distributed.train_function.__qualname__.startswith("make_host_function")


def test_central_storage_metrics_are_exact(data):
    # Without tfdist._compat.tf.configure_variable_creation(on_read_devices=...) the accuracy
    # and loss metrics grow without bound (keras-team/keras#21054); see the
    # next test, which shows the upstream behaviour.
    x, y = data
    reference = build_model()
    expected = reference.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    with strategy_for("central_storage", 4).scope():
        model = build_model()
    got = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert got["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-7)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_upstream_central_storage_metrics_are_wrong_without_the_workaround(data):
    # If this starts failing, upstream fixed keras-team/keras#21054 and the
    # workaround in tfdist._compat can be version-gated off.
    x, y = data
    expected = build_model().evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    plain = tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:0"
    )
    with plain.scope():
        model = build_model()
    got = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert abs(got["accuracy"] - expected["accuracy"]) > 1e-3


def test_strategies_of_different_sizes_in_one_process():
    # Without tfdist._compat.tf.isolate_collective_keys the second strategy joins
    # the first one's collective group (tensorflow/tensorflow#61314).
    results = []
    for n in (2, 4, 3):
        strategy = strategy_for("mirrored", n)

        def fn():
            return tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0))

        summed = tf.function(lambda s=strategy: s.experimental_local_results(s.run(fn))[0])
        results.append(float(summed()))
    assert results == [2.0, 4.0, 3.0]


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_tf_keras_model_under_step_options_it_would_ignore_is_refused_at_creation(name):
    # Before: precision="mixed_float16" left the layers in float32 and
    # accumulation_steps=2 stepped every batch, silently.
    tf_keras = pytest.importorskip("tf_keras")
    strategy = strategy_for(name, 2, precision="mixed_bfloat16", accumulation_steps=2)
    with strategy.scope():
        with pytest.raises(NotImplementedError) as info:
            tf_keras.Sequential([tf_keras.layers.Dense(4, input_shape=(8,))])
        assert str(info.value) == (
            f"tf-keras (Keras 2) models train under the {name!r} strategy as under tf.distribute's own, "
            "without tfdist's step, so its step options accumulation_steps=2, precision='mixed_bfloat16' "
            "would be ignored. Build the model with Keras 3 (`import keras`), or create the strategy "
            "without those options."
        )
        assert build_model().compiled  # Keras 3 models train with them
    # Options tf-keras honours (the input pipeline's) do not refuse it.
    with strategy_for(name, 2, prefetch_depth=4).scope():
        assert tf_keras.Sequential([tf_keras.layers.Dense(4, input_shape=(8,))]).built


@pytest.mark.parametrize("name", STRATEGIES)
def test_tf_keras_fit_under_tfdist_strategies(name, data):
    tf_keras = pytest.importorskip("tf_keras")
    x, y = data

    def build():
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential(
            [tf_keras.layers.Dense(32, activation="relu", input_shape=(64,)), tf_keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=tf_keras.optimizers.SGD(0.1),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    reference = build()
    ref_history = reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    with strategy_for(name, 2).scope():
        model = build()
    history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < PARITY_RTOL
    assert history.history["accuracy"][0] == pytest.approx(ref_history.history["accuracy"][0], abs=1e-6)


@pytest.mark.parametrize("name", STRATEGIES)
def test_train_test_and_predict_on_batch_match_single_device(name, data):
    x, y = data
    reference = build_model()
    with strategy_for(name, 2).scope():
        model = build_model()
    for start in range(0, 96, 32):
        ref_logs = reference.train_on_batch(x[start:start + 32], y[start:start + 32], return_dict=True)
        logs = model.train_on_batch(x[start:start + 32], y[start:start + 32], return_dict=True)
        assert logs["loss"] == pytest.approx(ref_logs["loss"], rel=1e-5)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < PARITY_RTOL
    ref_eval = reference.test_on_batch(x[:64], y[:64], return_dict=True)
    got = model.test_on_batch(x[:64], y[:64], return_dict=True)
    assert got["accuracy"] == pytest.approx(ref_eval["accuracy"], abs=1e-7)
    # predict_on_batch: Keras gives every replica the whole batch and
    # concatenates their outputs: 7 rows on 2 replicas came back as 14, rows
    # 7-13 repeating rows 0-6 (tf.distribute's MirroredStrategy alone does the same).
    np.testing.assert_allclose(model.predict_on_batch(x[:7]), reference.predict_on_batch(x[:7]), rtol=1e-5, atol=1e-6)
    assert model.predict_on_batch(x[:7]).shape == (7, 10)


def _embedding_model():
    """An Embedding (sparse gradients) under Adam: per-row second moments show a row sent once per replica."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        weighted_metrics=["accuracy"],
    )
    return model


def _on_batch_session(model, x, y, sample_weight):
    """train_on_batch and test_on_batch on batches of 16, 15 (odd over 2), 1 (fewer rows than replicas)."""
    logs = [
        model.train_on_batch(x[:16], y[:16]),
        model.train_on_batch(x[16:31], y[16:31], sample_weight=sample_weight[16:31]),
        model.train_on_batch(x[31:32], y[31:32]),
        model.train_on_batch(x[32:41], y[32:41], class_weight={0: 0.3, 1: 2.0}),
        model.test_on_batch(x[:15], y[:15], sample_weight=sample_weight[:15]),
        model.test_on_batch(x[:1], y[:1]),
    ]
    logs.append(list(model.train_on_batch(x[:16], y[:16], return_dict=True).values()))
    return logs


@pytest.mark.parametrize(
    "name, options",
    [("mirrored", {}), ("central_storage", {}), ("sharded_optimizer", {"stage": 1}), ("sharded_optimizer", {"stage": 3})],
)
def test_train_on_batch_splits_the_batch_so_embedding_adam_matches_one_device(name, options):
    # Keras (and stock MirroredStrategy) gives every replica the whole batch of
    # train_on_batch: an Embedding's sparse gradient then carried each row once
    # per replica at 1/N, and Adam's second moment summed N squares of g/N: the
    # Embedding was 0.139 off one device after one step on 2 replicas.
    rng = np.random.RandomState(0)
    x = rng.randint(1, 50, (41, 12)).astype("int32")
    y = (x[:, 0] < 25).astype("int32")
    sample_weight = rng.uniform(0.5, 2.0, 41).astype("float32")
    reference = _embedding_model()
    ref_logs = _on_batch_session(reference, x, y, sample_weight)
    with strategy_for(name, 2, **options).scope():
        model = _embedding_model()
    logs = _on_batch_session(model, x, y, sample_weight)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    for got, expected in zip(logs, ref_logs):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# Dropout and other integer layer state (issue 13). --------------------------

DROPOUT_SEED = 1234


class _InferenceDropout(keras.layers.Dropout):
    """A Dropout layer (with its seed generator) that is never in training mode."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=False)


def _convnet_with_dropout(rate=0.5, noise_shape=None, dropout=keras.layers.Dropout, optimizer=None):
    """keras-io mnist_convnet's layers on the 8x8 digits, compiled (default SGD); deterministic weights."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            dropout(rate, noise_shape=noise_shape, seed=DROPOUT_SEED),
            keras.layers.Dense(10),
        ]
    )
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _dropout_layer(model):
    return next(layer for layer in model.layers if isinstance(layer, keras.layers.Dropout))


def _state_copies(variable) -> list:
    value = variable.value
    if isinstance(value, tf.distribute.DistributedValues):
        return [v.numpy() for v in value.values]
    return [variable.numpy()]


@pytest.mark.parametrize("name", ["central_storage", "mirrored", "sharded_optimizer"])
def test_convnet_with_dropout_trains_and_seed_state_advances_once_per_step(name, data):
    x, y = data
    with strategy_for(name, 2).scope():
        model = _convnet_with_dropout(rate=0.5, optimizer=keras.optimizers.Adam(0.01))
    history = model.fit(x.reshape(-1, 8, 8, 1), y, batch_size=64, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses == sorted(losses, reverse=True)
    assert losses[-1] < losses[0] * 0.75
    # 4 epochs of 8 steps; the state is [seed, draws], as on one device.
    for copy in _state_copies(_dropout_layer(model).seed_generator.state):
        np.testing.assert_array_equal(copy, [DROPOUT_SEED, 32])


@pytest.mark.parametrize(
    "kind, dropout",
    [
        ("rate_0", dict(rate=0.0)),
        ("training_false", dict(rate=0.5, dropout=_InferenceDropout)),
        # One mask for the whole batch: each replica draws its own (replica 0
        # the one a single device draws), from a seed state that advances once
        # per step, exactly as on one device.
        ("batch_independent_mask", dict(rate=0.5, noise_shape=(1, 72))),
    ],
)
def test_central_storage_dropout_matches_single_device(kind, dropout, data):
    x, y = data
    x = x[:128].reshape(-1, 8, 8, 1)
    y = y[:128]
    reference = _convnet_with_dropout(**dropout)
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    with strategy_for("central_storage", 2).scope():
        model = _convnet_with_dropout(**dropout)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    if kind != "batch_independent_mask":
        assert max_relative_difference(reference.get_weights(), model.get_weights()) < PARITY_RTOL
    if dropout["rate"] > 0:
        np.testing.assert_array_equal(
            _dropout_layer(model).seed_generator.state.numpy(),
            _dropout_layer(reference).seed_generator.state.numpy(),
        )


def test_upstream_central_storage_fails_with_dropout_without_the_workaround(data):
    # If this starts failing, upstream made Keras's SeedGenerator state work
    # under CentralStorageStrategy and the ONLY_FIRST_REPLICA aggregation in
    # tfdist._compat.tf.configure_variable_creation can be version-gated off.
    x, y = data
    plain = tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:0"
    )
    with plain.scope():
        model = _convnet_with_dropout(rate=0.5)
    with pytest.raises(ValueError) as e:
        model.fit(x[:64].reshape(-1, 8, 8, 1), y[:64], batch_size=32, epochs=1, verbose=0)
    assert str(e.value).startswith("Exception encountered when calling Dropout.call().")
    assert "You must specify an aggregation method to update a AggregatingVariable in Replica Context." in str(e.value)


class _CallCounter(keras.layers.Layer):
    """Counts its training calls in integer state created with aggregation "none"."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, aggregation="none", name="calls")

    def call(self, x, training=False):
        if training:
            self.calls.assign_add(1)
        return x


@pytest.mark.parametrize(
    "name, aggregation",
    [("central_storage", tf.VariableAggregation.ONLY_FIRST_REPLICA), ("mirrored", tf.VariableAggregation.NONE)],
    ids=["central_storage", "mirrored"],
)
def test_integer_layer_state_counts_steps_as_on_one_device(name, aggregation, data):
    x, y = data
    with strategy_for(name, 2).scope():
        keras.utils.set_random_seed(0)
        counter = _CallCounter()
        model = keras.Sequential([keras.Input((64,)), counter, keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:256], y[:256], batch_size=32, epochs=2, verbose=0)
    assert counter.calls.value.aggregation == aggregation
    assert [int(c) for c in _state_copies(counter.calls)] == [16] * (1 if name == "central_storage" else 2)


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_a_failed_load_leaves_the_model_as_it_was_and_prints_no_tensor(name, tmp_path):
    # Keras loads layer by layer and raises at the end: the first layer of this
    # checkpoint fits, the second does not. Under tfdist nothing is overwritten,
    # and the error names the variable without printing its values.
    keras.utils.set_random_seed(1)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    with strategy_for(name, 2).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(5)])
        model.compile("adam", "mse")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError) as info:
        model.load_weights(path)
    message = str(info.value)
    assert "variable.shape=(3, 5), Received: value.shape=(3, 2)" in message
    assert f"Target variable: <Variable path={model.layers[1].kernel.path}, shape=(3, 5), dtype=float32>" in message
    assert "value=[" not in message
    for kept, now in zip(before, model.get_weights()):
        np.testing.assert_array_equal(kept, now)


def _conv_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3), keras.layers.Flatten(), keras.layers.Dense(3),
    ])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_an_empty_replica_share_under_a_conv_with_bias_names_the_cause_and_the_fixes():
    # TensorFlow's oneDNN kernel for Conv2DBackpropFilter fused with the bias
    # gradient returns no bias gradient for an empty batch. Plain Keras on one
    # device shows it when given an empty batch; under a strategy, 31 samples
    # in batches of 10 over 2 replicas end with a batch of 1, whose second
    # share is empty. Where the kernel has the fault, fit names the cause and
    # the fixes; where it has not (oneDNN off), fit trains.
    rng = np.random.RandomState(0)
    x, y = rng.normal(size=(31, 6, 6, 2)).astype("float32"), rng.randint(0, 3, 31)
    try:
        _conv_model().train_on_batch(x[:0], y[:0])
        upstream_fails = False
    except tf.errors.InternalError as error:
        assert "Missing 1-th output" in str(error)
        upstream_fails = True
    with strategy_for("mirrored", 2).scope():
        model = _conv_model()
    if upstream_fails:
        with pytest.raises(ValueError, match=r"fewer examples than the 2 replicas") as raised:
            model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
        assert "TF_ENABLE_ONEDNN_OPTS=0" in str(raised.value)
        assert "a last batch of 2 or more" in str(raised.value)
        # The fix works in the same process: every share of 30 in batches of 10 has 5 rows.
        before = int(model.optimizer.iterations.numpy())
        model.fit(x[:30], y[:30], batch_size=10, epochs=1, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == before + 3
    else:
        model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 4
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("name", ["mirrored", "sharded_optimizer"])
def test_int_and_float_of_an_optimizer_variable(name, data):
    # Keras's Variable.__int__ is int(self.value); a MirroredVariable has no
    # __int__, so int(model.optimizer.iterations) raised TypeError ("int()
    # argument must be ... not 'MirroredVariable'"), as under stock tf.distribute.
    x, y = data
    with strategy_for(name, 2).scope():
        model = build_model(optimizer=keras.optimizers.Adam(0.001))
    model.fit(x[:96], y[:96], batch_size=32, verbose=0)
    assert int(model.optimizer.iterations) == 3
    assert float(model.optimizer.iterations) == 3.0
    assert float(model.optimizer.learning_rate) == pytest.approx(0.001)


RANDOM_STRATEGIES = [
    ("mirrored", {}), ("central_storage", {}), ("sharded_optimizer", {}), ("sharded_optimizer", {"stage": 3}),
    ("mirrored", {"jit_compile": True}),
]


def _replica_dropout_masks(strategy, steps: int, seed: int = 7) -> list:
    """Each replica's dropout mask of one row of ones, per call of one traced step."""
    with strategy.scope():
        dropout = keras.layers.Dropout(0.5, seed=seed)

    @tf.function
    def step():
        return strategy.run(lambda: dropout(tf.ones((1, 64)), training=True))

    return [[m.numpy()[0] for m in strategy.experimental_local_results(step())] for _ in range(steps)]


@pytest.mark.parametrize("name, options", RANDOM_STRATEGIES[:3])
def test_each_replica_draws_its_own_dropout_mask_and_replica_0_one_devices(name, options):
    # Keras's SeedGenerator state is the same on every replica, so every replica
    # drew the same mask (one mask used N times over the global batch; stock
    # tf.distribute still does). Replica r > 0 now folds r into the seed;
    # replica 0 keeps it, so its mask is one device's for the first share.
    masks = _replica_dropout_masks(strategy_for(name, 2, **options), steps=2)
    one_device = keras.layers.Dropout(0.5, seed=7)
    for step, (first, second) in enumerate(masks):
        np.testing.assert_array_equal(first, one_device(tf.ones((2, 64)), training=True).numpy()[0])
        assert (first != second).sum() >= 16, step  # independent masks: ~32 of 64 differ
        folded = keras.random.SeedGenerator(0)
        state = tf.constant([7, step], tf.int64)
        folded.state.assign(tf.random.experimental.stateless_fold_in(state, tf.constant(1, tf.int64)))
        np.testing.assert_array_equal(second, keras.random.dropout(tf.ones((1, 64)), 0.5, seed=folded).numpy()[0])
    assert (masks[0][1] != masks[1][1]).sum() >= 16  # and a new mask every step
    # Not under a tfdist strategy: Keras's own draws, the same on every replica.
    stock = tf.distribute.MirroredStrategy(DEVICES[2])
    for first, second in _replica_dropout_masks(stock, steps=2):
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("name, options", RANDOM_STRATEGIES)
def test_fit_with_dropout_uses_a_mask_per_replica(name, options):
    # One SGD step of Dropout(0.5) -> Dense(1, zeros) on 4 rows of ones towards 1:
    # each kernel entry becomes lr * (sum of the 4 rows' mask values) / 2, one
    # of {0, 1, 2, 3, 4} * lr. With the mask repeated on both replicas' rows the
    # sum is even (the odd values never occur); with independent rows, as on one
    # device, about half the entries are odd.
    features = 4096
    strategy = strategy_for(name, 2, **options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((features,)), keras.layers.Dropout(0.5, seed=3),
                                  keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    model.fit(np.ones((4, features), np.float32), np.ones((4, 1), np.float32), batch_size=4, verbose=0)
    units = np.round(model.get_weights()[0][:, 0]).astype(int)
    assert set(np.unique(units)) <= {0, 1, 2, 3, 4}
    odd = float(np.mean(units % 2))
    assert 0.45 < odd < 0.55, odd


class _PadRagged(keras.layers.Layer):
    """Reads its input as ragged: pads each row to 6 tokens."""

    def call(self, tokens):
        return tokens.to_tensor(shape=[None, 6])

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 6)


def _ragged_text_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int64", ragged=True)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(_PadRagged()(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy")
    return model


@pytest.mark.parametrize("name, options", [("mirrored", {}), ("sharded_optimizer", {"stage": 3})])
def test_a_model_reading_ragged_inputs_builds_and_trains_like_one_device(name, options):
    # Under a strategy Keras builds the model before fit from dense stand-ins
    # for its inputs (one device builds in the traced step, on the real
    # ragged batch): "Unable to automatically build the model ...
    # 'SymbolicTensor' object has no attribute 'to_tensor'" (stock
    # MirroredStrategy: "'RaggedTensor' object has no attribute 'device'").
    rng = np.random.RandomState(0)
    lengths = rng.randint(1, 7, size=21)
    tokens = tf.RaggedTensor.from_row_lengths(rng.randint(1, 20, size=lengths.sum()).astype("int64"), lengths)
    labels = (lengths > 3).astype("float32")

    def run(strategy):
        dataset = tf.data.Dataset.from_tensor_slices((tokens, labels)).ragged_batch(8)
        if strategy is None:
            model = _ragged_text_model()
        else:
            with strategy.scope():
                model = _ragged_text_model()
        model.fit(dataset, epochs=2, verbose=0)
        return model, model.predict(dataset, verbose=0)

    one, one_predictions = run(None)
    model, predictions = run(strategy_for(name, 2, **options))
    assert max_relative_difference(one.get_weights(), model.get_weights()) < 1e-5
    np.testing.assert_allclose(predictions, one_predictions, rtol=1e-5, atol=1e-7)

"""tfdist.estimator.Estimator: training parity with Keras fit, evaluate, predict, export, checkpoints."""

from __future__ import annotations

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import build_model, max_relative_difference
from tests.estimator.digits import LOSS, input_fn_for, keras_weights_in_estimator_order, model_fn
from tests.strategies.parity import strategy_for
from tfdist import estimator as est

# float32 sums in a different order over 20 SGD steps; measured 0.0 (bit-identical) on this host.
PARITY_RTOL = 1e-5


def _estimator(tmp_path, strategy=None, params=None, **config):
    config.setdefault("tf_random_seed", 0)
    config.setdefault("log_step_count_steps", None)
    config.setdefault("save_summary_steps", None)
    return est.Estimator(model_fn, model_dir=str(tmp_path / "model"), params=params or {},
                         config=est.RunConfig(train_distribute=strategy, **config))


@pytest.mark.parametrize("name,replicas", [("mirrored", 4), ("central_storage", 2)])
def test_weights_match_keras_fit_under_the_same_strategy(name, replicas, digits, tmp_path):
    x, y = digits[0][:640], digits[1][:640]
    estimator = _estimator(tmp_path, strategy_for(name, replicas))
    estimator.train(input_fn_for(x, y), max_steps=20)
    with strategy_for(name, replicas).scope():
        model = build_model(seed=0)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert estimator.get_variable_value("global_step") == 20
    assert max_relative_difference(model.get_weights(), keras_weights_in_estimator_order(estimator)) < PARITY_RTOL


def test_without_a_strategy_matches_single_device_fit_with_momentum_and_uneven_last_batch(digits, tmp_path):
    # 100 examples in batches of 32: the last batch has 4; momentum makes optimizer state matter.
    x, y = digits[0][:100], digits[1][:100]
    optimizer_fn = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    estimator = _estimator(tmp_path, params={"optimizer_fn": optimizer_fn})
    estimator.train(input_fn_for(x, y), steps=50)  # the data ends after 4 steps
    model = build_model(seed=0, optimizer=optimizer_fn())
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert estimator.get_variable_value("global_step") == 4
    assert max_relative_difference(model.get_weights(), keras_weights_in_estimator_order(estimator)) < PARITY_RTOL


def test_training_resumes_from_the_checkpoint_with_optimizer_state(digits, tmp_path):
    x, y = digits[0][:320], digits[1][:320]
    params = {"optimizer_fn": lambda: keras.optimizers.Adam(1e-2)}
    once = _estimator(tmp_path / "a", params=params)
    once.train(input_fn_for(x, y), max_steps=10)
    once.train(input_fn_for(x[160:], y[160:]), max_steps=15)
    # A new Estimator (a restarted process) picks up at step 15.
    resumed = _estimator(tmp_path / "a", params=params)
    resumed.train(input_fn_for(x[:160], y[:160]), steps=5)
    straight = _estimator(tmp_path / "b", params=params)
    straight.train(input_fn_for(np.concatenate([x, x[160:], x[:160]]), np.concatenate([y, y[160:], y[:160]])),
                   max_steps=20)
    assert resumed.get_variable_value("global_step") == 20
    assert sorted(os.path.basename(p) for p in tf.train.get_checkpoint_state(resumed.model_dir).all_model_checkpoint_paths) == [
        "model.ckpt-10", "model.ckpt-15", "model.ckpt-20"]
    assert max_relative_difference(keras_weights_in_estimator_order(straight),
                                   keras_weights_in_estimator_order(resumed)) < PARITY_RTOL


def test_max_steps_at_or_below_the_checkpoint_step_does_nothing_and_says_so(digits, tmp_path, caplog):
    x, y = digits[0][:64], digits[1][:64]
    estimator = _estimator(tmp_path)
    estimator.train(input_fn_for(x, y), max_steps=2)
    before = estimator.get_variable_value("dense/kernel")

    def never_called():
        raise AssertionError("input_fn must not be called when there is nothing to do")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tfdist.estimator"):
        assert estimator.train(never_called, max_steps=1) is estimator
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING",
        f"Skipping training: the latest checkpoint in {estimator.model_dir} is at global step 2, which is "
        "already at or past max_steps=1. Nothing to do; raise max_steps to train further.")
    ]
    np.testing.assert_array_equal(estimator.get_variable_value("dense/kernel"), before)


def test_evaluate_reports_metric_results_loss_and_global_step(digits, tmp_path):
    x, y = digits
    estimator = _estimator(tmp_path, strategy_for("mirrored", 2), eval_distribute=strategy_for("mirrored", 2))
    estimator.train(input_fn_for(x[:320], y[:320]), max_steps=10)
    results = estimator.evaluate(input_fn_for(x[1000:1450], y[1000:1450], batch_size=50))
    logits = np.stack([p["logits"] for p in estimator.predict(input_fn_for(x[1000:1450], batch_size=64))])
    assert set(results) == {"accuracy", "loss", "global_step"}
    assert results["global_step"] == 10
    assert results["accuracy"] == pytest.approx(float(np.mean(np.argmax(logits, 1) == y[1000:1450])), abs=1e-7)
    assert results["loss"] == pytest.approx(float(LOSS(y[1000:1450], logits)), rel=1e-5)
    # steps= limits the batches.
    two = estimator.evaluate(input_fn_for(x[1000:1450], y[1000:1450], batch_size=50), steps=2)
    assert two["accuracy"] == pytest.approx(float(np.mean(np.argmax(logits[:100], 1) == y[1000:1100])), abs=1e-7)


def test_predict_yields_examples_in_order_and_export_serves_the_same(digits, tmp_path):
    x, y = digits
    estimator = _estimator(tmp_path, strategy_for("mirrored", 2))
    estimator.train(input_fn_for(x[:320], y[:320]), max_steps=10)
    predictions = list(estimator.predict(input_fn_for(x[:37], batch_size=10)))
    assert len(predictions) == 37 and set(predictions[0]) == {"class", "logits"}
    batches = list(estimator.predict(input_fn_for(x[:37], batch_size=10), predict_keys=["class"],
                                     yield_single_examples=False))
    assert [sorted(b) for b in batches] == [["class"]] * 4 and [len(b["class"]) for b in batches] == [10, 10, 10, 7]
    np.testing.assert_array_equal(np.concatenate([b["class"] for b in batches]), [p["class"] for p in predictions])
    receiver_fn = est.build_raw_serving_input_receiver_fn({"x": tf.TensorSpec([64], tf.float32)})

    def model_fn_dict(features, labels, mode, params):
        return model_fn(features["x"], labels, mode, params)

    exporter = est.Estimator(model_fn_dict, model_dir=estimator.model_dir, params={})
    path = exporter.export_saved_model(str(tmp_path / "export"), receiver_fn)
    assert os.path.dirname(path) == str(tmp_path / "export") and os.path.basename(path).isdigit()
    served = tf.saved_model.load(path).signatures["serving_default"](x=tf.constant(x[:37]))
    np.testing.assert_allclose(served["logits"].numpy(), np.stack([p["logits"] for p in predictions]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(served["class"].numpy(), [p["class"] for p in predictions])


def test_failed_restore_leaves_the_variables_as_they_were(digits, tmp_path):
    x, y = digits[0][:64], digits[1][:64]
    wide = _estimator(tmp_path / "wide", params={"hidden": 16})
    wide.train(input_fn_for(x, y), max_steps=1)
    narrow = _estimator(tmp_path / "narrow", params={"hidden": 8})
    narrow.train(input_fn_for(x, y), max_steps=2)
    graph = next(iter(narrow._graphs.values()))
    before = {k: v.numpy() for k, v in graph.store.variables.items()}
    with pytest.raises(ValueError) as info:
        graph.restore(wide.latest_checkpoint())
    assert str(info.value).startswith(f"Could not restore the checkpoint {wide.latest_checkpoint()}: ")
    assert str(info.value).endswith(
        "The estimator's variables were left as they were. Check that model_fn builds the same variables "
        "as the run that wrote the checkpoint, or point model_dir at a fresh directory.")
    for key, value in graph.store.variables.items():
        np.testing.assert_array_equal(value.numpy(), before[key])
    assert int(graph.global_step.numpy()) == 2


def test_summaries_and_progress_lines_every_n_steps(digits, tmp_path, caplog):
    x, y = digits[0][:320], digits[1][:320]
    estimator = _estimator(tmp_path, save_summary_steps=4, log_step_count_steps=5)
    with caplog.at_level(logging.INFO, logger="tfdist.estimator"):
        estimator.train(input_fn_for(x, y), max_steps=10)
    progress = [m for m in caplog.messages if m.startswith("global step ")]
    assert [m.split(":")[0] for m in progress] == ["global step 5/10", "global step 10/10"]
    assert all(" steps/s)" in m and "loss = " in m for m in progress)
    tags = {}
    for name in os.listdir(estimator.model_dir):
        if name.startswith("events.out.tfevents"):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(estimator.model_dir, name)):
                for value in event.summary.value:
                    tags.setdefault(value.tag, []).append(event.step)
    assert tags == {"loss": [4, 8], "global_step/sec": [4, 8]}


def test_train_op_callable_doing_its_own_update(digits, tmp_path):
    x, y = digits[0][:320], digits[1][:320]

    def own_update_model_fn(features, labels, mode):
        model = keras.Sequential([keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.1)
        with tf.GradientTape() as tape:
            loss = LOSS(labels, model(features))

        def train_op():
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        return est.EstimatorSpec(mode, loss=loss, train_op=train_op)

    estimator = est.Estimator(own_update_model_fn, model_dir=str(tmp_path), config=est.RunConfig(
        train_distribute=strategy_for("mirrored", 2), tf_random_seed=0, log_step_count_steps=None))
    estimator.train(input_fn_for(x, y), max_steps=10)
    with strategy_for("mirrored", 2).scope():
        model = build_model(seed=0)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    names = ["sequential/dense/kernel", "sequential/dense/bias", "sequential/dense_1/kernel",
             "sequential/dense_1/bias"]
    assert max_relative_difference(model.get_weights(), [estimator.get_variable_value(n) for n in names]) < PARITY_RTOL
    # evaluate reports the plain mean loss of the trained weights.
    assert estimator.evaluate(input_fn_for(x, y))["loss"] == pytest.approx(
        float(LOSS(y, model.predict(x, verbose=0))), rel=1e-5)


def test_input_fn_with_input_context_batches_per_replica(digits, tmp_path):
    x, y = digits[0][:320], digits[1][:320]
    seen = []

    def input_fn(params, mode, input_context):
        seen.append((mode, input_context.num_replicas_in_sync, input_context.get_per_replica_batch_size(32)))
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(input_context.get_per_replica_batch_size(32))

    sharded = _estimator(tmp_path / "ctx", strategy_for("mirrored", 2))
    sharded.train(input_fn, max_steps=5)
    assert seen == [("train", 2, 16)]
    assert sharded.get_variable_value("global_step") == 5


def test_batch_normalization_state_matches_keras_fit(digits, tmp_path):
    # Moving statistics are non-trainable state updated inside model_fn on every replica.
    x, y = digits[0][:640], digits[1][:640]

    def layers():
        return [keras.layers.Dense(32), keras.layers.BatchNormalization(), keras.layers.Activation("relu"),
                keras.layers.Dense(10)]

    def bn_model_fn(features, labels, mode):
        h = features
        for layer in layers():
            is_bn = isinstance(layer, keras.layers.BatchNormalization)
            h = layer(h, training=mode == est.ModeKeys.TRAIN) if is_bn else layer(h)
        return est.EstimatorSpec(mode, loss=LOSS(labels, h), optimizer=keras.optimizers.SGD(0.1))

    estimator = est.Estimator(bn_model_fn, model_dir=str(tmp_path), config=est.RunConfig(
        train_distribute=strategy_for("mirrored", 2), tf_random_seed=0, log_step_count_steps=None))
    estimator.train(input_fn_for(x, y), max_steps=20)
    keras.utils.set_random_seed(0)
    with strategy_for("mirrored", 2).scope():
        model = keras.Sequential([keras.Input((64,)), *layers()])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    names = ["dense/kernel", "dense/bias", "batch_normalization/gamma", "batch_normalization/beta",
             "batch_normalization/moving_mean", "batch_normalization/moving_variance", "dense_1/kernel",
             "dense_1/bias"]
    # Measured 3.5e-7: the moving averages are summed in another order.
    assert max_relative_difference(model.get_weights(), [estimator.get_variable_value(n) for n in names]) < PARITY_RTOL


def test_evaluate_without_a_checkpoint_says_it_uses_the_initial_variables(digits, tmp_path, caplog):
    estimator = _estimator(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tfdist.estimator"):
        results = estimator.evaluate(input_fn_for(digits[0][:64], digits[1][:64]))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"No checkpoint in model_dir {estimator.model_dir}: evaluating the initial variables."]
    assert results["global_step"] == 0

"""Bad input to tfdist.estimator fails early with the exact message."""

from __future__ import annotations

import re

import keras
import pytest
import tensorflow as tf

from tests.estimator.digits import LOSS, input_fn_for, model_fn
from tfdist import estimator as est


def _train(tmp_path, fn, digits, **kwargs):
    x, y = digits[0][:64], digits[1][:64]
    estimator = est.Estimator(fn, model_dir=str(tmp_path), config=est.RunConfig(log_step_count_steps=None))
    return estimator.train(input_fn_for(x, y), **kwargs)


def test_model_fn_without_loss_in_train_mode(tmp_path, digits):
    def no_loss(features, labels, mode):
        keras.layers.Dense(10)(features)
        return est.EstimatorSpec(mode, optimizer=keras.optimizers.SGD(0.1))

    with pytest.raises(ValueError, match=re.escape(
        "model_fn returned EstimatorSpec(mode='train') without a loss. In TRAIN mode the spec needs "
        "loss= and optimizer= (or train_op=). Received: loss=None"
    )):
        _train(tmp_path, no_loss, digits, max_steps=1)


def test_model_fn_with_loss_but_no_optimizer_or_train_op(tmp_path, digits):
    def no_update(features, labels, mode):
        return est.EstimatorSpec(mode, loss=LOSS(labels, keras.layers.Dense(10)(features)))

    with pytest.raises(ValueError, match=re.escape(
        "model_fn returned EstimatorSpec(mode='train') with neither optimizer= nor train_op=."
    )):
        _train(tmp_path, no_update, digits, max_steps=1)


def test_wrong_mode_key_in_the_spec(tmp_path, digits):
    def tf1_training_string(features, labels, mode):
        logits = keras.layers.Dense(10)(features)
        return est.EstimatorSpec("training", loss=LOSS(labels, logits), optimizer=keras.optimizers.SGD(0.1))

    with pytest.raises(ValueError, match=re.escape(
        "EstimatorSpec mode must be one of ModeKeys.TRAIN ('train'), ModeKeys.EVAL ('eval') or "
        "ModeKeys.PREDICT ('infer'). Received: mode='training'"
    )):
        _train(tmp_path, tf1_training_string, digits, max_steps=1)


def test_spec_for_another_mode_than_the_call(tmp_path, digits):
    def always_eval(features, labels, mode):
        return est.EstimatorSpec(est.ModeKeys.EVAL, loss=LOSS(labels, keras.layers.Dense(10)(features)))

    with pytest.raises(ValueError, match=re.escape(
        "model_fn was called with mode='train' but returned EstimatorSpec(mode='eval'). Pass the mode "
        "model_fn received: EstimatorSpec(mode, ...)."
    )):
        _train(tmp_path, always_eval, digits, max_steps=1)


def test_tf1_metric_pair_in_eval_metric_ops(tmp_path, digits):
    def tf1_metrics(features, labels, mode):
        logits = keras.layers.Dense(10)(features)
        loss = LOSS(labels, logits)
        return est.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": (loss, loss)})

    estimator = est.Estimator(tf1_metrics, model_dir=str(tmp_path))
    with pytest.raises(TypeError, match=re.escape(
        "eval_metric_ops['accuracy'] must be a keras.metrics.Metric. A (value, update_op) pair is TF1's "
        "tf.metrics style: create a keras.metrics object, call its update_state(...) in model_fn, and "
        "return the object. Received: tuple"
    )):
        estimator.evaluate(input_fn_for(digits[0][:64], digits[1][:64]))


def test_missing_model_dir():
    with pytest.raises(ValueError, match=re.escape(
        "Estimator needs a model_dir: the directory its checkpoints, summaries and evaluation results go "
        "to (and training resumes from). Pass Estimator(model_fn, model_dir=...) or "
        "RunConfig(model_dir=...). Received: model_dir=None"
    )):
        est.Estimator(model_fn, params={})


def test_a_model_dir_that_is_a_file_or_cannot_be_created_is_named(tmp_path, digits):
    # Both surfaced at train() as TensorFlow's summary-writer error, without the path:
    # "FailedPreconditionError: ... CreateSummaryFileWriter ... Not a directory".
    a_file = tmp_path / "weights.h5"
    a_file.write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(
        f"model_dir '{a_file}' is a file; the Estimator writes checkpoints and summaries into a directory "
        "there. Pass the path of a directory (it is created if missing)."
    )):
        est.Estimator(model_fn, model_dir=str(a_file))
    unwritable = est.Estimator(model_fn, model_dir=f"{a_file}/run")
    with pytest.raises(ValueError, match=re.escape(
        f"model_dir '{a_file}/run' cannot be created ("
    )) as info:
        unwritable.train(input_fn_for(digits[0][:64], digits[1][:64]), max_steps=1)
    assert str(info.value).endswith("Pass a directory this process can write (it is created if missing).")


def test_two_different_model_dirs(tmp_path):
    with pytest.raises(ValueError, match=re.escape(
        f"model_dir is set both in the Estimator and in its RunConfig, to different values. "
        f"Received: Estimator(model_dir='{tmp_path}/a'), RunConfig(model_dir='{tmp_path}/b')"
    )):
        est.Estimator(model_fn, model_dir=f"{tmp_path}/a", config=est.RunConfig(model_dir=f"{tmp_path}/b"),
                      params={})


def test_params_for_a_model_fn_without_params(tmp_path):
    def no_params(features, labels, mode):
        raise AssertionError("not called")

    with pytest.raises(ValueError, match=re.escape(
        "model_fn does not take a 'params' argument, but params were given to the Estimator: "
        "{'hidden': 8}. Add params to model_fn's arguments or drop them."
    )):
        est.Estimator(no_params, model_dir=str(tmp_path), params={"hidden": 8})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"steps": 5, "max_steps": 5}, "Estimator.train takes steps or max_steps, not both. Received: steps=5, max_steps=5"),
        ({"steps": 0}, "Estimator.train argument 'steps' must be a positive integer. Received: steps=0"),
        ({"max_steps": -1}, "Estimator.train argument 'max_steps' must be a positive integer. Received: max_steps=-1"),
    ],
)
def test_bad_steps(tmp_path, kwargs, message):
    estimator = est.Estimator(model_fn, model_dir=str(tmp_path), params={})
    with pytest.raises(ValueError, match=re.escape(message)):
        estimator.train(lambda: None, **kwargs)


def test_input_fn_not_returning_a_dataset(tmp_path):
    estimator = est.Estimator(model_fn, model_dir=str(tmp_path), params={})
    with pytest.raises(TypeError, match=re.escape(
        "input_fn must return a tf.data.Dataset of (features, labels) batches (or of features alone for "
        "predict). TF1 input_fns returning tensors or queues: wrap them in tf.data. Received: tuple"
    )):
        estimator.train(lambda: (tf.zeros([4, 64]), tf.zeros([4], tf.int32)), max_steps=1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"save_checkpoints_steps": 0}, "RunConfig argument 'save_checkpoints_steps' must be an integer >= 1 or None. Received: save_checkpoints_steps=0"),
        ({"save_checkpoints_steps": 10, "save_checkpoints_secs": 60}, "RunConfig takes save_checkpoints_steps or save_checkpoints_secs, not both. Received: save_checkpoints_steps=10, save_checkpoints_secs=60"),
        ({"keep_checkpoint_max": 0}, "RunConfig argument 'keep_checkpoint_max' must be an integer >= 1 or None. Received: keep_checkpoint_max=0"),
    ],
)
def test_bad_run_config(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        est.RunConfig(**kwargs)


def test_variables_must_be_the_same_on_every_call(tmp_path, digits):
    calls = []

    def grows(features, labels, mode):
        calls.append(mode)
        logits = keras.layers.Dense(10)(features)
        if len(calls) > 1:
            logits = keras.layers.Dense(10)(logits)
        return est.EstimatorSpec(mode, loss=LOSS(labels, logits), optimizer=keras.optimizers.SGD(0.1))

    with pytest.raises(RuntimeError, match=re.escape(
        "model_fn created a variable 'dense_1/kernel' that its first call in this mode did not create. "
        "model_fn must create the same variables on every call (build layers unconditionally, in the same order)."
    )):
        _train(tmp_path, grows, digits, max_steps=1)


def test_sharded_optimizer_is_refused_with_the_alternative(tmp_path, digits):
    import tfdist

    estimator = est.Estimator(model_fn, model_dir=str(tmp_path), params={}, config=est.RunConfig(
        train_distribute=tfdist.get_strategy("sharded_optimizer", devices=["/cpu:0", "/cpu:1"])))
    with pytest.raises(NotImplementedError, match=re.escape(
        "Strategy 'sharded_optimizer' is not supported by tfdist.estimator yet: it shards the optimizer "
        "state of a compiled Keras model (model.compile), and a model_fn has none. Use "
        "train_distribute='mirrored' (same replicas, full optimizer state per device)."
    )):
        estimator.train(input_fn_for(digits[0][:64], digits[1][:64]), max_steps=1)


def test_model_built_outside_model_fn_is_refused(tmp_path, digits):
    outside = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])

    def uses_global_model(features, labels, mode):
        return est.EstimatorSpec(mode, loss=LOSS(labels, outside(features)), optimizer=keras.optimizers.SGD(0.1))

    with pytest.raises(ValueError, match=re.escape(
        "model_fn created no trainable variables in TRAIN mode, so there is nothing to train. Build the "
        "Keras layers (or tf.Variables) inside model_fn: variables made outside it are neither placed by "
        "the strategy nor saved in model_dir's checkpoints."
    )):
        _train(tmp_path, uses_global_model, digits, max_steps=1)


def test_invalid_tf_config_is_named(monkeypatch):
    from tfdist.cluster import ClusterConfigError

    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ClusterConfigError, match=re.escape(
        "TF_CONFIG: is not valid JSON (Expecting property name enclosed in double quotes at line 1 "
        "column 2). Received: TF_CONFIG='{not json'"
    )):
        est.RunConfig()

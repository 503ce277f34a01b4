"""The host loop of parameter-server training: Keras `fit`/`evaluate`/`predict` on the chief.

The chief is the coordinating process: the `chief` task of the cluster, or the
current process when the strategy's `cluster_resolver` names no task (a
cluster of worker and ps jobs only, as in TensorFlow's tutorial).

Keras owns the callbacks, progress bar and history; this module owns what a
parameter-server job changes about the loop:

* data: every worker iterates its own copy of the input
  (`ClusterCoordinator.create_per_worker_dataset`), so an epoch is a number of
  steps summed over workers (`steps_per_epoch`), not a pass over the data;
* steps: the chief schedules closures of `steps_per_execution` steps on
  whichever worker is free and only waits for them at the end of an epoch, so
  per-batch callbacks see the schedule, not finished steps, and get no logs;
  epoch-end logs are the metrics over all of the epoch's steps;
* the update (gradient path `PARAMETER_SERVER`): the engine's `TrainStep`
  with nothing to reduce — a worker computes its gradient, the transform
  chain clips it, and the update template applies it to the variables on the
  ps tasks at once (`InPlace`), without waiting for other workers
  (asynchronous training);
* failures: a worker that dies is the coordinator's business (it reschedules
  the closure and resumes the worker when it returns); a ps task that dies
  loses variables, so fit stops with `ParameterServerError`;
* evaluate and predict run on the chief itself, reading the variables from the
  ps tasks: exact and deterministic.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine import update
from tfdist.engine.loop import HostLoop
from tfdist.engine.step import GradientPath


class ParameterServerError(RuntimeError):
    """A ps task failed during training; its variables are lost, so the job must restart."""


# ---------------------------------------------------------------------------
# The step on a worker.
# ---------------------------------------------------------------------------


def parameter_server(step, data) -> None:
    """Gradient path: the worker's gradient goes straight to the variables on the ps tasks.

    The synchronous step's phases with nothing to reduce: the worker's own
    gradient (taken with respect to each shard of a partitioned variable,
    `TrainStep.gradient_sources`), the same transform chain (clipping), and
    the update placed `InPlace` on the ps variables, unsynchronised.
    """
    grads = step.strategy.run(lambda batch: step.finish(step.compute_gradients(batch)), args=(data,))
    step.apply(grads)


# Each worker writes the ps variables from its own step, unsynchronised
# (each variable's update locked on its ps task, `LockedInPlace`).
PARAMETER_SERVER = GradientPath("parameter_server", parameter_server, lambda strategy: update.LockedInPlace())


# Step options the parameter-server step honours; the others must keep their defaults.
# bucket_bytes, transfer and prefetch_depth shape cross-device traffic this strategy does not have.
_SUPPORTED_STEP_OPTIONS = ("bucket_bytes", "sink_size", "transfer", "prefetch_depth")


def steps_per_closure(model) -> int:
    """Steps per scheduled closure: the `sink_size` step option, else `steps_per_execution`."""
    sink = getattr(model.distribute_strategy.options, "sink_size", None)
    if sink == "epoch":
        raise NotImplementedError(
            "sink_size='epoch' under strategy 'parameter_server' would hand a whole epoch to one "
            "worker. Use an integer sink_size (steps per scheduled closure). Received: sink_size='epoch'"
        )
    return int(sink) if sink else int(model.steps_per_execution)


def unsupported_feature(feature: str, model) -> str | None:
    """`ParameterServerStrategy.unsupported`: what the asynchronous step does not run, and why.

    Workers step asynchronously, each on its own batch: there is no global
    batch to accumulate over, to synchronise statistics over, or to compile
    collectives around; each worker applies its gradient to the ps variables
    itself.
    """
    from tfdist.options import STEP_OPTIONS

    asynchronous = (
        "under strategy 'parameter_server' is not supported: workers update the variables "
        "asynchronously, one batch at a time, with no global batch. Use a synchronous strategy "
        "(mirrored, multi_worker, ...) for this feature."
    )
    if model is None:  # a question about the strategy alone ("estimator"): it runs
        return None
    options = model.distribute_strategy.options
    if feature == "accumulation_steps":
        return f"accumulation_steps={options.accumulation_steps} {asynchronous}"
    if feature == "jit_compile":
        return f"jit_compile=True {asynchronous}"
    if feature == "synchronized_batchnorm":
        return f"BatchNormalization(synchronized=True) {asynchronous}"
    if feature == "step_options":
        for name, value in options.as_dict().items():
            if name not in _SUPPORTED_STEP_OPTIONS and value != STEP_OPTIONS[name].default:
                return (
                    f"Step option {name!r} is not supported under strategy 'parameter_server' yet; "
                    f"leave it at its default ({STEP_OPTIONS[name].default!r}). Received: {name}={value!r}"
                )
        return None
    if feature == "custom_train_step":
        return (
            "A custom train_step under strategy 'parameter_server' is not supported: tfdist's "
            "step applies each worker's gradient to the variables on the ps tasks itself. "
            f"Received: {type(model).__name__}.train_step overridden"
        )
    if feature == "loss_scale_optimizer":
        return (
            "LossScaleOptimizer under strategy 'parameter_server' is not supported. "
            "Train in float32 or mixed_bfloat16."
        )
    if feature in ("keras_accumulation", "ema"):
        return (
            "Optimizer(gradient_accumulation_steps=...) and Optimizer(use_ema=True) are not "
            "supported under strategy 'parameter_server': workers update the ps variables "
            "asynchronously, one step at a time."
        )
    return None


def _make_closure(model) -> Callable:
    """The function a worker runs per scheduled closure: `steps` engine training steps."""
    from tfdist.engine.step import TrainStep

    step = TrainStep(model)

    def closure(iterator, steps):
        for _ in tf.range(steps):
            step(next(iterator))

    return closure if model.run_eagerly else tf.function(closure)


# ---------------------------------------------------------------------------
# Input.
# ---------------------------------------------------------------------------

_PY_OPS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


def _python_op(dataset: tf.data.Dataset) -> str | None:
    """The first op in `dataset`'s graph that calls back into this Python process, if any."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(tfc.dataset_graph_def(dataset))
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    for node in nodes:
        if node.op in _PY_OPS:
            return node.op
    return None


def _check_per_worker_safe(dataset: tf.data.Dataset, what: str) -> None:
    op = _python_op(dataset)
    if op is not None:
        raise ValueError(
            f"{what} is not per-worker-safe: it runs Python code of the chief process (op {op!r}, "
            "from Dataset.from_generator, tf.py_function or tf.numpy_function), and under strategy "
            "'parameter_server' every worker builds its own copy of the input, where that Python "
            "code does not exist. Build the dataset from tensors or files instead, e.g. "
            "tf.data.Dataset.from_tensor_slices(...) or tf.data.TFRecordDataset(...)."
        )


class PerWorkerInput:
    """The input of one `fit`: a chief-local dataset (for shapes) and the per-worker iterator.

    Args:
        strategy: the `ParameterServerStrategy`.
        x, y, sample_weight, batch_size, shuffle: as `model.fit` takes them;
            `x` is a `tf.data.Dataset`, a dataset function taking a
            `tf.distribute.InputContext`, or arrays.
        steps_per_epoch: Optional int. Steps per epoch over all workers.
    """

    def __init__(self, strategy, x, y=None, sample_weight=None, batch_size=None, shuffle=True, steps_per_epoch=None):
        self.strategy = strategy
        if isinstance(x, tf.data.Dataset):
            self._check_no_targets(y, sample_weight)
            local = x
            dataset_fn = None
            what = "The dataset passed to fit"
        elif callable(x) and not isinstance(x, (np.ndarray, tf.Tensor)):
            self._check_no_targets(y, sample_weight)
            context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
            local = x(context)
            if not isinstance(local, tf.data.Dataset):
                raise TypeError(
                    "A dataset function passed to fit must return a tf.data.Dataset. "
                    f"Received: {type(local).__name__} from {x!r}"
                )
            dataset_fn = x
            what = f"The dataset built by {getattr(x, '__name__', repr(x))}"
        else:
            arrays = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
            local = tf.data.Dataset.from_tensor_slices(arrays)
            if shuffle:
                local = local.shuffle(len(x), reshuffle_each_iteration=True)
            local = local.batch(batch_size or 32)
            dataset_fn = None
            what = "The arrays passed to fit"
        _check_per_worker_safe(local, what)
        cardinality = int(local.cardinality())
        if steps_per_epoch is None:
            if cardinality == tf.data.INFINITE_CARDINALITY:
                raise ValueError(
                    "fit under strategy 'parameter_server' needs `steps_per_epoch` for infinite "
                    "data: each worker iterates its own copy of the input, so an epoch has no end "
                    "of its own. Pass steps_per_epoch=N (steps per epoch, summed over workers). "
                    "Received: steps_per_epoch=None with an infinite dataset"
                )
            if cardinality == tf.data.UNKNOWN_CARDINALITY:
                raise ValueError(
                    "fit under strategy 'parameter_server' needs `steps_per_epoch` when the number "
                    "of batches is unknown (after filter() or from files, for example): each worker "
                    "iterates its own copy of the input. Pass steps_per_epoch=N (steps per epoch, "
                    "summed over workers). Received: steps_per_epoch=None, dataset cardinality unknown"
                )
            steps_per_epoch = cardinality
        self.steps_per_epoch = steps_per_epoch
        self.local = local
        # Workers never run out: an epoch ends after `steps_per_epoch` steps, whoever ran them.
        repeat = cardinality != tf.data.INFINITE_CARDINALITY
        if dataset_fn is None:
            per_worker = local.repeat() if repeat else local
            distributed = strategy.experimental_distribute_dataset(per_worker)
        else:

            def worker_fn(context):
                dataset = dataset_fn(context)
                return dataset.repeat() if repeat else dataset

            distributed = lambda: strategy.distribute_datasets_from_function(worker_fn)  # noqa: E731
        self.iterator = iter(strategy.coordinator.create_per_worker_dataset(distributed))

    @staticmethod
    def _check_no_targets(y, sample_weight):
        if y is not None or sample_weight is not None:
            raise ValueError(
                "When x is a dataset or a dataset function, its elements carry the targets: "
                f"do not pass y or sample_weight. Received: y={type(y).__name__}, "
                f"sample_weight={type(sample_weight).__name__}"
            )

    def first_batch(self):
        return next(iter(self.local))


def _local_dataset(x, y=None, sample_weight=None, batch_size=None, steps=None, what="evaluate"):
    """The chief-local dataset for evaluate/predict."""
    if isinstance(x, tf.data.Dataset):
        dataset = x
    elif callable(x) and not isinstance(x, (np.ndarray, tf.Tensor)):
        dataset = x(tf.distribute.InputContext())
    else:
        arrays = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
        dataset = tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size or 32)
    if steps is not None:
        dataset = dataset.take(steps)
    elif dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(f"{what} on infinite data needs `steps`. Received: steps=None with an infinite dataset")
    return dataset


# ---------------------------------------------------------------------------
# Failures.
# ---------------------------------------------------------------------------

_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


def _raise_if_ps_failure(error: Exception, strategy, epoch: int):
    """Turns the coordinator's error after a ps task died into `ParameterServerError`."""
    message = str(error)
    if not isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
                              tf.errors.NotFoundError, tf.errors.FailedPreconditionError, tf.errors.InternalError)):
        return
    match = _PS_TASK.search(message)
    if match is None and "/job:ps" not in message:
        return
    task = int(match.group(1)) if match else None
    addresses = strategy.cluster["ps"]
    where = f"ps task {task} ({addresses[task]})" if task is not None and task < len(addresses) else "a ps task"
    raise ParameterServerError(
        f"Training stopped in epoch {epoch}: {where} became unavailable, and the variables it "
        "held are lost. Restart the job; with keras.callbacks.BackupAndRestore(backup_dir) in "
        "fit's callbacks, training resumes from the last completed epoch. "
        f"TensorFlow reported: {type(error).__name__}: {message.splitlines()[0] if message else ''}"
    ) from error


# ---------------------------------------------------------------------------
# fit / evaluate / predict.
# ---------------------------------------------------------------------------


def _check_chief(strategy, method: str) -> None:
    if strategy.task_type != "chief":
        raise ValueError(
            f"model.{method} under strategy 'parameter_server' runs on the chief (the coordinating "
            f"process) only. Received: model.{method} in task {strategy.task_type!r}"
        )


def fit(
    model,
    x=None,
    y=None,
    batch_size=None,
    epochs=1,
    verbose="auto",
    callbacks=None,
    validation_split=0.0,
    validation_data=None,
    shuffle=True,
    class_weight=None,
    sample_weight=None,
    initial_epoch=0,
    steps_per_epoch=None,
    validation_steps=None,
    validation_batch_size=None,
    validation_freq=1,
):
    """Keras `model.fit` for a model compiled under a tfdist `ParameterServerStrategy`.

    Takes the arguments of `keras.Model.fit`. `x` is a `tf.data.Dataset`, a
    dataset function `fn(input_context) -> tf.data.Dataset` (built on every
    worker), or arrays. `steps_per_epoch` counts steps over all workers; it
    is required when the data is infinite or its length unknown. Returns the
    `History`.
    """
    strategy = model.distribute_strategy
    _check_chief(strategy, "fit")
    kc.assert_compile_called(model, "fit")
    if class_weight is not None:
        raise NotImplementedError(
            "class_weight under strategy 'parameter_server' is not supported; weight the "
            "samples in the dataset instead (elements (x, y, sample_weight))."
        )
    if validation_split:
        raise NotImplementedError(
            "validation_split under strategy 'parameter_server' is not supported; pass "
            f"validation_data. Received: validation_split={validation_split}"
        )
    data = PerWorkerInput(strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
    with strategy.scope():
        kc.symbolic_build(model, data.first_batch())
    steps = data.steps_per_epoch
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            verbose=1 if verbose == "auto" else verbose,
            epochs=epochs,
            steps=steps,
            model=model,
        )
    # Saves during fit (BackupAndRestore, ModelCheckpoint) are atomic as for
    # every tfdist model (`tfdist.checkpointing`): a ps task dying mid-save
    # leaves the previous file whole.
    return _fit_loop(
        model, strategy, data, callbacks, epochs, initial_epoch, validation_data, validation_freq,
        validation_steps, validation_batch_size or batch_size,
    )


def _fit_loop(model, strategy, data, callbacks, epochs, initial_epoch, validation_data, validation_freq,
              validation_steps, validation_batch_size):
    steps = data.steps_per_epoch
    per_call = steps_per_closure(model)
    closure = _make_closure(model)
    coordinator = strategy.coordinator
    model.stop_training = False
    callbacks.on_train_begin()
    training_logs = None
    epoch = kc.resume_epoch(model, initial_epoch)
    try:
        while epoch < epochs:
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            done = 0
            while done < steps and not model.stop_training:
                n = min(per_call, steps - done)
                callbacks.on_train_batch_begin(done)
                coordinator.schedule(closure, args=(data.iterator, n))
                done += n
                callbacks.on_train_batch_end(done - 1, {})
            coordinator.join()
            epoch_logs = kc.pythonify_logs(model.get_metrics_result())
            if validation_data is not None and kc.should_eval(model, epoch, validation_freq):
                val_x, val_y, val_w = (
                    kc.unpack_data(validation_data)
                    if isinstance(validation_data, tuple)
                    else (validation_data, None, None)
                )
                val_logs = evaluate(
                    model, val_x, val_y, batch_size=validation_batch_size,
                    sample_weight=val_w, steps=validation_steps, callbacks=callbacks,
                    return_dict=True, verbose=0,
                )
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            epoch += 1
            if model.stop_training:
                break
    except Exception as e:  # noqa: BLE001 (re-raised as is unless a ps task failed)
        # A ps failure surfaces wherever the chief next touches a variable:
        # scheduling, join, resetting or reading metrics, a callback.
        _raise_if_ps_failure(e, strategy, epoch)
        raise
    callbacks.on_train_end(logs=training_logs)
    return model.history


def _local_test_function(model):
    # Keras's own (or the model's overridden) test_step, run on the chief.
    def test(data):
        model.test_step(data)

    return test if model.run_eagerly else tf.function(test, reduce_retracing=True)


def evaluate(
    model,
    x=None,
    y=None,
    batch_size=None,
    verbose="auto",
    sample_weight=None,
    steps=None,
    callbacks=None,
    return_dict=False,
    **kwargs: Any,
):
    """Keras `model.evaluate` on the chief, reading the variables from the ps tasks."""
    strategy = model.distribute_strategy
    _check_chief(strategy, "evaluate")
    kc.assert_compile_called(model, "evaluate")
    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    dataset = _local_dataset(x, y, sample_weight, batch_size, steps)
    with strategy.scope():
        kc.symbolic_build(model, next(iter(dataset)))
    num_batches = int(dataset.cardinality()) if dataset.cardinality() >= 0 else None
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_progbar=verbose != 0, verbose=1 if verbose == "auto" else verbose,
            epochs=1, steps=num_batches, model=model,
        )
    test = getattr(model, "_tfdist_ps_test", None)
    if test is None:
        test = model._tfdist_ps_test = _local_test_function(model)
    model.stop_evaluating = False
    callbacks.on_test_begin()
    model.reset_metrics()
    logs = {}
    for i, batch in enumerate(dataset):
        callbacks.on_test_batch_begin(i)
        test(batch)
        logs = model.get_metrics_result()
        callbacks.on_test_batch_end(i, logs)
        if model.stop_evaluating:
            break
    logs = kc.pythonify_logs(kc.metrics_result_or_logs(model, logs))
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return kc.flatten_metrics_in_order(model, logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """Keras `model.predict` on the chief, reading the variables from the ps tasks."""
    strategy = model.distribute_strategy
    _check_chief(strategy, "predict")
    dataset = _local_dataset(x, None, None, batch_size, steps, what="predict")
    forward = getattr(model, "_tfdist_ps_predict", None)
    if forward is None:

        def forward(data):
            return model.predict_step(data)

        forward = model._tfdist_ps_predict = forward if model.run_eagerly else tf.function(forward)
    outputs = [forward(batch) for batch in dataset]
    return tf.nest.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *outputs)


def steps_for(num_examples: int, batch_size: int) -> int:
    """Steps per epoch (over all workers) that see `num_examples` once on average."""
    return math.ceil(num_examples / batch_size)


# A ClusterCoordinator job: tfdist schedules the steps; Keras's fit cannot drive one.
COORDINATOR = HostLoop("coordinator", fit=fit, evaluate=evaluate, predict=predict)

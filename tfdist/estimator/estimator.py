"""`Estimator`: TF1's model_fn/input_fn runner on TensorFlow 2 and Keras 3 strategies.

One `Estimator` runs a user's `model_fn` under up to two strategies (training,
evaluation). For each it keeps a `_Graph`: the `model_fn`'s variables (a
`VariableStore`), the global step, the optimizer, and a compiled function per
mode. As in TF1, every `train`, `evaluate`, `predict` and `export_saved_model`
call starts from the latest checkpoint in `model_dir`, so the graphs never
need to share variables: checkpoints carry the state between them (and
between processes).

Training reuses the step engine: `_ModelFnStep` is a `tfdist.engine.TrainStep`
built from parts (strategy, optimizer, variables) whose forward pass is the
`model_fn`, so gradients take the strategy's own gradient path (fused
all-reduce, reduce to the parameter device, or the strategy's own
`GradientPath`) and the update is `tfdist.engine.update.apply_update`. Under a tfdist
parameter-server strategy each worker runs the same step (its gradient taken per shard,
the transform chain, the update in place on the ps variables).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras as kc
from tfdist.engine.step import TrainStep, _scale
from tfdist.estimator.estimator_spec import EstimatorSpec, check_spec, predictions_as_dict
from tfdist.estimator.mode_keys import ModeKeys
from tfdist.estimator.run_config import RunConfig, resolve_strategy
from tfdist.estimator.variable_store import VariableStore
from tfdist.strategies.base import is_tfdist_strategy

logger = logging.getLogger("tfdist.estimator")

CHECKPOINT_NAME = "model.ckpt"


def _ensure_visible_logging() -> None:
    """Shows progress on stderr when the program has not configured logging.

    A long training run that prints nothing looks hung; TF1 users set
    `tf.logging.set_verbosity(INFO)`. If the program configured logging
    (root handlers, or handlers on our logger), that configuration wins.
    """
    if logger.handlers or logging.getLogger().handlers:
        if logger.level == logging.NOTSET and logging.getLogger().level > logging.INFO:
            logger.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s tfdist.estimator %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # TensorFlow may configure the root logger later; print each line once.
    logger.propagate = False


def _arg_names(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _split(element) -> tuple[Any, Any]:
    """`(features, labels)` from one dataset element (labels `None` if absent)."""
    if isinstance(element, tuple) and len(element) == 2:
        return element
    if isinstance(element, tuple) and len(element) == 1:
        return element[0], None
    return element, None


def _is_parameter_server(strategy) -> bool:
    # Stock ParameterServerStrategy too: the runner drives any through a ClusterCoordinator.
    return getattr(strategy, "asynchronous", False) or isinstance(
        strategy, tf.distribute.experimental.ParameterServerStrategy
    )


def _batch_size(features) -> tf.Tensor:
    flat = [t for t in tf.nest.flatten(features) if t is not None]
    return tf.shape(flat[0])[0]


def _relaxed_spec(value):
    """A `tf.TensorSpec` for `value` with an unknown batch dimension."""
    shape = value.shape
    if shape.rank:
        shape = tf.TensorShape([None]).concatenate(shape[1:])
    return tf.TensorSpec(shape, value.dtype)


class _Peeked:
    """An iterator with its first element taken out, and put back."""

    def __init__(self, iterator):
        self._iterator = iterator
        self.first = next(iterator)
        self._pending = True

    def __iter__(self):
        return self

    def __next__(self):
        if self._pending:
            self._pending = False
            return self.first
        return next(self._iterator)


class _ModelFnStep(TrainStep):
    """The engine's training step with the `model_fn` as forward pass.

    Built from parts (`TrainStep.from_parts`: the strategy, the optimizer and
    the `model_fn`'s trainable variables; no Keras model). Only phase 1
    differs from Keras `fit`'s step: `compute_gradients` runs `model_fn` on
    the replica's batch and weights the gradient of its loss (a mean over the
    replica's batch) by the batch size. Reduction, loss scaling, clipping,
    accumulation and the update are the engine's.
    """

    @classmethod
    def build(cls, graph: _Graph, optimizer, variables: list) -> _ModelFnStep:
        return cls.from_parts(graph.strategy, optimizer, variables, _graph=graph)

    def compute_gradients(self, data) -> list:
        features, labels = _split(data)
        loss_scale = getattr(self, "loss_scale", None)
        factor = getattr(getattr(self, "update_optimizer", self.optimizer), "loss_scale_factor", None)
        with tf.GradientTape() as tape:
            spec = self._graph.call_model_fn(features, labels, ModeKeys.TRAIN)
            scaled = loss_scale.scale_loss(spec.loss) if loss_scale else spec.loss
            if factor is not None:
                scaled = scaled * factor
        grads = self.gradients(tape, scaled)
        weight = tf.cast(_batch_size(features), tf.float32)
        self._graph.accumulate_loss(spec.loss, weight)
        # The parameter-server runner returns each step's loss to the chief.
        self.last_loss = spec.loss
        return [_scale(g, weight) for g in grads] + [weight]


class _Graph:
    """A `model_fn` built under one strategy: variables, global step, optimizer, functions."""

    def __init__(self, estimator: Estimator, strategy: tf.distribute.Strategy):
        self.estimator = estimator
        self.strategy = strategy
        self.store = VariableStore()
        self.records: dict[str, Any] = {}
        self.specs: dict[str, EstimatorSpec] = {}
        self.functions: dict[str, Callable] = {}
        self.optimizer: keras.optimizers.Optimizer | None = None
        with strategy.scope():
            self.global_step = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="global_step",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            if _is_parameter_server(strategy):
                # Asynchronous steps return their losses to the chief instead.
                self.loss_sum = self.loss_weight = None
                return
            # Per-replica sums, added on read: the mean loss since the last read.
            self.loss_sum = tf.Variable(0.0, trainable=False, name="loss_sum",
                                        synchronization=tf.VariableSynchronization.ON_READ,
                                        aggregation=tf.VariableAggregation.SUM)
            self.loss_weight = tf.Variable(0.0, trainable=False, name="loss_weight",
                                           synchronization=tf.VariableSynchronization.ON_READ,
                                           aggregation=tf.VariableAggregation.SUM)

    # -- model_fn ----------------------------------------------------------
    def call_model_fn(self, features, labels, mode: str, allow_creation: bool = False,
                      keras_loss_convention: bool = False) -> EstimatorSpec:
        """Calls `model_fn` on the store's variables.

        The spec's loss is the mean over the replica's batch, unless
        `keras_loss_convention` (a `train_op` doing its own update, as a Keras
        custom `train_step` does): then Keras loss objects divide it by the
        replica count, as Keras's optimizer expects.
        """
        unscaled = contextlib.nullcontext() if keras_loss_convention else kc.keras_losses_unscaled()
        with self.store.call(allow_creation=allow_creation) as record, unscaled:
            spec = self.estimator._call_model_fn(features, labels, mode)
        if allow_creation:
            self.records[mode] = record
        return spec

    def accumulate_loss(self, loss, weight) -> None:
        if self.loss_sum is None:
            return
        self.loss_sum.assign_add(tf.math.multiply_no_nan(tf.cast(loss, tf.float32), weight))
        self.loss_weight.assign_add(weight)

    def read_loss(self) -> tuple[float, float]:
        """`(sum of loss * batch size, sum of batch sizes)` since the last read; resets both."""
        total, weight = float(self.loss_sum.read_value()), float(self.loss_weight.read_value())
        self.loss_sum.assign(0.0)
        self.loss_weight.assign(0.0)
        return total, weight

    def build(self, mode: str, example) -> None:
        """Creates the variables of `mode` by tracing `model_fn` once on `example`'s shapes."""
        if mode in self.records:
            return
        features, labels = _split(example)
        feature_specs = tf.nest.map_structure(_relaxed_spec, features)
        label_specs = None if labels is None else tf.nest.map_structure(_relaxed_spec, labels)
        seed = self.estimator.config.tf_random_seed
        if seed is not None and not self.records:
            keras.utils.set_random_seed(seed)
        built = []

        def trace(f, lbl):
            # tf.function may trace twice; only the first call creates.
            first = not built
            spec = self.call_model_fn(f, lbl, mode, allow_creation=first)
            built.append(spec)
            if mode == ModeKeys.TRAIN and spec.optimizer is None and callable(spec.train_op):
                # The update's own state (optimizer slots) is created here, in
                # replica context where the update runs, not in the step.
                def replica_fn(f, lbl):
                    with self.store.call(allow_creation=first):
                        self.estimator._call_model_fn(f, lbl, mode).train_op()

                self.strategy.run(replica_fn, args=(f, lbl))
            return tf.constant(0)

        with self.strategy.scope():
            tf.function(trace, autograph=False).get_concrete_function(feature_specs, label_specs)
            spec = built[0]
            self.specs[mode] = spec
            if mode == ModeKeys.TRAIN and not self.records[mode].trainable_variables:
                raise ValueError(
                    "model_fn created no trainable variables in TRAIN mode, so there is nothing to "
                    "train. Build the Keras layers (or tf.Variables) inside model_fn: variables made "
                    "outside it are neither placed by the strategy nor saved in model_dir's checkpoints."
                )
            if mode == ModeKeys.TRAIN and spec.optimizer is not None and self.optimizer is None:
                self.optimizer = spec.optimizer
                self.optimizer.build(self.records[mode].trainable_variables)

    # -- checkpoints -------------------------------------------------------
    def _metric_variables(self) -> set[int]:
        ids = set()
        for spec in self.specs.values():
            for metric in (spec.eval_metric_ops or {}).values():
                for v in metric.variables:
                    ids.add(id(getattr(v, "value", v)))
        return ids

    def checkpoint_variables(self) -> dict[str, tf.Variable]:
        excluded = self._metric_variables()
        return {k: v for k, v in self.store.variables.items() if id(v) not in excluded}

    def checkpoint(self) -> tf.train.Checkpoint:
        kwargs = {"global_step": self.global_step, "model": self.checkpoint_variables()}
        if self.optimizer is not None:
            kwargs["optimizer"] = self.optimizer
        return tf.train.Checkpoint(**kwargs)

    def all_checkpointed(self) -> list:
        variables = [self.global_step, *self.checkpoint_variables().values()]
        if self.optimizer is not None:
            variables.extend(getattr(v, "value", v) for v in self.optimizer.variables)
        return variables

    def restore(self, path: str) -> None:
        """Restores `path`; on any failure puts every variable back as it was and raises."""
        variables = self.all_checkpointed()
        with self.strategy.scope():
            backup = [tf.identity(v.read_value()) for v in variables]
        try:
            status = self.checkpoint().restore(path)
            status.expect_partial()
            keys = _checkpoint_keys(path)
            missing = [k for k in self.checkpoint_variables()
                       if f"model/{_escape(k)}/.ATTRIBUTES/VARIABLE_VALUE" not in keys]
            if missing:
                stored = sum(1 for k in keys if k.startswith("model/") and k.endswith("VARIABLE_VALUE"))
                raise ValueError(f"the checkpoint has no value for variable {missing[0]!r} "
                                 f"(it has {stored} model variables)")
        except Exception as e:
            with self.strategy.scope():
                for v, b in zip(variables, backup):
                    v.assign(b)
            raise ValueError(
                f"Could not restore the checkpoint {path}: {e}. The estimator's variables were left "
                "as they were. Check that model_fn builds the same variables as the run that wrote "
                "the checkpoint, or point model_dir at a fresh directory."
            ) from None


def _escape(key: str) -> str:
    # tf.train.Checkpoint escapes '/' in dependency names as '.S' (and '.' as '..').
    return key.replace(".", "..").replace("/", ".S")


def _checkpoint_keys(path: str) -> set[str]:
    return {name for name, _ in tf.train.list_variables(path)}


def checkpoint_global_step(path: str) -> int:
    """The global step stored in the checkpoint `path`."""
    return int(tf.train.load_checkpoint(path).get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))


class Estimator:
    """Runs a TF1-style `model_fn` and `input_fn` for training, evaluation, prediction and export.

    Args:
        model_fn: callable `model_fn(features, labels, mode, params, config)`
            returning an `EstimatorSpec`; `params` and `config` are optional
            arguments. It builds its computation from Keras layers (and plain
            `tf.Variable`s): the variables are created on the first call and
            the same ones are reused on every later call.
        model_dir: str. Directory for checkpoints, TensorBoard summaries and
            evaluation results; required here or in `config`.
        config: Optional `RunConfig`. Default `RunConfig()`.
        params: Optional dict passed to `model_fn` (and to an `input_fn` that
            takes `params`). Default `None`.

    Raises:
        ValueError: no `model_dir`, two different ones, or `params` given to a
            `model_fn` without a `params` argument.

    Example:

    ```python
    estimator = Estimator(model_fn, model_dir="/tmp/digits",
                          config=RunConfig(train_distribute=tfdist.get_strategy("mirrored")))
    estimator.train(train_input_fn, max_steps=1000)
    metrics = estimator.evaluate(eval_input_fn)   # {"accuracy": ..., "loss": ..., "global_step": 1000}
    ```
    """

    def __init__(self, model_fn: Callable, model_dir: str | None = None,
                 config: RunConfig | None = None, params: dict | None = None):
        if not callable(model_fn):
            raise TypeError(f"Estimator argument 'model_fn' must be callable. Received: {model_fn!r}")
        self._model_fn_args = _arg_names(model_fn)
        if "features" not in self._model_fn_args and not (
            {"args"} & self._model_fn_args or len(self._model_fn_args) >= 3
        ):
            raise ValueError(
                "model_fn must take (features, labels, mode[, params][, config]). "
                f"Received a model_fn with arguments {sorted(self._model_fn_args)}"
            )
        if params is not None and "params" not in self._model_fn_args:
            raise ValueError(
                f"model_fn does not take a 'params' argument, but params were given to the Estimator: "
                f"{params!r}. Add params to model_fn's arguments or drop them."
            )
        if config is None:
            config = RunConfig()
        elif not isinstance(config, RunConfig):
            raise TypeError(f"Estimator argument 'config' must be a tfdist.estimator.RunConfig. "
                            f"Received: {type(config).__name__}")
        if model_dir is not None and config.model_dir is not None and \
                os.path.abspath(os.fspath(model_dir)) != os.path.abspath(config.model_dir):
            raise ValueError(
                "model_dir is set both in the Estimator and in its RunConfig, to different values. "
                f"Received: Estimator(model_dir={os.fspath(model_dir)!r}), "
                f"RunConfig(model_dir={config.model_dir!r})"
            )
        model_dir = os.fspath(model_dir) if model_dir is not None else config.model_dir
        if model_dir is None:
            raise ValueError(
                "Estimator needs a model_dir: the directory its checkpoints, summaries and "
                "evaluation results go to (and training resumes from). Pass "
                "Estimator(model_fn, model_dir=...) or RunConfig(model_dir=...). Received: model_dir=None"
            )
        self._model_fn = model_fn
        if os.path.exists(model_dir) and not os.path.isdir(model_dir):
            raise ValueError(
                f"model_dir {model_dir!r} is a file; the Estimator writes checkpoints and summaries into "
                "a directory there. Pass the path of a directory (it is created if missing)."
            )
        self._model_dir = model_dir
        self._config = config.replace(model_dir=model_dir)
        self._params = dict(params or {})
        self._graphs: dict[int, _Graph] = {}
        self._strategies: dict[str, tf.distribute.Strategy] = {}

    @property
    def model_dir(self) -> str:
        return self._model_dir

    @property
    def config(self) -> RunConfig:
        return self._config

    @property
    def params(self) -> dict:
        return dict(self._params)

    @property
    def model_fn(self) -> Callable:
        return self._model_fn

    # -- plumbing ------------------------------------------------------------
    def _call_model_fn(self, features, labels, mode) -> EstimatorSpec:
        kwargs = {}
        if "labels" in self._model_fn_args:
            kwargs["labels"] = labels
        elif labels is not None:
            raise ValueError("model_fn does not take a 'labels' argument, but input_fn returned labels.")
        if "mode" in self._model_fn_args:
            kwargs["mode"] = mode
        if "params" in self._model_fn_args:
            kwargs["params"] = self._params
        if "config" in self._model_fn_args:
            kwargs["config"] = self._config
        if "features" in self._model_fn_args:
            return check_spec(self._model_fn(features=features, **kwargs), mode)
        return check_spec(self._model_fn(features, **kwargs), mode)

    def _strategy(self, which: str) -> tf.distribute.Strategy:
        if which not in self._strategies:
            value = self._config.train_distribute if which == "train" else self._config.eval_distribute
            if which == "train" and value is None:
                # One device, through the same engine step as every strategy.
                from tfdist.devices import default_devices
                from tfdist.registry import get_strategy

                value = get_strategy("mirrored", devices=default_devices()[:1])
            self._strategies[which] = resolve_strategy(value)
        return self._strategies[which]

    def _graph(self, strategy: tf.distribute.Strategy) -> _Graph:
        if id(strategy) not in self._graphs:
            self._graphs[id(strategy)] = _Graph(self, strategy)
        return self._graphs[id(strategy)]

    def _input_dataset(self, input_fn: Callable, mode: str, input_context=None) -> tf.data.Dataset:
        """Calls `input_fn` with the arguments it takes; checks it returned a dataset."""
        names = _arg_names(input_fn)
        kwargs = {}
        if "params" in names:
            kwargs["params"] = self._params
        if "mode" in names:
            kwargs["mode"] = mode
        if "config" in names:
            kwargs["config"] = self._config
        if "input_context" in names:
            kwargs["input_context"] = input_context
        result = input_fn(**kwargs)
        if not isinstance(result, tf.data.Dataset):
            raise TypeError(
                "input_fn must return a tf.data.Dataset of (features, labels) batches (or of "
                "features alone for predict). TF1 input_fns returning tensors or queues: wrap "
                f"them in tf.data. Received: {type(result).__name__}"
            )
        return result

    def _dataset(self, input_fn: Callable, mode: str, strategy: tf.distribute.Strategy):
        if "input_context" in _arg_names(input_fn):
            return strategy.distribute_datasets_from_function(
                lambda ctx: self._input_dataset(input_fn, mode, ctx))
        dataset = self._input_dataset(input_fn, mode)
        if strategy is tf.distribute.get_strategy():
            return dataset
        return strategy.experimental_distribute_dataset(dataset)

    def latest_checkpoint(self) -> str | None:
        """The path of the newest checkpoint in `model_dir`, or `None`."""
        return tf.train.latest_checkpoint(self._model_dir)

    def get_variable_names(self) -> list[str]:
        """Names of the model variables in the latest checkpoint (as `get_variable_value` takes)."""
        path = self._require_checkpoint("get_variable_names")
        names = []
        for key in sorted(_checkpoint_keys(path)):
            if key.startswith("model/") and key.endswith("/.ATTRIBUTES/VARIABLE_VALUE"):
                escaped = key[len("model/"):-len("/.ATTRIBUTES/VARIABLE_VALUE")]
                names.append(escaped.replace(".S", "/").replace("..", "."))
        return names + ["global_step"]

    def get_variable_value(self, name: str) -> np.ndarray:
        """The value of variable `name` (e.g. `"dense/kernel"`) in the latest checkpoint."""
        path = self._require_checkpoint("get_variable_value")
        key = "global_step" if name == "global_step" else f"model/{_escape(name)}"
        try:
            return tf.train.load_checkpoint(path).get_tensor(f"{key}/.ATTRIBUTES/VARIABLE_VALUE")
        except (tf.errors.NotFoundError, ValueError):
            raise ValueError(f"No variable {name!r} in {path}. Variables: {self.get_variable_names()}") from None

    def _require_checkpoint(self, what: str) -> str:
        path = self.latest_checkpoint()
        if path is None:
            raise ValueError(f"Estimator.{what}() reads the latest checkpoint, but model_dir "
                             f"{self._model_dir!r} has none yet. Train first.")
        return path

    # -- train -------------------------------------------------------------
    def train(self, input_fn: Callable, hooks=None, steps: int | None = None,
              max_steps: int | None = None, saving_listeners=None) -> Estimator:
        """Trains the model on `input_fn`'s data, resuming from the latest checkpoint.

        Args:
            input_fn: callable returning a `tf.data.Dataset` of `(features,
                labels)` batches; may take `params`, `mode`, `config` and
                `input_context` (then it is called once per worker and batches
                per replica: `input_context.get_per_replica_batch_size(global)`).
                Without `input_context` it batches the global batch, which the
                strategy splits over replicas.
            hooks: not supported; must be `None` (TF1 SessionRunHooks have no
                session to run in).
            steps: Optional int. Train this many more steps (or until the data
                ends).
            max_steps: Optional int. Train until the global step reaches this;
                if the latest checkpoint is already there, nothing is done.
            saving_listeners: Optional list of callables `f(global_step,
                checkpoint_path)` called after each checkpoint is saved.

        Returns:
            `self`, for chaining.

        Raises:
            ValueError: both or invalid `steps`/`max_steps`, or a `model_fn`
                or checkpoint problem (the message names it).
        """
        if hooks:
            raise ValueError("Estimator.train(hooks=...) is not supported: TF1 SessionRunHooks need a "
                             "tf.compat.v1.Session. Use RunConfig(log_step_count_steps=..., "
                             "save_summary_steps=...) for progress, saving_listeners for checkpoints.")
        if steps is not None and max_steps is not None:
            raise ValueError(f"Estimator.train takes steps or max_steps, not both. "
                             f"Received: steps={steps}, max_steps={max_steps}")
        for name, value in (("steps", steps), ("max_steps", max_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"Estimator.train argument '{name}' must be a positive integer. "
                                 f"Received: {name}={value!r}")
        _ensure_visible_logging()
        try:
            tf.io.gfile.makedirs(self._model_dir)
        except (OSError, tf.errors.OpError) as error:
            raise ValueError(
                f"model_dir {self._model_dir!r} cannot be created ({getattr(error, 'message', None) or error}). "
                "Pass a directory this process can write (it is created if missing)."
            ) from error
        latest = self.latest_checkpoint()
        if max_steps is not None and latest is not None:
            saved = checkpoint_global_step(latest)
            if saved >= max_steps:
                logger.warning(
                    "Skipping training: the latest checkpoint in %s is at global step %d, "
                    "which is already at or past max_steps=%d. Nothing to do; raise max_steps to train further.",
                    self._model_dir, saved, max_steps,
                )
                return self
        strategy = self._strategy("train")
        graph = self._graph(strategy)
        reason = strategy.unsupported("estimator") if is_tfdist_strategy(strategy) else None
        if reason is not None:
            raise NotImplementedError(reason)
        if _is_parameter_server(strategy):
            return self._train_parameter_server(graph, input_fn, latest, steps, max_steps, saving_listeners)
        try:
            iterator = _Peeked(iter(self._dataset(input_fn, ModeKeys.TRAIN, strategy)))
        except StopIteration:
            logger.warning("input_fn returned an empty dataset; nothing to train on.")
            return self
        graph.build(ModeKeys.TRAIN, _first_local(strategy, iterator.first))
        start = self._restore_for_training(graph, latest)
        target = start + steps if steps is not None else max_steps
        step_fn = self._train_function(graph)

        def step_once() -> bool:
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                return False
            step_fn(data)
            return True

        _TrainLoop(self, graph, target, list(saving_listeners or [])).run(step_once, graph.read_loss, start)
        return self

    def _restore_for_training(self, graph: _Graph, latest: str | None) -> int:
        if latest is not None:
            graph.restore(latest)
            logger.info("Restored %s (global step %d).", latest, int(graph.global_step.numpy()))
        return int(graph.global_step.numpy())

    def _train_parameter_server(self, graph: _Graph, input_fn, latest, steps, max_steps, saving_listeners):
        """Asynchronous training: the chief schedules steps; each worker reads its own input."""
        if steps is None and max_steps is None:
            raise ValueError(
                "Under strategy 'parameter_server', Estimator.train needs steps or max_steps: every "
                "worker reads its own copy of the input (make it repeat), so 'until the data ends' "
                "is not defined. Received: steps=None, max_steps=None"
            )
        strategy = graph.strategy
        coordinator = strategy.coordinator

        def dataset_fn(input_context=None):
            return self._input_dataset(input_fn, ModeKeys.TRAIN, input_context)

        graph.build(ModeKeys.TRAIN, dataset_fn(tf.distribute.InputContext()).element_spec)
        if graph.optimizer is None:
            raise NotImplementedError(
                "EstimatorSpec(train_op=...) under strategy 'parameter_server' is not supported: the "
                "runner applies each worker's gradients to the ps variables itself. Return optimizer=.")
        start = self._restore_for_training(graph, latest)
        target = start + steps if steps is not None else max_steps
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        worker_fn = self._parameter_server_function(graph)
        pending = []

        def step_once() -> bool:
            pending.append(coordinator.schedule(worker_fn, args=(iterator,)))
            return True

        def read_loss() -> tuple[float, float]:
            losses = [float(r.fetch()) for r in pending]
            pending.clear()
            return sum(losses), float(len(losses))

        _TrainLoop(self, graph, target, list(saving_listeners or [])).run(
            step_once, read_loss, start, sync=coordinator.join)
        return self

    def _parameter_server_function(self, graph: _Graph) -> Callable:
        strategy, optimizer = graph.strategy, graph.optimizer
        variables = graph.records[ModeKeys.TRAIN].trainable_variables
        if is_tfdist_strategy(strategy):
            # The engine's step: the worker's gradient (per shard of a
            # partitioned variable), the transform chain (clipping), the
            # update template applied in place on the ps variables.
            with strategy.scope():
                step = _ModelFnStep.build(graph, optimizer, variables)

            def worker_fn(iterator):
                step(next(iterator))
                graph.global_step.assign_add(1)
                return step.last_loss

            return tf.function(worker_fn, autograph=False)

        # TensorFlow's own ParameterServerStrategy: Keras's optimizer.
        def replica_fn(data):
            features, labels = _split(data)
            with tf.GradientTape() as tape:
                spec = graph.call_model_fn(features, labels, ModeKeys.TRAIN)
            grads = tape.gradient(spec.loss, variables)
            optimizer.apply_gradients(zip(grads, variables))
            return spec.loss

        def worker_fn(iterator):
            loss = strategy.run(replica_fn, args=(next(iterator),))
            graph.global_step.assign_add(1)
            return loss

        return tf.function(worker_fn, autograph=False)

    def _train_function(self, graph: _Graph) -> Callable:
        if ModeKeys.TRAIN in graph.functions:
            return graph.functions[ModeKeys.TRAIN]
        strategy = graph.strategy
        variables = graph.records[ModeKeys.TRAIN].trainable_variables
        if graph.optimizer is not None and is_tfdist_strategy(strategy):
            with strategy.scope():
                step = _ModelFnStep.build(graph, graph.optimizer, variables)

            def train_step(data):
                step(data)
                graph.global_step.assign_add(1)
        elif graph.optimizer is not None:
            # A strategy that is not tfdist's: Keras's optimizer sums the
            # replicas' gradients itself, so each replica's loss is 1/N of it.
            optimizer = graph.optimizer

            def replica_fn(data):
                features, labels = _split(data)
                with tf.GradientTape() as tape:
                    spec = graph.call_model_fn(features, labels, ModeKeys.TRAIN)
                    loss = spec.loss / strategy.num_replicas_in_sync
                grads = tape.gradient(loss, variables)
                optimizer.apply_gradients(zip(grads, variables))
                graph.accumulate_loss(spec.loss, tf.cast(_batch_size(features), tf.float32))

            def train_step(data):
                with strategy.scope():
                    strategy.run(replica_fn, args=(data,))
                    graph.global_step.assign_add(1)
        else:
            def replica_fn(data):
                features, labels = _split(data)
                spec = graph.call_model_fn(features, labels, ModeKeys.TRAIN, keras_loss_convention=True)
                if callable(spec.train_op):
                    spec.train_op()
                # Undo Keras's 1/replicas for the logged loss.
                graph.accumulate_loss(spec.loss * strategy.num_replicas_in_sync,
                                      tf.cast(_batch_size(features), tf.float32))

            def train_step(data):
                with strategy.scope():
                    strategy.run(replica_fn, args=(data,))
                    graph.global_step.assign_add(1)

        graph.functions[ModeKeys.TRAIN] = tf.function(train_step, reduce_retracing=True, autograph=False)
        return graph.functions[ModeKeys.TRAIN]

    # -- evaluate ----------------------------------------------------------
    def evaluate(self, input_fn: Callable, steps: int | None = None, hooks=None,
                 checkpoint_path: str | None = None, name: str | None = None) -> dict[str, Any]:
        """Evaluates the latest checkpoint (or `checkpoint_path`) on `input_fn`'s data.

        Args:
            input_fn: as for `train`; called with `mode=ModeKeys.EVAL`.
            steps: Optional int. Evaluate on this many batches (default: until
                the data ends).
            hooks: not supported; must be `None`.
            checkpoint_path: Optional str. A checkpoint to evaluate instead of
                the latest.
            name: Optional str. Results go to `model_dir/eval_<name>` instead
                of `model_dir/eval`, to keep several evaluations apart.

        Returns:
            dict: each `eval_metric_ops` name mapped to its metric's
            `result()` (a float, or an array for non-scalar metrics), `"loss"`
            (mean of the spec's loss over all examples) and `"global_step"`.
        """
        if hooks:
            raise ValueError("Estimator.evaluate(hooks=...) is not supported: TF1 SessionRunHooks need a "
                             "tf.compat.v1.Session.")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
            raise ValueError(f"Estimator.evaluate argument 'steps' must be a positive integer or None. "
                             f"Received: steps={steps!r}")
        _ensure_visible_logging()
        strategy = self._strategy("eval")
        graph = self._graph(strategy)
        try:
            iterator = _Peeked(iter(self._dataset(input_fn, ModeKeys.EVAL, strategy)))
        except StopIteration:
            raise ValueError("Estimator.evaluate: input_fn returned an empty dataset.") from None
        graph.build(ModeKeys.EVAL, _first_local(strategy, iterator.first))
        path = checkpoint_path or self.latest_checkpoint()
        if path is None:
            logger.warning("No checkpoint in model_dir %s: evaluating the initial variables.", self._model_dir)
        else:
            graph.restore(path)
        metrics = graph.specs[ModeKeys.EVAL].eval_metric_ops or {}
        with strategy.scope():
            for metric in metrics.values():
                metric.reset_state()
            graph.read_loss()
        eval_step = self._eval_function(graph)
        done = 0
        for data in iterator:
            eval_step(data)
            done += 1
            if steps is not None and done >= steps:
                break
        with strategy.scope():
            results = {k: _to_python(m.result()) for k, m in metrics.items()}
            total, weight = graph.read_loss()
        results["loss"] = total / weight if weight else math.nan
        results["global_step"] = int(graph.global_step.numpy())
        logger.info("Evaluation at global step %d on %d batches: %s", results["global_step"], done,
                    ", ".join(f"{k} = {v}" for k, v in sorted(results.items())))
        self._write_eval_summaries(results, name)
        return results

    def _eval_function(self, graph: _Graph) -> Callable:
        if ModeKeys.EVAL not in graph.functions:
            strategy = graph.strategy

            def replica_fn(data):
                features, labels = _split(data)
                spec = graph.call_model_fn(features, labels, ModeKeys.EVAL)
                graph.accumulate_loss(spec.loss, tf.cast(_batch_size(features), tf.float32))

            def eval_step(data):
                with strategy.scope():
                    strategy.run(replica_fn, args=(data,))

            graph.functions[ModeKeys.EVAL] = tf.function(eval_step, reduce_retracing=True, autograph=False)
        return graph.functions[ModeKeys.EVAL]

    def eval_dir(self, name: str | None = None) -> str:
        """Where `evaluate(name=...)` writes its summaries: `model_dir/eval[_name]`."""
        return os.path.join(self._model_dir, "eval" if not name else f"eval_{name}")

    def _write_eval_summaries(self, results: dict, name: str | None) -> None:
        if not self._config.is_chief and self._config.task_type != "evaluator":
            return
        writer = tf.summary.create_file_writer(self.eval_dir(name))
        with writer.as_default():
            for key, value in results.items():
                if key != "global_step" and np.ndim(value) == 0:
                    tf.summary.scalar(key, float(value), step=results["global_step"])
        writer.close()

    # -- predict -------------------------------------------------------------
    def predict(self, input_fn: Callable, predict_keys=None, hooks=None,
                checkpoint_path: str | None = None, yield_single_examples: bool = True) -> Iterator:
        """Yields predictions of the latest checkpoint (or `checkpoint_path`) on `input_fn`'s features.

        Args:
            input_fn: callable returning a `tf.data.Dataset` of feature
                batches (labels, if present, are ignored).
            predict_keys: Optional list of str: only these keys of a dict of
                predictions. Default: all.
            hooks: not supported; must be `None`.
            checkpoint_path: Optional str. A checkpoint to use instead of the
                latest.
            yield_single_examples: bool. Yield one example at a time (default),
                else whole batches.

        Yields:
            A NumPy value per example (or batch); a dict of them when
            `predictions` is a dict.
        """
        if hooks:
            raise ValueError("Estimator.predict(hooks=...) is not supported.")
        strategy = self._strategy("eval")
        graph = self._graph(strategy)
        try:
            iterator = _Peeked(iter(self._dataset(input_fn, ModeKeys.PREDICT, strategy)))
        except StopIteration:
            return
        graph.build(ModeKeys.PREDICT, (_split(_first_local(strategy, iterator.first))[0],))
        path = checkpoint_path or self.latest_checkpoint()
        if path is None:
            logger.warning("No checkpoint in model_dir %s: predicting with the initial variables.",
                           self._model_dir)
        else:
            graph.restore(path)
        single = not isinstance(graph.specs[ModeKeys.PREDICT].predictions, dict)
        predict_step = self._predict_function(graph)
        for data in iterator:
            outputs = predict_step(data)
            batch = {}
            for key, value in outputs.items():
                if predict_keys is not None and key not in predict_keys:
                    continue
                parts = strategy.experimental_local_results(value)
                batch[key] = np.concatenate([np.asarray(p) for p in parts], axis=0)
            if not yield_single_examples:
                yield batch["output"] if single else batch
                continue
            size = len(next(iter(batch.values())))
            for i in range(size):
                yield batch["output"][i] if single else {k: v[i] for k, v in batch.items()}

    def _predict_function(self, graph: _Graph) -> Callable:
        if ModeKeys.PREDICT not in graph.functions:
            strategy = graph.strategy

            def replica_fn(data):
                features, _ = _split(data)
                spec = graph.call_model_fn(features, None, ModeKeys.PREDICT)
                return predictions_as_dict(spec.predictions)

            def predict_step(data):
                with strategy.scope():
                    return strategy.run(replica_fn, args=(data,))

            graph.functions[ModeKeys.PREDICT] = tf.function(predict_step, reduce_retracing=True, autograph=False)
        return graph.functions[ModeKeys.PREDICT]

    # -- export ------------------------------------------------------------
    def export_saved_model(self, export_dir_base: str, serving_input_receiver_fn: Callable,
                           checkpoint_path: str | None = None) -> str:
        """Writes a SavedModel serving the PREDICT-mode `model_fn` at the latest checkpoint.

        Args:
            export_dir_base: str. The SavedModel goes to a new subdirectory
                named by the Unix time, as in TF1.
            serving_input_receiver_fn: callable returning a
                `ServingInputReceiver` (see `build_raw_serving_input_receiver_fn`).
            checkpoint_path: Optional str. A checkpoint to export instead of
                the latest.

        Returns:
            str: the SavedModel's directory. `tf.saved_model.load(path)
            .signatures["serving_default"](**inputs)` returns the
            predictions (or `export_outputs`) as a dict.
        """
        from tfdist.estimator.export import write_saved_model

        path = checkpoint_path or self._require_checkpoint("export_saved_model")
        graph = _Graph(self, tf.distribute.get_strategy())
        return write_saved_model(graph, export_dir_base, serving_input_receiver_fn, path)


def _first_local(strategy, value):
    """One replica's share of a distributed value (or the value itself)."""
    return tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0]
        if isinstance(v, tf.distribute.DistributedValues) else v,
        value,
    )


def _to_python(value):
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array


class _TrainLoop:
    """The host loop of `Estimator.train`: steps, progress, summaries, checkpoints."""

    def __init__(self, estimator: Estimator, graph: _Graph, target: int | None, listeners: list):
        self.estimator = estimator
        self.graph = graph
        self.config = estimator.config
        self.target = target
        self.listeners = listeners
        self.extended = graph.strategy.extended

    def _manager(self, directory: str) -> tf.train.CheckpointManager:
        return tf.train.CheckpointManager(self.graph.checkpoint(), directory,
                                          max_to_keep=self.config.keep_checkpoint_max,
                                          checkpoint_name=CHECKPOINT_NAME)

    def save(self, step: int) -> str | None:
        """Saves a checkpoint; every worker saves (it may run collectives), only the chief keeps it."""
        if self.extended.should_checkpoint:
            path = self._manager(self.estimator.model_dir).save(checkpoint_number=step)
            logger.info("Saved checkpoint for global step %d: %s", step, path)
            for listener in self.listeners:
                listener(step, path)
            return path
        temp = tempfile.mkdtemp(prefix="tfdist_estimator_")
        try:
            self._manager(temp).save(checkpoint_number=step)
        finally:
            shutil.rmtree(temp, ignore_errors=True)
        return None

    def run(self, step_once: Callable[[], bool], read_loss: Callable[[], tuple], start: int,
            sync: Callable[[], None] = lambda: None) -> None:
        """Runs steps until the target step or the end of the data.

        Args:
            step_once: runs (or schedules) one step; `False` when the data ended.
            read_loss: `(sum of loss * weight, sum of weights)` since the last call.
            start: the global step training starts from.
            sync: waits for scheduled steps (before a checkpoint is saved).
        """
        cfg = self.config
        step = start
        writer = None
        if cfg.save_summary_steps and self.extended.should_save_summary:
            writer = tf.summary.create_file_writer(self.estimator.model_dir)
        tick_step, tick_time = step, time.monotonic()
        last_save_step, last_save_time = step, time.monotonic()
        saved = False
        loss_total = loss_weight = 0.0
        logger.info("Training from global step %d%s on %s (%d replica(s)); checkpoints in %s.",
                    start, f" to {self.target}" if self.target is not None else " until the data ends",
                    type(self.graph.strategy).__name__, self.graph.strategy.num_replicas_in_sync,
                    self.estimator.model_dir)
        try:
            while self.target is None or step < self.target:
                if not step_once():
                    logger.info("input_fn's data ended at global step %d.", step)
                    break
                step += 1
                log_due = cfg.log_step_count_steps and step % cfg.log_step_count_steps == 0
                summary_due = cfg.save_summary_steps and step % cfg.save_summary_steps == 0
                if log_due or summary_due:
                    total, weight = read_loss()
                    loss_total, loss_weight = loss_total + total, loss_weight + weight
                    now = time.monotonic()
                    rate = (step - tick_step) / max(now - tick_time, 1e-9)
                    loss = loss_total / loss_weight if loss_weight else math.nan
                    if log_due:
                        logger.info("global step %d%s: loss = %.6g (%.1f steps/s)", step,
                                    f"/{self.target}" if self.target is not None else "", loss, rate)
                    if summary_due and writer is not None:
                        with writer.as_default():
                            tf.summary.scalar("loss", loss, step=step)
                            tf.summary.scalar("global_step/sec", rate, step=step)
                        writer.flush()
                    tick_step, tick_time = step, now
                    loss_total = loss_weight = 0.0
                if (cfg.save_checkpoints_steps and step % cfg.save_checkpoints_steps == 0) or (
                    cfg.save_checkpoints_secs and time.monotonic() - last_save_time >= cfg.save_checkpoints_secs
                    # Workers' clocks differ; in a cluster, saves follow the step count.
                    and cfg.task_type is None
                ):
                    sync()
                    self.save(step)
                    saved = True
                    last_save_step, last_save_time = step, time.monotonic()
        finally:
            if writer is not None:
                writer.close()
        sync()
        # Decided from this run alone, so that every worker of a job saves equally often.
        if step != last_save_step or not saved:
            self.save(step)
        logger.info("Training finished at global step %d.", step)

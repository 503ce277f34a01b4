"""Keras private APIs, behind named functions: the only module that reaches into Keras.

Every accessor here names what it reads and the Keras versions it was verified
on (`VERIFIED_KERAS`, checked once by `tfdist.keras_integration.install`).
Workarounds name their upstream issue (or quote the upstream error) in their
docstrings, and each has a test that fails without it. Nothing here imports
another tfdist module but `tfdist._compat.tf`; the layers above call these
functions instead of touching `keras.src` or a private attribute.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Sequence

import keras
import tensorflow as tf

# Keras versions on which the private APIs below were verified.
_originals: dict[str, Any] = {}
_replaced: dict = {}


VERIFIED_KERAS = ((3, 5), (3, 15))




def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def trainer_class():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


def call_model(model, x, training: bool):
    """Calls the model as Keras's own train/test steps do."""
    if model._call_has_training_arg:
        return model(x, training=training)
    return model(x)


def compute_loss(model, x, y, y_pred, sample_weight, training: bool):
    """The model's total loss for one replica, as Keras's `train_step` computes it.

    Keras scales it by 1/num_replicas for distribution (see
    `keras.src.losses.loss.scale_loss_for_distribution`).
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def track_loss(model, loss, batch_size, factor=None):
    """Updates the model's `loss` metric as Keras's `train_step` does; `factor` (a scalar) multiplies the value."""
    from keras.src.losses import loss as loss_module

    value = loss_module.unscale_loss_for_distribution(loss)
    if factor is not None:
        value = value * tf.cast(factor, value.dtype)
    # A replica with an empty batch (the last, short global batch) adds nothing.
    value = tf.where(batch_size > 0, value, tf.zeros_like(value))
    model._loss_tracker.update_state(value, sample_weight=batch_size)


def has_custom_train_step(model) -> bool:
    return type(model).train_step is not trainer_class().train_step


def has_custom_test_step(model) -> bool:
    return type(model).test_step is not trainer_class().test_step


def unpack_data(data):
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.unpack_x_y_sample_weight(data)


def is_loss_scale_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def clip_gradients(optimizer, grads: Sequence):
    """Applies the optimizer's `clipnorm`/`clipvalue`/`global_clipnorm` to `grads`.

    Called on gradients that are already summed over replicas, so a global norm
    is the norm of the whole gradient, as on a single device.
    """
    return optimizer._clip_gradients(list(grads))


def clips_like_keras(optimizer) -> bool:
    """Whether `optimizer` clips with Keras's own `_clip_gradients` (not the sharded state's).

    The sharded optimizer (`make_sharded_optimizer`) clips slices, whose norms
    it sums across replicas.
    """
    return not isinstance(optimizer, _ShardedOptimizer)


def inner_optimizer(optimizer):
    """The optimizer whose update rule runs: a `LossScaleOptimizer`'s inner one, else itself."""
    return optimizer.inner_optimizer if is_loss_scale_optimizer(optimizer) else optimizer


def keras_accumulation_steps(optimizer):
    """Keras's `Optimizer(gradient_accumulation_steps=k)` of the update optimizer, or `None`."""
    return getattr(inner_optimizer(optimizer), "gradient_accumulation_steps", None) or None


def iterations_variable(optimizer):
    """The optimizer's raw iteration counter (Keras's `iterations` divides it under accumulation)."""
    return optimizer._iterations


def tf_variable(v):
    """The TensorFlow variable behind a Keras variable (itself for a TensorFlow one)."""
    return v.value if isinstance(v, keras.Variable) else v


def stored_variable(v):
    """The TensorFlow variable that stores a Keras variable, whatever a `keras.StatelessScope` maps it to.

    In a stateless scope that maps it, `keras.Variable.value` (and so
    `handle`, which `tf.GradientTape.gradient` reads) is the mapped tensor,
    which has no handle. Private: `Variable._value` (the TensorFlow backend's
    storage). Verified on Keras 3.5 to 3.15.
    """
    return v._value if isinstance(v, keras.Variable) else v


def reorder_like(grads, variables, reference):
    """`grads` (one per `variables`) in the order of `reference`; `None` at a variable of
    `reference` that `variables` lacks. Variables match by the TensorFlow variable behind them."""
    position = {id(tf_variable(v)): i for i, v in enumerate(variables)}
    indices = [position.get(id(tf_variable(v))) for v in reference]
    return [None if i is None else grads[i] for i in indices], [r for r, i in zip(reference, indices) if i is None]


def is_multi_optimizer(optimizer) -> bool:
    multi = getattr(keras.optimizers, "MultiOptimizer", None)  # Keras 3.13+
    return multi is not None and isinstance(optimizer, multi)


def multi_optimizer_groups(optimizer, variables: Sequence) -> list:
    """`[(sub_optimizer, [indices into variables]), ...]`: which sub-optimizer updates which variable.

    Keras's `MultiOptimizer.apply` routes by `_var_to_optimizer_idx[_var_key(v)]`.
    """
    groups: dict[int, list[int]] = {}
    for i, v in enumerate(variables):
        groups.setdefault(optimizer._var_to_optimizer_idx[optimizer._var_key(v)], []).append(i)
    return [(optimizer._inner_optimizers[k], idx) for k, idx in sorted(groups.items())]


def overwrites_with_gradient(optimizer, variable) -> bool:
    """Keras's float8 rule: the variable takes its gradient as its value (no optimizer step)."""
    return bool(optimizer._overwrite_variable_with_gradient(variable))


def optimizer_name_scope(optimizer):
    from keras.src import backend as keras_backend

    return keras_backend.name_scope(optimizer.name, caller=optimizer)


def advance_per_step_state(optimizer) -> None:
    """State an optimizer advances once per step outside `update_step`.

    Nadam advances its `u_product` in `Nadam._backend_update_step`, which
    Keras reaches through the distributed merge_call that tfdist's update has
    already replaced; without this, Nadam under a strategy divides by a
    `u_product` stuck at 1 and trains to NaN.
    """
    from keras.src.optimizers.nadam import Nadam

    if isinstance(optimizer, Nadam):
        from keras.src import ops

        dtype = optimizer._u_product.dtype
        optimizer.assign(
            optimizer._u_product,
            optimizer._u_product
            * optimizer.beta_1
            * (1.0 - 0.5 * ops.power(0.96, ops.cast(optimizer.iterations + 1, dtype))),
        )


def weight_decay_rate(optimizer, variable, masked: bool = False):
    """The decoupled weight-decay rate Keras applies to `variable`, or `None`.

    Muon decays its Adam-updated variables at `adam_weight_decay`. With
    `masked`, the exclusion rule is the caller's (a per-element mask).
    """
    from keras.src.optimizers.muon import Muon

    if isinstance(optimizer, Muon):
        if not optimizer._use_weight_decay(variable):
            return None
        if optimizer._should_use_adamw(variable):
            return optimizer.adam_weight_decay
        return optimizer.weight_decay
    if optimizer.weight_decay is None:
        return None
    if masked or optimizer._use_weight_decay(variable):
        return optimizer.weight_decay
    return None


def ema_averages(optimizer) -> list:
    return list(optimizer._model_variables_moving_average)


def optimizer_trainable_variables(optimizer) -> list:
    """The variables the optimizer was built on (Keras's `_trainable_variables`)."""
    return list(optimizer._trainable_variables)


def fresh_keras_names():
    """Auto-names Keras objects made inside as if they were the first of their kind.

    `tfdist.estimator` calls a `model_fn` once per trace; every call builds new
    Keras layers, which Keras names `dense`, `dense_1`, ... from a process-wide
    counter. Inside this context the counter starts afresh, so the layers of
    each call get the same names and their variables the same paths
    (`dense/kernel`), which is what the runner keys reused variables on.
    Keras keeps the counter in `keras.src.backend.common.global_state`
    (per thread). Verified on Keras 3.5 to 3.15.
    """
    import collections
    import contextlib

    from keras.src.backend.common import global_state

    @contextlib.contextmanager
    def scope():
        saved = global_state.get_global_attribute("object_name_uids")
        global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
        try:
            yield
        finally:
            global_state.set_global_attribute("object_name_uids", saved)

    return scope()


def keras_name_scope_path() -> str:
    """The Keras name-scope path a variable created now gets (`"dense"` in a Dense build).

    Keras 3 computes `Variable.path` from the same private stack
    (`keras.src.backend.common.name_scope.current_path`). Verified on Keras
    3.5 to 3.15.
    """
    from keras.src.backend.common.name_scope import current_path

    return current_path()


def symbolic_build(model, data_batch) -> None:
    """Builds the model, its metrics and optimizer variables from one batch, as `fit` does.

    `data_batch` holds tensors or their `tf.TypeSpec`s. Keras's
    `Trainer._symbolic_build` (run under a strategy only: on one device Keras
    builds in the traced step) stands a dense placeholder in for each input,
    and a layer that reads a ragged input as ragged (`x.to_tensor()`) fails
    there: "Unable to automatically build the model ... 'SymbolicTensor'
    object has no attribute 'to_tensor'" (stock `tf.distribute` fails before,
    averaging the ragged batch: "'RaggedTensor' object has no attribute
    'device'"). With
    a ragged input the model's output spec is traced from the inputs' own
    specs instead (`keras.src.backend.compute_output_spec` replaced for the
    call). Verified on Keras 3.15.
    """
    def spec(value):
        return value if isinstance(value, tf.TypeSpec) else tf.type_spec_from_value(value)

    specs = tf.nest.map_structure(spec, data_batch)
    if not any(isinstance(s, tf.RaggedTensorSpec) for s in tf.nest.flatten(specs)):
        model._symbolic_build(data_batch=data_batch)
        return
    from keras.src import backend as keras_backend
    from keras.src.backend.common.symbolic_scope import SymbolicScope

    x_spec = unpack_data(specs)[0]
    original = keras_backend.compute_output_spec

    def compute_output_spec(fn, *args, **kwargs):
        if fn is not model:
            return original(fn, *args, **kwargs)
        with keras.StatelessScope(), SymbolicScope():
            traced = tf.function(lambda x: fn(x, **kwargs), autograph=False).get_concrete_function(x_spec)
        return tf.nest.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype), traced.structured_outputs)

    keras_backend.compute_output_spec = compute_output_spec
    try:
        model._symbolic_build(data_batch=data_batch)
    finally:
        keras_backend.compute_output_spec = original


def epoch_element_spec(epoch_iterator):
    """One replica's element spec of a Keras TF epoch iterator's input, or None.

    Reads `TFEpochIterator._distributed_dataset` (Keras 3.5 to 3.15) and unwraps
    `PerReplicaSpec` (TF 2.16 to 2.21) to its first replica's spec. None when the
    iterator has no such dataset (another input kind): the caller then reads a batch.
    """
    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None
    from tensorflow.python.distribute.values import PerReplicaSpec

    def first(s):
        return s._value_specs[0] if isinstance(s, PerReplicaSpec) else s

    return tf.nest.map_structure(first, spec)


def resume_epoch(model, initial_epoch: int) -> int:
    """The epoch to start at: BackupAndRestore's restored epoch, else `initial_epoch`."""
    return model._initial_epoch or initial_epoch


def pythonify_logs(logs) -> dict:
    from keras.src.utils.python_utils import pythonify_logs as pythonify

    return pythonify(logs)


def metrics_result_or_logs(model, logs) -> dict:
    return model._get_metrics_result_or_logs(logs)


def is_sharded(variable) -> bool:
    """Whether a Keras (or TF) variable is a `ShardedVariable` from a variable partitioner."""
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    return isinstance(tf_variable(variable), ShardedVariable)


def variable_parts(variable) -> list:
    """The TensorFlow variables that hold a Keras variable: its shards, or itself."""
    v = tf_variable(variable)
    return list(v.variables) if is_sharded(v) else [v]


def raw_variable_parts(variable) -> list:
    """`variable_parts`, each a plain TensorFlow variable: a ps variable's `CachingVariable`
    wrapper (`tensorflow/python/distribute/ps_values.py`, whose reads may return a
    per-step cached copy) unwrapped, so a read reads the variable now."""
    from tensorflow.python.distribute.ps_values import CachingVariable

    return [p.get() if isinstance(p, CachingVariable) else p for p in variable_parts(variable)]


_PATCHED_VARIABLE_METHODS = ("numpy", "__array__", "assign_add", "assign_sub", "_serialize_to_tensors")


def patch_variables_for_parameter_servers() -> None:
    """Makes Keras variables held on ps tasks readable as arrays and safe to update concurrently.

    Two upstream behaviours of Keras 3's TensorFlow `Variable` (idempotent;
    other variables behave exactly as before):

    * `numpy()` and `__array__` call the same methods of the wrapped
      `tf.Variable`, which a `ShardedVariable` lacks ("'ShardedVariable' object
      has no attribute '__array__'"), so `get_weights` and `model.save` fail
      for a partitioned model. A sharded value is read by concatenating its
      shards.
    * `assign_add` is `assign(self + value)` (keras/src/backend/common/
      variables.py): a read, then a write. Workers of a parameter-server job
      update the same variables concurrently, so increments interleave and are
      lost: the optimizer's iteration count ended at 176 instead of 188 after
      4 epochs of 47 steps on 2 workers, and metric totals lose steps alike.
      A variable on a ps task is incremented with TensorFlow's own
      `assign_add`, one atomic op on the ps.
    * `_serialize_to_tensors` (what `tf.train.Checkpoint` saves) falls back to
      `{"VARIABLE_VALUE": self.value}` when the wrapped variable does not
      implement it, and a `ShardedVariable` does not: the saver then fails
      with "AttributeError: 'ShardedVariable' object has no attribute
      'device'". A sharded value is saved whole (its shards concatenated),
      under the key and shape one device saves, so a checkpoint moves
      between sharded and unsharded models; restoring assigns it (split).
    """
    if "variable_numpy" in _originals:
        return
    from keras.src.backend.common.variables import in_stateless_scope
    from keras.src.backend.tensorflow.core import Variable
    from tensorflow.python.distribute.ps_values import CachingVariable
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    for name in _PATCHED_VARIABLE_METHODS:
        _originals[f"variable_{name}"] = getattr(Variable, name)

    def on_ps(variable) -> bool:
        return isinstance(variable._value, (CachingVariable, ShardedVariable)) and not in_stateless_scope()

    def numpy(self):
        if is_sharded(self):
            return tf.convert_to_tensor(self.value).numpy()
        return _originals["variable_numpy"](self)

    def __array__(self, dtype=None):
        if is_sharded(self):
            import numpy as np

            return np.asarray(tf.convert_to_tensor(self.value).numpy(), dtype=dtype)
        return _originals["variable___array__"](self, dtype)

    def assign_add(self, value):
        if on_ps(self):
            return self._value.assign_add(tf.cast(value, self._value.dtype))
        return _originals["variable_assign_add"](self, value)

    def assign_sub(self, value):
        if on_ps(self):
            return self._value.assign_sub(tf.cast(value, self._value.dtype))
        return _originals["variable_assign_sub"](self, value)

    def _serialize_to_tensors(self):
        if is_sharded(self):
            return {"VARIABLE_VALUE": tf.convert_to_tensor(self._value)}
        return _originals["variable__serialize_to_tensors"](self)

    Variable._serialize_to_tensors = _serialize_to_tensors
    Variable.numpy = numpy
    Variable.__array__ = __array__
    Variable.assign_add = assign_add
    Variable.assign_sub = assign_sub


def replace_number_conversions() -> None:
    """`int(v)` and `float(v)` of a Keras variable whose value is a distributed variable.

    Keras 3's `Variable.__int__` is `int(self.value)`, and a `MirroredVariable`
    (any `tf.distribute` variable) has no `__int__`: under every strategy,
    `int(model.optimizer.iterations)` raises "TypeError: int() argument must
    be a string, a bytes-like object or a real number, not
    'MirroredVariable'" (stock `tf.distribute` too; no upstream issue found).
    Such a value is converted from `numpy()` (one replica's copy, which every
    copy equals for mirrored state). Other variables: Keras's own methods.
    Verified on Keras 3.15 (`keras.src.backend.common.variables.Variable`).
    """
    from keras.src.backend.common.variables import Variable

    def wrapper(convert):
        def wrap(original):
            @functools.wraps(original)
            def method(self):
                if isinstance(getattr(self, "_value", None), tf.distribute.DistributedValues):
                    return convert(self.numpy())
                return original(self)

            return method

        return wrap

    replace_method(Variable, "__int__", wrapper(int))
    replace_method(Variable, "__float__", wrapper(float))


def fold_replica_into_seeds(applies) -> None:
    """Each replica of a strategy `applies(strategy)` accepts draws its own random numbers.

    Keras 3 layers draw from a `SeedGenerator` (`Dropout`, `GaussianNoise`,
    `RandomFlip` and the other augmentation layers, `keras.random.*(seed=
    generator)` in a custom `train_step`): `next()` returns the generator's
    state `[seed, counter]` and advances the counter. Under a strategy every
    replica holds the same state (Keras creates it with `aggregation="none"`,
    keras-team/keras#20611, #20612) and advances it identically, so every
    replica draws the same numbers: with N replicas one dropout mask is used N
    times over the global batch, an augmentation layer flips or crops each
    replica's share alike, and a GAN's `keras.random.normal(seed=...)` latent
    batch repeats N times (stock `tf.distribute` too; TensorFlow's own
    `tf.random.Generator` gives each replica its own stream). In a replica
    context with more than one replica, replica r > 0 draws from
    `tf.random.experimental.stateless_fold_in(seed, r)`; replica 0 keeps the
    generator's own seed, so its draws are the ones one device makes for the
    first share of the batch, and the state advances as on one device. The
    counter still advances every step, so every replica's draws change each
    step. Outside such a strategy (or with one replica): Keras's own `next`.
    Verified on Keras 3.5 to 3.15 (`keras.src.random.seed_generator.SeedGenerator`).
    """
    from keras.src.random.seed_generator import SeedGenerator

    def wrap(original):
        @functools.wraps(original)
        def next(self, ordered=True):
            seed = original(self, ordered=ordered)
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1 or not applies(context.strategy):
                return seed
            replica = context.replica_id_in_sync_group
            if tf.get_static_value(replica) == 0:
                return seed
            seed = tf.convert_to_tensor(seed)
            folded = tf.random.experimental.stateless_fold_in(seed, tf.cast(replica, seed.dtype))
            return tf.where(tf.equal(replica, 0), seed, folded)

        return next

    replace_method(SeedGenerator, "next", wrap)


def restore_seed_folding() -> None:
    from keras.src.random.seed_generator import SeedGenerator

    restore_method(SeedGenerator, "next")


def restore_number_conversions() -> None:
    from keras.src.backend.common.variables import Variable

    restore_method(Variable, "__int__")
    restore_method(Variable, "__float__")


def holds_shards(source) -> bool:
    """Whether `source` is a `ShardedVariable` or a Keras variable whose value is one.

    Reads Keras's private `_value` rather than `value`: no initializer call, no
    autocast, so asking never changes what the caller's tape or optimizer sees.
    """
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    if isinstance(source, ShardedVariable):
        return True
    return isinstance(source, keras.Variable) and isinstance(getattr(source, "_value", None), ShardedVariable)


_unscaled_losses: dict = {}


def keras_losses_unscaled():
    """Context in which Keras loss objects return the replica's mean loss, not 1/N of it.

    Under a strategy with N replicas, Keras 3 divides every
    `"sum_over_batch_size"` loss by N (`keras.src.losses.loss.
    scale_loss_for_distribution`), for its own train step. A `model_fn`
    returns the mean loss over its replica's batch however it computed it
    (a Keras loss object or `tf.reduce_mean`), and the runner weights it by
    the batch size itself; inside this context (per thread: MirroredStrategy
    runs replicas in threads) Keras leaves the loss unscaled. The wrapper is
    installed once and defers to Keras outside the context. Verified on Keras
    3.5 to 3.15.
    """
    import contextlib
    import threading

    from keras.src.losses import loss as loss_module

    if "state" not in _unscaled_losses:
        state = threading.local()
        original = loss_module.scale_loss_for_distribution

        def scale_loss_for_distribution(value):
            if getattr(state, "depth", 0):
                return value
            return original(value)

        loss_module.scale_loss_for_distribution = scale_loss_for_distribution
        _unscaled_losses["state"] = state
    state = _unscaled_losses["state"]

    @contextlib.contextmanager
    def scope():
        state.depth = getattr(state, "depth", 0) + 1
        try:
            yield
        finally:
            state.depth -= 1

    return scope()


_reduction_records: dict = {}


def recording_loss_reductions():
    """Context in which each Keras loss object's reduction is recorded: yields the list of records.

    A record per `Loss.__call__` (Keras's compiled loss calls one per output),
    in this thread (MirroredStrategy traces replicas in threads):

    * `("sum", None)`: reduction `"sum"`, `"none"` or None — the replica's
      loss is a sum over its share, which Keras does not divide by the
      replica count;
    * `("tokens", count)`: a mean (`"sum_over_batch_size"`, `"mean"`) over a
      mask's entries (a sequence model's padding mask, `Embedding(mask_zero=
      True)`): Keras divides by this replica's count of unmasked entries
      (`keras.src.losses.loss.apply_mask`), one device by the whole batch's;
      `count` is that float32 count;
    * `("weights", total)`: reduction `"mean_with_sample_weight"` with sample
      weights (or a mask): Keras divides by this replica's total weight, one
      device by the whole batch's;
    * `("rows", None)`: any other reduction (a mean over the replica's rows).

    Wraps `keras.src.losses.loss.reduce_weighted_values` once (it defers to
    Keras and records nothing outside the context). Verified on Keras 3.5 to
    3.15.
    """
    from keras.src.losses import loss as loss_module

    if "state" not in _reduction_records:
        state = threading.local()
        original = loss_module.reduce_weighted_values

        @functools.wraps(original)
        def reduce_weighted_values(values, sample_weight=None, mask=None, reduction="sum_over_batch_size",
                                   dtype=None):
            records = getattr(state, "records", None)
            if records is not None:
                kind = loss_module.standardize_reduction(reduction)
                if kind in (None, "none", "sum"):
                    records.append(("sum", None))
                elif mask is not None and kind in ("sum_over_batch_size", "mean"):
                    records.append(("tokens", tf.reduce_sum(tf.cast(mask, tf.float32))))
                elif kind == "mean_with_sample_weight" and (sample_weight is not None or mask is not None):
                    # Keras's divisor: the sample weights (times the mask) as they meet the values.
                    weights = loss_module.apply_mask(
                        None if sample_weight is None else tf.cast(sample_weight, tf.float32), mask,
                        dtype=tf.float32, reduction=kind,
                    )
                    _, weights = loss_module.squeeze_or_expand_to_same_rank(tf.cast(values, tf.float32), weights)
                    records.append(("weights", tf.reduce_sum(weights)))
                else:
                    records.append(("rows", None))
            return original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)

        loss_module.reduce_weighted_values = reduce_weighted_values
        _reduction_records["state"] = state
    state = _reduction_records["state"]

    return _thread_setting(state, "records", [])


@contextlib.contextmanager
def _thread_setting(state: threading.local, name: str, value):
    """Sets `state.<name>` to `value` for the context (this thread); yields `value`."""
    outer = getattr(state, name, None)
    setattr(state, name, value)
    try:
        yield value
    finally:
        setattr(state, name, outer)


_output_loss_weights: dict = {}


class _WeightedMetric:
    """A compiled loss's per-output metric as `CompileLoss.call` sees it: each update carries `weight`."""

    def __init__(self, metric, weight):
        self._metric = metric
        self._weight = weight

    def update_state(self, values, sample_weight=None):
        weight = tf.cast(self._weight, tf.float32)
        # A replica with an empty share (the last, short global batch) adds nothing.
        values = tf.where(weight > 0, values, tf.zeros_like(values))
        return self._metric.update_state(values, sample_weight=weight)


def _sums(loss_fn) -> bool:
    """Whether a compiled output's loss is a sum over its batch (reduction "sum", "none" or None)."""
    from keras.src.losses import loss as loss_module

    reduction = loss_module.standardize_reduction(getattr(loss_fn, "reduction", "sum_over_batch_size"))
    return reduction in (None, "none", "sum")


def _compiled_losses(model) -> list:
    """`model`'s compiled losses, one entry per output (`CompileLoss._flat_losses`; empty before it is built).

    Verified on Keras 3.15.
    """
    return list(getattr(getattr(model, "_compile_loss", None), "_flat_losses", None) or ())


def compiled_losses_sum(model) -> bool:
    """Whether every loss `model` was compiled with is a sum over its batch (reduction "sum", "none" or None).

    False where there is none yet.
    """
    losses = _compiled_losses(model)
    return bool(losses) and all(_sums(entry[1]) for entry in losses)


def compiled_loss_count(model) -> int:
    """How many losses `model` was compiled with, one per output (0 before the compiled loss is built)."""
    return len(_compiled_losses(model))


def output_losses_weighted(weight):
    """Context in which the compiled loss's per-output metrics (`"out_loss"`) count this replica's value at `weight`.

    Keras's `CompileLoss.call` updates each output's loss metric with
    `sample_weight=` the static batch dimension of the output, None in a traced
    step (`keras.src.trainers.compile_utils.CompileLoss.call`): on one device
    each batch counts once, its mean over its rows, whatever its size. Per
    replica that makes each replica's share count once, so the logged
    `out_loss` of a batch split 7 and 6 rows is the unweighted mean of the two
    shares' means, and an empty share (a last batch smaller than the replica
    count) adds a zero. Given `weight` = the replica's rows over the global
    batch's, the shares' updates sum to one update of the global batch's mean,
    counted once, as one device counts it. A summed output loss (reduction
    `"sum"` or `"none"`) reaches the metric as N times its share's sum (Keras
    unscales it): counted 1/N, the shares add up to the batch's sum. A mean
    over a padding mask's entries or over sample weights is weighted by rows,
    as the logged total loss is. Wraps `CompileLoss.call` once (it defers to
    Keras outside the context; per thread: MirroredStrategy traces replicas in
    threads); a Keras without `CompileLoss._flat_losses` keeps its own
    weighting. Verified on Keras 3.15.
    """
    from keras.src.trainers.compile_utils import CompileLoss

    if "state" not in _output_loss_weights:
        state = threading.local()
        original = CompileLoss.call

        @functools.wraps(original)
        def call(self, y_true, y_pred, sample_weight=None):
            weight = getattr(state, "weight", None)
            metrics = self._metrics
            losses = getattr(self, "_flat_losses", None)
            if weight is None or not metrics or losses is None or len(losses) != len(metrics):
                return original(self, y_true, y_pred, sample_weight)
            replicas = float(tf.distribute.get_replica_context().num_replicas_in_sync)
            self._metrics = [
                _WeightedMetric(m, 1.0 / replicas if _sums(entry[1]) else weight)
                for entry, m in zip(losses, metrics)
            ]
            try:
                return original(self, y_true, y_pred, sample_weight)
            finally:
                self._metrics = metrics

        CompileLoss.call = call
        _output_loss_weights["state"] = state
    state = _output_loss_weights["state"]

    return _thread_setting(state, "weight", weight)


def build_optimizer(optimizer, variables: Sequence) -> None:
    """Runs the user's optimizer class's own `build` (not the sharded one)."""
    unsharded_class(optimizer).build(optimizer, list(variables))


def class_trackable_children(optimizer, save_type, **kwargs) -> dict:
    return unsharded_class(optimizer)._trackable_children(optimizer, save_type, **kwargs)


def uses_weight_decay(optimizer, variable) -> bool:
    return optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)


def slots_initialised_from_weights(optimizer) -> tuple[str, ...]:
    """Slots an optimizer's `build` fills with a copy of the variable (not zeros)."""
    if type(optimizer).__name__ == "ScheduleFreeAdamW":
        return ("momentum",)
    return ()


def recording_copy(optimizer):
    """An unbuilt optimizer of the user's class and `optimizer`'s config that records its slots."""
    return _derived_class(unsharded_class(optimizer), _RecordsSlots).from_config(optimizer.get_config())


def slot_records(optimizer) -> list:
    """`(reference variable, slot name, slot)` for each slot a recording optimizer created, in order."""
    return list(optimizer.__dict__.get("_tfdist_slots", []))


def advance_iterations(optimizer) -> None:
    optimizer._iterations.assign_add(1)


def ema_average(optimizer):
    """The EMA slot of a sharded optimizer (built on one flat variable)."""
    return optimizer._model_variables_moving_average[0]


class VariableStandIn:
    """A tensor an optimizer's `update_step` updates as if it were `key`, a variable it was built on.

    Keras (verified on 3.15, TensorFlow backend) finds a variable's slots by
    `optimizer._var_key(variable)` (the tf.Variable's, or its distributed
    container's, `_unique_id`) and writes it with `assign`, `assign_add`,
    `assign_sub` and, for sparse gradients, `scatter_*`. This object answers
    with `key`'s id and keeps each write as its new `value`, so the update of
    a slice of weights needs no variable of its own (the sharded optimizer's
    owned slice, read from the model's weights).
    """

    def __init__(self, optimizer, key, value):
        self._unique_id = optimizer._var_key(key)
        self.value = value

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def shape(self):
        return self.value.shape

    def assign(self, value, read_value=False):
        self.value = tf.convert_to_tensor(value, self.dtype)

    def assign_add(self, value, read_value=False):
        self.value = self.value + tf.convert_to_tensor(value, self.dtype)

    def assign_sub(self, value, read_value=False):
        self.value = self.value - tf.convert_to_tensor(value, self.dtype)

    def scatter_update(self, update):
        self.value = tf.tensor_scatter_nd_update(self.value, update.indices[:, None], update.values)

    def scatter_add(self, update):
        self.value = tf.tensor_scatter_nd_add(self.value, update.indices[:, None], update.values)

    def scatter_sub(self, update):
        self.value = tf.tensor_scatter_nd_sub(self.value, update.indices[:, None], update.values)


tf.register_tensor_conversion_function(
    VariableStandIn, lambda v, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(v.value, dtype)
)


class PartStandIn:
    """Part `part` (a `tf.Variable`) of a Keras variable `key` held in parts, updated as if it were `key`.

    Keras (verified on 3.15, TensorFlow backend) finds a variable's slots by
    `optimizer._var_key(variable)` and writes it with `assign`, `assign_add`,
    `assign_sub` and, for sparse gradients, `scatter_*`: this object answers
    with `key`'s key and writes `part`. Used inside `slots_as_parts`, where
    the slots read as their own part, so an element-wise update runs on one
    part of the variable and of its state, on the part's device.
    """

    def __init__(self, key, part):
        # What Keras's `TFOptimizer._var_key` returns for a variable holding a
        # `ShardedVariable` (no distributed container): the sharded value's id.
        self._unique_id = tf_variable(key)._unique_id
        self.part = part

    @property
    def dtype(self):
        return self.part.dtype

    @property
    def shape(self):
        return self.part.shape

    def assign(self, value, read_value=False):
        return self.part.assign(value, read_value=False)

    def assign_add(self, value, read_value=False):
        return self.part.assign_add(value, read_value=False)

    def assign_sub(self, value, read_value=False):
        return self.part.assign_sub(value, read_value=False)

    def scatter_update(self, update):
        return self.part.scatter_update(update)

    def scatter_add(self, update):
        return self.part.scatter_add(update)

    def scatter_sub(self, update):
        return self.part.scatter_sub(update)


tf.register_tensor_conversion_function(
    PartStandIn, lambda v, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(v.part, dtype)
)


@contextlib.contextmanager
def slots_as_parts(optimizer, variable, index: int):
    """Inside: `variable`'s optimizer slots held in parts read as their part `index` (a `tf.Variable`).

    Keras optimizers keep per-variable state in list attributes indexed by
    the variable's position (`self._momentums[self._get_variable_index(v)]`,
    the index from the private `_trainable_variables_indices`; verified on
    Keras 3.15: Adam, AdamW, SGD, RMSprop, Adagrad, Adadelta, Adamax, Nadam,
    Lion, Ftrl, and EMA's `_model_variables_moving_average`). The entry at
    `variable`'s position of every such list, when it is a Keras variable
    whose value is a `ShardedVariable`, is replaced by that value's part
    `index` for the duration, then restored: only entries split exactly as
    `variable` is (a slot, part beside part), never `variable` itself. A
    variable the optimizer does not train (an EMA average) has no slots:
    nothing is replaced.
    """
    layout = [(p.shape, p.device) for p in variable_parts(variable)]

    def part(entry):
        if not (isinstance(entry, keras.Variable) and is_sharded(entry)):
            return None
        # A slot is split like its variable, part beside part: a list that is
        # not indexed by variable (the optimizer's `_variables`) is left alone.
        if [(p.shape, p.device) for p in variable_parts(entry)] != layout:
            return None
        return tf_variable(entry).variables[index]

    with _slot_entries_replaced(optimizer, variable, part):
        yield


@contextlib.contextmanager
def _slot_entries_replaced(optimizer, variable, replace):
    """Inside: each list attribute's entry for `variable` (its slots) replaced by `replace(entry)`.

    Keras optimizers keep per-variable state in list attributes indexed by
    the variable's position (the private `_trainable_variables_indices`).
    Entries that are `variable` itself, or for which `replace` returns None,
    are left alone. Yields the replacements; restores the entries after.
    """
    position = optimizer._trainable_variables_indices.get(optimizer._var_key(variable))
    swapped = []
    for value in list(vars(optimizer).values()) if position is not None else []:
        if not isinstance(value, list) or len(value) <= position:
            continue
        # Keras's lists are TensorFlow `ListWrapper`s: replacing an element
        # through them marks them unsaveable ("A list element was replaced");
        # their private `_storage` list is written instead, and restored
        # before anything saves.
        storage = getattr(value, "_storage", value)
        entry = storage[position]
        replacement = None if entry is variable else replace(entry)
        if replacement is None:
            continue
        swapped.append((storage, position, entry))
        storage[position] = replacement
    try:
        yield [values[i] for values, i, _ in swapped]
    finally:
        for values, i, entry in swapped:
            values[i] = entry


class _ReadsAsTensor:
    """Arithmetic on a slot view reads it as a tensor (`self.read()`), as on a Keras variable.

    Some Keras optimizers apply Python operators to their slots (Adadelta's
    `rho * accumulated_grad`, verified on 3.15).
    """

    def __neg__(self):
        return -self.read()

    def __pow__(self, other):
        return self.read() ** other


for _name in ("add", "sub", "mul", "truediv"):
    def _op(self, other, _name=_name):
        return getattr(self.read(), f"__{_name}__")(other)

    def _rop(self, other, _name=_name):
        return getattr(self.read(), f"__r{_name}__")(other)

    setattr(_ReadsAsTensor, f"__{_name}__", _op)
    setattr(_ReadsAsTensor, f"__r{_name}__", _rop)


class SlotChunk(_ReadsAsTensor):
    """Row `row` of a 2-D optimizer slot (a `tf.Variable` of `[chunks, C]`), read and written in place.

    The sharded optimizer holds each replica's slice of a slot as one row per
    chunk (`FlatLayout.slot_shape`) and updates it chunk by chunk
    (`slots_as_chunks`), so that the update's temporaries are one chunk's
    size. The row is read with `ResourceGather` and written back with
    `ResourceScatterUpdate` into the slot's own buffer: each copies the row as
    one block (a chunk of a 1-D slot is gathered element by element and
    written through a strided slice: measured 7x and 5x slower), and no
    slot-sized buffer is created. Both put the slot variable in TensorFlow's
    copy-on-read mode (a plain read then copies it), which costs nothing
    here: only these chunked updates read the slots during training. Keras
    (verified on 3.15, TensorFlow backend) writes a slot through
    `optimizer.assign*`, which calls `assign`, `assign_add` or `assign_sub`
    on it, and reads it as a tensor.
    """

    def __init__(self, variable, row: int):
        self.variable = variable
        self.row = row
        self._value = None
        # The in-place writes, for the next chunk to wait on.
        self.writes: list = []

    @property
    def dtype(self):
        return self.variable.dtype

    @property
    def shape(self):
        return tf.TensorShape(self.variable.shape[1:])

    @property
    def value(self):
        # Read where it is used, as a Keras variable's `value` (see `SlotRows.value`).
        return self

    def read(self):
        """The row's current value: as last written here, else gathered once."""
        if self._value is None:
            self._value = tf.raw_ops.ResourceGather(
                resource=self.variable.handle, indices=tf.constant(self.row, tf.int32), dtype=self.variable.dtype
            )
        return self._value

    @staticmethod
    def prepare(variable) -> None:
        """Eagerly: puts `variable` in copy-on-read mode now, outside any step.

        The first in-place write does it otherwise, and copies the slot then
        if anything still shares its buffer (its initial value), inside the
        step, at its peak.
        """
        tf.raw_ops.ResourceScatterUpdate(
            resource=variable.handle, indices=tf.zeros([0], tf.int32),
            updates=tf.zeros([0] + variable.shape.as_list()[1:], variable.dtype),
        )

    def _write(self, value):
        self._value = tf.convert_to_tensor(value, self.dtype)
        op = tf.raw_ops.ResourceScatterUpdate(
            resource=self.variable.handle, indices=tf.constant(self.row, tf.int32), updates=self._value
        )
        self.writes.append(op)
        return op

    def assign(self, value, read_value=False):
        return self._write(value)

    def assign_add(self, value, read_value=False):
        return self._write(self.read() + tf.convert_to_tensor(value, self.dtype))

    def assign_sub(self, value, read_value=False):
        return self._write(self.read() - tf.convert_to_tensor(value, self.dtype))


tf.register_tensor_conversion_function(
    SlotChunk, lambda v, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(v.read(), dtype)
)


class SlotRows(_ReadsAsTensor):
    """A 2-D optimizer slot (a `tf.Variable` of `[chunks, C]`) read and written as its flat `[chunks * C]` elements.

    The sharded optimizer's update of a whole slice (sparse gradients, EMA,
    one bucket, `shard_bucket_bytes=0`) sees each slot this way
    (`slots_as_flat`). Reads and dense writes reshape, which copies nothing;
    sparse writes (`scatter_*` with `tf.IndexedSlices` over the flat
    elements, as Keras's TensorFlow optimizer issues them, verified on 3.15)
    address element `i` as `[i // C, i % C]`, in place.
    """

    def __init__(self, variable):
        self.variable = variable
        self._rows = variable.shape.as_list()

    @property
    def dtype(self):
        return self.variable.dtype

    @property
    def shape(self):
        return tf.TensorShape([self._rows[0] * self._rows[1]])

    @property
    def value(self):
        # As a Keras variable's `value` on the TensorFlow backend (the
        # tf.Variable itself): read where it is used, not here (Keras's
        # ScheduleFreeAdamW takes `momentum.value` before updating the
        # momentum and uses it after; one device then reads the new value).
        return self

    def read(self):
        return tf.reshape(tf.convert_to_tensor(self.variable), [-1])

    def _rows_of(self, value):
        return tf.reshape(tf.convert_to_tensor(value, self.dtype), self._rows)

    def assign(self, value, read_value=False):
        return self.variable.assign(self._rows_of(value), read_value=False)

    def assign_add(self, value, read_value=False):
        return self.variable.assign_add(self._rows_of(value), read_value=False)

    def assign_sub(self, value, read_value=False):
        return self.variable.assign_sub(self._rows_of(value), read_value=False)

    def _at(self, update: tf.IndexedSlices):
        c = tf.cast(self._rows[1], update.indices.dtype)
        return tf.stack([update.indices // c, update.indices % c], axis=1), tf.cast(update.values, self.dtype)

    def scatter_update(self, update):
        indices, values = self._at(update)
        return tf.raw_ops.ResourceScatterNdUpdate(ref=self.variable.handle, indices=indices, updates=values)

    def scatter_add(self, update):
        indices, values = self._at(update)
        return tf.raw_ops.ResourceScatterNdAdd(ref=self.variable.handle, indices=indices, updates=values)

    def scatter_sub(self, update):
        indices, values = self._at(update)
        return tf.raw_ops.ResourceScatterNdSub(ref=self.variable.handle, indices=indices, updates=values)


tf.register_tensor_conversion_function(
    SlotRows, lambda v, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(v.read(), dtype)
)


def _slot_of(variable, local, make):
    def replace(entry):
        if not isinstance(entry, keras.Variable) or tuple(entry.shape) != tuple(variable.shape):
            return None
        return make(local(entry))

    return replace


@contextlib.contextmanager
def slots_as_chunks(optimizer, variable, row: int, local):
    """Inside: the 2-D slots of `variable` read and written as their row `row` (`SlotChunk`).

    As `slots_as_parts`: every list attribute of the optimizer indexed by
    variable position (Keras's private `_trainable_variables_indices`;
    verified on Keras 3.15 for the optimizers `slots_as_parts` names) has its
    entry for `variable`, when it is a Keras variable of `variable`'s shape
    other than `variable`, replaced by a `SlotChunk` of `local(entry)` (the
    slot's copy where the update runs), then restored. Yields the `SlotChunk`s.
    """
    with _slot_entries_replaced(optimizer, variable, _slot_of(variable, local, lambda v: SlotChunk(v, row))) as chunks:
        yield chunks


@contextlib.contextmanager
def slots_as_flat(optimizer, variable, local):
    """Inside: the 2-D slots of `variable` read and written as flat vectors (`SlotRows`), as `slots_as_chunks`."""
    with _slot_entries_replaced(optimizer, variable, _slot_of(variable, local, SlotRows)) as views:
        yield views


def adam_family_slots(optimizer, variable):
    """`(kind, slots)`: the Keras slot variables of an Adam-family update of `variable`, or None.

    `kind` is "adam" (Adam, AdamW; slots m, v, and v_hat with AMSGrad),
    "adamax" (m, u) or "nadam" (m, v), the numerator m first, and only when
    the optimizer's `update_step` is Keras's own, whose formulas
    `tfdist.engine.update.ordered_update` repeats. Reads Keras's private
    `_momentums`, `_velocities`, `_velocity_hats`, `_m`, `_u` and
    `_get_variable_index` (Keras 3.x; tests/engine/test_update.py fails if
    they move).
    """
    from keras.src.optimizers.adam import Adam
    from keras.src.optimizers.adamax import Adamax
    from keras.src.optimizers.nadam import Nadam

    kinds = {
        Adam.update_step: ("adam", ["_momentums", "_velocities"]),
        Adamax.update_step: ("adamax", ["_m", "_u"]),
        Nadam.update_step: ("nadam", ["_momentums", "_velocities"]),
    }
    kind, attributes = kinds.get(type(optimizer).update_step, (None, None))
    if kind is None:
        return None
    if kind == "adam" and optimizer.amsgrad:
        attributes = attributes + ["_velocity_hats"]
    index = optimizer._get_variable_index(variable)
    return kind, [getattr(optimizer, name)[index] for name in attributes]


def nadam_u_product(optimizer):
    """Nadam's momentum-cache product variable (Keras's private `_u_product`)."""
    return optimizer._u_product


def all_layers(model) -> list:
    """Every layer of `model`, nested ones included (Keras's private `_flatten_layers`)."""
    return list(model._flatten_layers(include_self=False))


def top_level_layers(model) -> list:
    """The layers `model` calls directly (Keras's private `_flatten_layers`, not recursive)."""
    return list(model._flatten_layers(include_self=False, recursive=False))


def stateless_values(scope) -> dict:
    """`{id(variable): value}` of a `keras.StatelessScope`: its mapping and the updates recorded so far.

    Private: `StatelessScope.state_mapping` (the dict `get_current_value`
    reads and `add_update` writes). Verified on Keras 3.5 to 3.15.
    """
    return dict(scope.state_mapping)


def stateless_scope_with(values: dict) -> keras.StatelessScope:
    """A `keras.StatelessScope` (collecting losses) whose variables read `values` (`{id(variable): tensor}`).

    Unlike `StatelessScope(state_mapping=...)` it takes the values as they are,
    uncast and unchecked: they come from another scope (`stateless_values`)
    or are a variable's own value. Private: `StatelessScope.state_mapping`.
    """
    scope = keras.StatelessScope(collect_losses=True)
    scope.state_mapping.update(values)
    return scope


def add_layer_loss(scope, layer, loss) -> None:
    """Records `loss` in `scope` as one `layer` added, as `Layer.add_loss` does in a stateless scope.

    Keras finds a layer's losses in the scope by identity (`Layer._loss_ids`,
    private): a loss computed inside the layer and passed on as another tensor
    (a `tf.custom_gradient` output) must be registered under the new tensor.
    Verified on Keras 3.5 to 3.15.
    """
    scope.add_loss(loss)
    layer._loss_ids.add(id(loss))


def record_stateless_update(scope, variable_id: int, value) -> None:
    """Records `value` as the variable's new value in `scope`, as `Variable.assign` does in it."""
    scope.state_mapping[variable_id] = value


_call_overrides = threading.local()
_call_lock = threading.Lock()
_call_users: dict = {}


@contextlib.contextmanager
def calls_replaced(replacements: dict):
    """Inside, in this thread: each layer in `replacements` (`{layer: function}`) runs the function as its `call`.

    Keras's `Operation.__call__` runs `self.call` after converting, casting
    and masking the inputs; an instance attribute of that name takes the
    method's place. The attribute is a dispatcher that runs this thread's
    replacement, else the layer's own method: MirroredStrategy traces each
    replica in its own thread, and the threads take turns at every
    `merge_call`, so one replica's replacements must not reach another's
    trace. It is removed when the last thread leaves (the layer is as it was).
    """
    active = getattr(_call_overrides, "active", None)
    if active is None:
        active = _call_overrides.active = {}
    with _call_lock:
        for layer in replacements:
            if _call_users.get(id(layer), 0) == 0:
                object.__setattr__(layer, "call", _dispatcher(layer, type(layer).call.__get__(layer)))
            _call_users[id(layer)] = _call_users.get(id(layer), 0) + 1
    saved = {id(layer): active.get(id(layer)) for layer in replacements}
    active.update({id(layer): function for layer, function in replacements.items()})
    try:
        yield
    finally:
        for key, function in saved.items():
            if function is None:
                active.pop(key, None)
            else:
                active[key] = function
        with _call_lock:
            for layer in replacements:
                _call_users[id(layer)] -= 1
                if _call_users[id(layer)] == 0:
                    del _call_users[id(layer)]
                    layer.__dict__.pop("call", None)


def _dispatcher(layer, own):
    key = id(layer)

    def call(*args, **kwargs):
        function = getattr(_call_overrides, "active", {}).get(key)
        return (function or own)(*args, **kwargs)

    call.__wrapped__ = own
    return call


def keras_mask(tensor):
    """`tensor`'s Keras mask now (the `_keras_mask` attribute layers read from their inputs), or None.

    A layer may clear its inputs' masks in its `call` (`MultiHeadAttention`
    does), so what a call saw is read before it runs. Private attribute,
    verified on Keras 3.5 to 3.15.
    """
    return getattr(tensor, "_keras_mask", None)


def with_keras_mask(tensor, mask):
    """`tensor`, carrying `mask` as its Keras mask (none set where `mask` is None)."""
    if mask is not None:
        tensor._keras_mask = mask
    return tensor


def layer_call_state() -> tuple:
    """What a layer's `call` reads from Keras's global state inside `Layer.__call__`.

    The call context (`current_call_ctx`: the `training` flag sublayers
    inherit when none is passed) and the autocast scope (mixed precision:
    float variables read in the compute dtype). Private:
    `keras.src.backend.common.global_state`. Verified on Keras 3.5 to 3.15.
    """
    from keras.src.backend.common import global_state

    return (
        global_state.get_global_attribute("current_call_ctx"),
        global_state.get_global_attribute("autocast_scope"),
    )


@contextlib.contextmanager
def restored_layer_call_state(state: tuple):
    """Inside: Keras's global state as `layer_call_state()` captured it (for a call re-run outside `__call__`)."""
    from keras.src.backend.common import global_state

    names = ("current_call_ctx", "autocast_scope")
    saved = [global_state.get_global_attribute(name) for name in names]
    for name, value in zip(names, state):
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            global_state.set_global_attribute(name, value)


def stateless_scope():
    """The active `keras.StatelessScope`, or None."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def unpatch_variables_for_parameter_servers() -> None:
    """Restores the Keras `Variable` methods `patch_variables_for_parameter_servers` replaced."""
    if "variable_numpy" not in _originals:
        return
    from keras.src.backend.tensorflow.core import Variable

    for name in _PATCHED_VARIABLE_METHODS:
        setattr(Variable, name, _originals.pop(f"variable_{name}"))


# ---------------------------------------------------------------------------
# Where tfdist's integration hooks in (tfdist.keras_integration decides what
# the hooks do; this module only knows Keras's private names for the places).
# ---------------------------------------------------------------------------


def trainer_base_class():
    """Keras's backend-independent `Trainer` (whose `compile` tfdist wraps)."""
    from keras.src.trainers.trainer import Trainer

    return Trainer


def replace_method(cls, name: str, wrapper) -> None:
    """Sets `cls.<name>` to `wrapper(original)`, remembering the original for `restore_method`."""
    key = (cls, name)
    if key not in _replaced:
        _replaced[key] = cls.__dict__.get(name, getattr(cls, name))
    setattr(cls, name, wrapper(_replaced[key]))


def restore_method(cls, name: str) -> None:
    """Undoes `replace_method(cls, name, ...)`; no-op when it was not replaced."""
    original = _replaced.pop((cls, name), None)
    if original is not None:
        setattr(cls, name, original)


def replaced(cls, name: str) -> bool:
    return (cls, name) in _replaced


def replace_symbolic_build(wrapper) -> None:
    """Wraps Keras's `TensorFlowTrainer._maybe_symbolic_build` (verified on Keras 3.5 to 3.15)."""
    replace_method(trainer_class(), "_maybe_symbolic_build", wrapper)


def restore_symbolic_build() -> None:
    restore_method(trainer_class(), "_maybe_symbolic_build")


def replace_default_dtype_policy(wrapper) -> None:
    """Wraps `keras.src.dtype_policies.dtype_policy.dtype_policy`, which every layer reads at
    construction (`dtype_policies.get(None)` and `DTypePolicy(None)` call it)."""
    from keras.src.dtype_policies import dtype_policy as dtype_policy_module

    if "dtype_policy" not in _originals:
        _originals["dtype_policy"] = dtype_policy_module.dtype_policy
    dtype_policy_module.dtype_policy = wrapper(_originals["dtype_policy"])


def restore_default_dtype_policy() -> None:
    from keras.src.dtype_policies import dtype_policy as dtype_policy_module

    if "dtype_policy" in _originals:
        dtype_policy_module.dtype_policy = _originals.pop("dtype_policy")


def base_optimizer_class():
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return BaseOptimizer


def model_strategy(model):
    """The strategy a model was built under (Keras's `_distribute_strategy`), or None."""
    return getattr(model, "_distribute_strategy", None)


def call_has_training_arg(model) -> bool:
    return bool(model._call_has_training_arg)


def assert_compile_called(model, method: str) -> None:
    model._assert_compile_called(method)


def should_eval(model, epoch: int, validation_freq) -> bool:
    return bool(model._should_eval(epoch, validation_freq))


def flatten_metrics_in_order(model, logs) -> dict:
    return model._flatten_metrics_in_order(logs)


def optimizer_known_variables_check(optimizer, variables) -> None:
    """Keras's check that `variables` are those the optimizer was built on."""
    optimizer._check_variables_are_known(variables)


def filter_empty_gradients(optimizer, grads, variables):
    return optimizer._filter_empty_gradients(grads, variables)


def epoch_iterator_factory(epoch_iterator):
    """The private `EpochIterator._get_iterator` (verified on Keras 3.15)."""
    return epoch_iterator._get_iterator


def set_epoch_iterator_factory(epoch_iterator, factory) -> None:
    epoch_iterator._get_iterator = factory


def epoch_distributed_dataset(epoch_iterator):
    """What a Keras TF epoch iterator made of its input (`TFEpochIterator._distributed_dataset`,
    Keras 3.5 to 3.15): the strategy's `experimental_distribute_dataset` result, or None."""
    return getattr(epoch_iterator, "_distributed_dataset", None)


def epoch_batch_size(epoch_iterator):
    """The batch size an epoch iterator's data adapter knows (`EpochIterator.data_adapter.batch_size`), or None."""
    adapter = getattr(epoch_iterator, "data_adapter", None)
    size = getattr(adapter, "batch_size", None) if adapter is not None else None
    return size if isinstance(size, int) else None


def redirect_backup_and_restore(callback, backup_dir: str) -> None:
    """Points a `BackupAndRestore` at `backup_dir` after it restored (its private paths;
    verified on Keras 3.5 to 3.15)."""
    import os

    callback.backup_dir = backup_dir
    callback._weights_path = os.path.join(backup_dir, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(backup_dir, "training_metadata.json")
    callback._prev_weights_path = f"{callback._weights_path}.bkp"
    callback._prev_training_metadata_path = f"{callback._training_metadata_path}.bkp"


# ---------------------------------------------------------------------------
# Checkpoint writes (tfdist.checkpointing makes them atomic). Verified on Keras
# 3.15; the private names are those `redirect_backup_and_restore` reads.
# ---------------------------------------------------------------------------


def backup_and_restore_files(callback) -> tuple[str, str, str, str]:
    """A `BackupAndRestore`'s files: (weights, metadata, previous weights, previous metadata)."""
    return (
        callback._weights_path,
        callback._training_metadata_path,
        callback._prev_weights_path,
        callback._prev_training_metadata_path,
    )


def backup_and_restore_position(callback) -> dict:
    """What `BackupAndRestore` writes to `training_metadata.json`: `{"epoch": e, "batch": b}`."""
    return {"epoch": callback._current_epoch, "batch": callback._last_batch_seen}


def replace_backup_and_restore_save(wrapper) -> None:
    """Wraps `BackupAndRestore._save_model`, the one method that writes a backup."""
    replace_method(keras.callbacks.BackupAndRestore, "_save_model", wrapper)


def restore_backup_and_restore_save() -> None:
    restore_method(keras.callbacks.BackupAndRestore, "_save_model")


def is_remote_path(path: str) -> bool:
    """Keras's test for a path it writes through `tf.io.gfile` (`gs://`, `/cns`, ...)."""
    from keras.src.utils import file_utils

    return bool(file_utils.is_remote_path(path))


def ask_to_proceed_with_overwrite(path: str) -> bool:
    """Keras's interactive prompt of `save(..., overwrite=False)` for an existing file."""
    from keras.src.utils import io_utils

    return bool(io_utils.ask_to_proceed_with_overwrite(path))


# ---------------------------------------------------------------------------
# Sharded optimizer (ZeRO stages 1 and 2): the user's optimizer, built on one
# flat slice per replica, reading and writing a canonical unsharded state.
# Verified on Keras 3.15 / TensorFlow 2.21.
# ---------------------------------------------------------------------------

class _RecordsSlots:
    """Records each slot the optimizer creates: (reference variable, slot name) → slot.

    Keras's `add_variable_from_reference` is where every per-variable slot is
    made (Adam's momentum and velocity, EMA, ...); recording it here maps
    slots to variables without parsing variable names.
    """

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        variable = super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        self.__dict__.setdefault("_tfdist_slots", []).append((reference_variable, name, variable))
        return variable


class _ShardedOptimizer(_RecordsSlots):
    """The sharded optimizer: the user's optimizer class with its state in flat slices.

    Put before the user's class in a same-named subclass (`make_sharded_optimizer`),
    as Horovod's `DistributedOptimizer` derives from the optimizer it wraps:
    the build, update, clipping, EMA finalisation and checkpointing go to the
    instance's `ShardedState` (`tfdist.strategies.sharded_optimizer`); the
    config, the update rule and the class name (in `.keras` files too) stay
    the user's.
    """

    def build(self, variables):
        return self.__dict__["_tfdist_sharded"].build(variables)

    def apply(self, grads, trainable_variables=None):
        return self.__dict__["_tfdist_sharded"].apply(grads, trainable_variables)

    def _clip_gradients(self, grads):
        return self.__dict__["_tfdist_sharded"].clip_slices(grads)

    def finalize_variable_values(self, var_list):
        return self.__dict__["_tfdist_sharded"].finalize_variable_values(var_list)

    def save_own_variables(self, store):
        return self.__dict__["_tfdist_sharded"].save_own_variables(store)

    def load_own_variables(self, store):
        return self.__dict__["_tfdist_sharded"].load_own_variables(store)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return self.__dict__["_tfdist_sharded"].trackable_children(save_type, **kwargs)


class _ShardedLossScale:
    """A `LossScaleOptimizer` whose inner optimizer is sharded: saves as a single-device one does.

    Keras's `save_own_variables` writes `variables` (its own, then the inner
    optimizer's, which here are flat slices); this writes its own, then the
    inner optimizer's canonical single-device state, so `.keras` and
    `.weights.h5` files load on any strategy and replica count.
    """

    def save_own_variables(self, store):
        inner = self.inner_optimizer.__dict__["_tfdist_sharded"]
        values = [v.numpy() for v in self._variables] + list(inner.canonical_values())
        for i, value in enumerate(values):
            store[str(i)] = value

    def load_own_variables(self, store):
        inner = self.inner_optimizer.__dict__["_tfdist_sharded"]
        own = len(self._variables)
        if inner.loads_as_unbuilt(store, self.name) or inner.skips_other_state(len(store.keys()), own):
            return
        values = [store[str(i)] for i in range(len(store.keys()))]
        inner.load_canonical_values(values[own:])  # validates before anything is written
        for variable, value in zip(self._variables, values[:own]):
            variable.assign(value)


_derived: dict = {}


def _derived_class(cls, mixin):
    """`cls` with `mixin` in front, same name and module; cached; known to Keras's serialization."""
    key = (cls, mixin)
    if key not in _derived:
        derived = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _serialize_as(derived, cls)
        _derived[key] = derived
    return _derived[key]


def _serialize_as(derived, cls) -> None:
    """Keras writes `derived` under `cls`'s public or registered name (`keras.optimizers.Adam`).

    Keras's `serialize_keras_object` names a class by its exact entry in
    `api_export.REGISTERED_OBJS_TO_NAMES` (built-in classes) or
    `object_registration.GLOBAL_CUSTOM_NAMES` (`register_keras_serializable`),
    else by its module (`keras.src.optimizers.adam`), which a loader without
    tfdist must not be asked to import. Verified on Keras 3.5 to 3.15.
    """
    from keras.src.api_export import REGISTERED_OBJS_TO_NAMES
    from keras.src.saving import object_registration

    if cls in REGISTERED_OBJS_TO_NAMES:
        REGISTERED_OBJS_TO_NAMES[derived] = REGISTERED_OBJS_TO_NAMES[cls]
    if cls in object_registration.GLOBAL_CUSTOM_NAMES:
        object_registration.GLOBAL_CUSTOM_NAMES[derived] = object_registration.GLOBAL_CUSTOM_NAMES[cls]


def unsharded_class(optimizer):
    """The user's optimizer class under tfdist's derived one (itself if not derived)."""
    cls = type(optimizer)
    while cls.__bases__ and cls.__bases__[0] in (_ShardedOptimizer, _RecordsSlots, _ShardedLossScale):
        cls = cls.__bases__[1]
    return cls


def make_sharded_optimizer(optimizer, sharded, loss_scale_optimizer=None) -> None:
    """Makes `optimizer` (unbuilt) the sharded optimizer whose state `sharded` holds.

    The instance changes class to a same-named subclass of its own class with
    `_ShardedOptimizer` in front, so the user's reference is the compiled
    optimizer, and optimizers outside the sharded strategy are untouched.
    Keras calls `optimizer.build(model.trainable_variables)` from `fit`,
    `compile_from_config` and `apply`; every such call now builds the slices.
    `apply` (and `apply_gradients`, which calls it) from a custom `train_step`
    or training loop runs the sharded update. `loss_scale_optimizer`, the
    `LossScaleOptimizer` whose inner optimizer `optimizer` is (mixed_float16),
    saves its inner state in the single-device layout (`_ShardedLossScale`).
    """
    object.__setattr__(optimizer, "_tfdist_sharded", sharded)
    optimizer.__class__ = _derived_class(type(optimizer), _ShardedOptimizer)
    if loss_scale_optimizer is not None:
        loss_scale_optimizer.__class__ = _derived_class(type(loss_scale_optimizer), _ShardedLossScale)


def sharded_state(optimizer):
    """The `ShardedState` of a sharded optimizer (or of a LossScaleOptimizer's sharded inner one), or `None`."""
    optimizer = inner_optimizer(optimizer)
    if isinstance(optimizer, _ShardedOptimizer):
        return optimizer.__dict__["_tfdist_sharded"]
    return None


def guard_load_weights(model, snapshot_fn, restore_fn) -> None:
    """Makes `model.load_weights` all-or-nothing: on any error the model is restored, then it re-raises.

    Keras loads layer by layer and raises the collected errors at the end, so
    a checkpoint of another model, or of another optimizer, leaves some
    variables overwritten. `snapshot_fn()` returns the state to keep (host
    copies); `restore_fn(snapshot)` writes it back. Set on the instance.
    """
    if "load_weights" in vars(model):
        return  # already guarded (the sharded optimizer guards its own state first)
    original = model.load_weights

    @functools.wraps(original)
    def load_weights(*args, **kwargs):
        snapshot = snapshot_fn()
        try:
            return original(*args, **kwargs)
        except ValueError as error:
            restore_fn(snapshot)
            shorter = _without_variable_values(str(error))
            if shorter == str(error):
                raise
            raise ValueError(shorter) from None
        except Exception:
            restore_fn(snapshot)
            raise

    object.__setattr__(model, "load_weights", load_weights)


def _without_variable_values(message: str) -> str:
    """Keras's load error with each variable's printed values cut (`<Variable path=..., value=[...]>`).

    Keras 3.15's `Variable.__repr__` prints the whole value; a checkpoint of
    another architecture would put every mismatched tensor in the message.
    """
    import re

    return re.sub(r"(<Variable path=[^,>]+, shape=[^>]*?), value=(?:\[.*?\]|[^>\[]*)>", r"\1>", message, flags=re.S)


@functools.cache
def saved_beside_optimizer_class():
    """A base class for state tfdist keeps beside an optimizer, saved by Keras and by `tf.train.Checkpoint`.

    Keras 3's saving (`saving_lib._save_state`, `.keras` and `.weights.h5`)
    walks each saved object's attributes (`_walk_trackable`) and writes every
    `KerasSaveable` among them under the object's path with its
    `save_own_variables`; loading calls its `load_own_variables` with that
    path's entries (none for a file written without it), and a model without
    the attribute ignores them. `tf.train.Checkpoint` follows the Keras
    TensorFlow optimizer's trackable attributes: a `tf.Module`'s variables
    are written as its dependencies, and restored when they are created later
    (deferred restoration). `_obj_type` must be a type Keras's walk knows
    (`get_attr_skipset`); "Loss" makes it skip only `keras.losses.Loss`'s own
    attributes. Verified on Keras 3.5-3.15.
    """
    from keras.src.saving.keras_saveable import KerasSaveable

    class SavedBesideOptimizer(KerasSaveable, tf.Module):
        def _obj_type(self):
            return "Loss"

    return SavedBesideOptimizer


def attach_to_optimizer(optimizer, name: str, state) -> None:
    """Sets `state` (a `saved_beside_optimizer_class()`) as the optimizer's attribute `name`.

    Set on the optimizer the model holds (a LossScaleOptimizer's outer one),
    whose attributes Keras's saving walks.
    """
    setattr(optimizer, name, state)


def beside_optimizer(optimizer, name: str):
    """The state `attach_to_optimizer` set as `name`, or None."""
    return getattr(optimizer, name, None) if optimizer is not None else None


# ---------------------------------------------------------------------------
# Exact resume and preemption (tfdist.checkpointing, tfdist.preemption).
# Verified on Keras 3.15.
# ---------------------------------------------------------------------------


def set_backup_and_restore_batch(callback, batch: int) -> None:
    """Sets the batch `BackupAndRestore` last saw in this epoch, and restarts its `save_freq` count.

    A resumed epoch's skipped batches are not seen by Keras's own
    `on_train_batch_end` (it would save a backup during them); this keeps its
    count where the skipped batches leave it.
    """
    callback._last_batch_seen = batch
    callback._batches_seen_since_last_saving = 0


def write_weights_h5(model, file) -> None:
    """Writes `model.save_weights`'s `.weights.h5` content into `file` (an `io.BytesIO`).

    Keras's `saving_lib.save_weights_only` without its file name check:
    `H5IOStore` on a `BytesIO`, then `_save_state` (Keras 3.5 to 3.15). The
    same objects save their variables as for `model.save_weights(path)`
    (the sharded optimizer its canonical state).
    """
    from keras.src.saving import saving_lib

    store = saving_lib.H5IOStore(file, mode="w")
    try:
        saving_lib._save_state(model, weights_store=store, assets_store=None, inner_path="",
                               visited_saveables=set())
    finally:
        store.close()


def set_resume_epoch(model, epoch: int) -> None:
    """Makes `fit` start at `epoch`, as `BackupAndRestore._load_model` does (`model._initial_epoch`)."""
    model._initial_epoch = epoch


def optimizer_strategy(optimizer):
    """The `tf.distribute` strategy a Keras optimizer was created under (`_distribution_strategy`,
    read by its TensorFlow backend to create its slots; Keras 3.0 to 3.15), or None."""
    return getattr(optimizer, "_distribution_strategy", None)

"""Keras private APIs, behind named functions: the only module that reaches into Keras.

Every accessor here names what it reads and the Keras versions it was verified
on (the supported range is `tfdist._compat.versions`, checked when a strategy
is created; every private name read here is declared in
`tfdist._compat.private_names` and checked against the installed Keras by
`tests/compat/test_private_names.py`). Workarounds name their upstream issue
(or quote the upstream error) in their docstrings, and each has a test that
fails without it; a version gate names the release that changed the API.
Process-wide patches are entries of `tfdist._compat.patches`; the wrappers
this module provides for them are `patch_implementations()`. Nothing here
imports another tfdist module but `tfdist._compat`'s; the layers above call
these functions instead of touching `keras.src` or a private attribute.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Sequence

import keras
import tensorflow as tf

from tfdist._compat import patches


def keras_version() -> tuple[int, int]:
    """The installed Keras's (major, minor): what version gates compare."""
    from tfdist._compat import versions

    return versions.installed()["keras"][:2]


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
    """Whether `optimizer` clips with Keras's own `_clip_gradients` on whole gradients.

    The sharded optimizer (`tfdist.strategies.sharded`) clips flat slices,
    whose norms it sums across replicas; it says so on its state.
    """
    state = vars(optimizer).get("_tfdist_sharded")
    return state is None or not state.clips_slices


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
    storage). Verified on Keras 3.10 to 3.15.
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


def _placed_backend_update_step(self, grads, trainable_variables, learning_rate):
    """What tfdist puts in the place of Keras's TensorFlow backend for `_backend_update_step`.

    Keras splits an optimizer's update in two: the optimizer's own classes
    (`Nadam._backend_update_step`, which advances its `u_product` once per
    step and calls `super()`; every `update_step`) and the backend's
    `_backend_update_step` below them, which on TensorFlow all-reduces in a
    replica context and reaches each variable's `update_step` through
    `strategy.extended.update` under a `merge_call`. tfdist updates in
    cross-replica context on gradients it already reduced, and places each
    variable's update itself: this method, in a class put between the
    optimizer's own classes and Keras's TensorFlow backend
    (`run_update_step`), hands each `(gradient, variable)` to the placement.
    Verified on Keras 3.10 to 3.15 (`keras.src.backend.tensorflow.optimizer.TFOptimizer`).
    """
    place = self.__dict__["_tfdist_place_update"]
    for grad, variable in zip(grads, trainable_variables):
        place(variable, grad, learning_rate)


_placed_update_classes: dict = {}


def _placed_update_class(cls):
    """`cls` with tfdist's `_backend_update_step` just above Keras's TensorFlow backend class in its MRO (same name)."""
    if cls not in _placed_update_classes:
        from keras.src.backend.tensorflow.optimizer import TFOptimizer

        backend = type("PlacedUpdateBackend", (TFOptimizer,), {"_backend_update_step": _placed_backend_update_step})
        derived = type(cls.__name__, (cls, backend), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        mro = derived.__mro__
        if TFOptimizer not in mro or mro.index(backend) != mro.index(TFOptimizer) - 1:
            raise TypeError(f"{cls.__name__} does not derive from Keras's TensorFlow optimizer class")
        _placed_update_classes[cls] = derived
    return _placed_update_classes[cls]


def run_update_step(optimizer, grads: Sequence, variables: Sequence, learning_rate, place) -> None:
    """Runs the optimizer's `_backend_update_step` with `place(variable, gradient, learning_rate)` for each variable.

    The optimizer's own `_backend_update_step` (Nadam's once-per-step
    `u_product`, a subclass's override) runs as Keras runs it; where its
    `super()` reaches the TensorFlow backend, each variable's update goes to
    `place`, which runs the optimizer's `update_step` where the strategy puts
    it. The optimizer's class is a same-named subclass with tfdist's backend
    for the call only (`_PlacedUpdateBackend`), then its own again.
    """
    cls = optimizer.__class__
    object.__setattr__(optimizer, "_tfdist_place_update", place)
    optimizer.__class__ = _placed_update_class(cls)
    try:
        optimizer._backend_update_step(list(grads), list(variables), learning_rate)
    finally:
        optimizer.__class__ = cls
        object.__delattr__(optimizer, "_tfdist_place_update")


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
    (per thread). Verified on Keras 3.10 to 3.15.
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
    3.10 to 3.15.
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
    from keras.src.backend.common.symbolic_scope import SymbolicScope

    x_spec = unpack_data(specs)[0]

    def wrap(original):
        def compute_output_spec(fn, *args, **kwargs):
            if fn is not model:
                return original(fn, *args, **kwargs)
            with keras.StatelessScope(), SymbolicScope():
                traced = tf.function(lambda x: fn(x, **kwargs), autograph=False).get_concrete_function(x_spec)
            return tf.nest.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype), traced.structured_outputs)

        return compute_output_spec

    with patches.temporarily("backend.compute_output_spec", wrap):
        model._symbolic_build(data_batch=data_batch)


def epoch_element_spec(epoch_iterator):
    """One replica's element spec of a Keras TF epoch iterator's input, or None.

    Reads `TFEpochIterator._distributed_dataset` (Keras 3.10 to 3.15) and unwraps
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

    Installs the registry's `Variable.numpy`, `Variable.__array__`,
    `Variable.assign_add`, `Variable.assign_sub` and
    `Variable._serialize_to_tensors` (`tfdist._compat.patches`; idempotent;
    other variables behave exactly as before), for three upstream behaviours
    of Keras 3's TensorFlow `Variable`:

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
    patches.install_named(*(f"Variable.{name}" for name in _PATCHED_VARIABLE_METHODS))


def _on_ps(variable) -> bool:
    from keras.src.backend.common.variables import in_stateless_scope
    from tensorflow.python.distribute.ps_values import CachingVariable
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    return isinstance(variable._value, (CachingVariable, ShardedVariable)) and not in_stateless_scope()


def _ps_variable_numpy(original):
    @functools.wraps(original)
    def numpy(self):
        if is_sharded(self):
            return tf.convert_to_tensor(self.value).numpy()
        return original(self)

    return numpy


def _ps_variable_array(original):
    @functools.wraps(original)
    def __array__(self, dtype=None):
        if is_sharded(self):
            import numpy as np

            return np.asarray(tf.convert_to_tensor(self.value).numpy(), dtype=dtype)
        return original(self, dtype)

    return __array__


def _ps_variable_increment(method: str):
    def wrap(original):
        @functools.wraps(original)
        def increment(self, value):
            if _on_ps(self):
                return getattr(self._value, method)(tf.cast(value, self._value.dtype))
            return original(self, value)

        return increment

    return wrap


def _ps_variable_serialize(original):
    @functools.wraps(original)
    def _serialize_to_tensors(self):
        if is_sharded(self):
            return {"VARIABLE_VALUE": tf.convert_to_tensor(self._value)}
        return original(self)

    return _serialize_to_tensors


def _number_conversion(convert):
    """Wrapper of Keras's `Variable.__int__`/`__float__` (registry: `Variable.__int__`, `Variable.__float__`).

    `int(v)` and `float(v)` of a Keras variable whose value is a distributed
    variable. Keras 3's `Variable.__int__` is `int(self.value)`, and a
    `MirroredVariable` (any `tf.distribute` variable) has no `__int__`: under
    every strategy, `int(model.optimizer.iterations)` raises "TypeError: int()
    argument must be a string, a bytes-like object or a real number, not
    'MirroredVariable'" (stock `tf.distribute` too; no upstream issue found).
    Such a value is converted from `numpy()` (one replica's copy, which every
    copy equals for mirrored state). Other variables: Keras's own methods.
    Verified on Keras 3.10 to 3.15 (`keras.src.backend.common.variables.Variable`).
    """

    def wrap(original):
        @functools.wraps(original)
        def method(self):
            if isinstance(getattr(self, "_value", None), tf.distribute.DistributedValues):
                return convert(self.numpy())
            return original(self)

        return method

    return wrap


def seed_folding(applies):
    """Wrapper of `SeedGenerator.next` (registry: `SeedGenerator.next`): each replica of a strategy `applies(strategy)` accepts draws its own random numbers.

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
    Verified on Keras 3.10 to 3.15 (`keras.src.random.seed_generator.SeedGenerator`).
    """

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

    return wrap


def holds_shards(source) -> bool:
    """Whether `source` is a `ShardedVariable` or a Keras variable whose value is one.

    Reads Keras's private `_value` rather than `value`: no initializer call, no
    autocast, so asking never changes what the caller's tape or optimizer sees.
    """
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    if isinstance(source, ShardedVariable):
        return True
    return isinstance(source, keras.Variable) and isinstance(getattr(source, "_value", None), ShardedVariable)


_unscaled_losses = threading.local()


def _unscaled_loss_scaling(original):
    """Wrapper of `scale_loss_for_distribution` (registry: `loss.scale_loss_for_distribution`)."""

    @functools.wraps(original)
    def scale_loss_for_distribution(value):
        if getattr(_unscaled_losses, "depth", 0):
            return value
        return original(value)

    return scale_loss_for_distribution


def keras_losses_unscaled():
    """Context in which Keras loss objects return the replica's mean loss, not 1/N of it.

    Under a strategy with N replicas, Keras 3 divides every
    `"sum_over_batch_size"` loss by N (`keras.src.losses.loss.
    scale_loss_for_distribution`), for its own train step. A `model_fn`
    returns the mean loss over its replica's batch however it computed it
    (a Keras loss object or `tf.reduce_mean`), and the runner weights it by
    the batch size itself; inside this context (per thread: MirroredStrategy
    runs replicas in threads) Keras leaves the loss unscaled. The registry's
    `loss.scale_loss_for_distribution` (installed with every tfdist strategy,
    and here if not yet) defers to Keras outside the context. Verified on
    Keras 3.10 to 3.15 (3.8 made Keras scale a replica's loss).
    """
    patches.install_named("loss.scale_loss_for_distribution")
    state = _unscaled_losses

    @contextlib.contextmanager
    def scope():
        state.depth = getattr(state, "depth", 0) + 1
        try:
            yield
        finally:
            state.depth -= 1

    return scope()


_reduction_records = threading.local()


def _recording_reductions(original):
    """Wrapper of `reduce_weighted_values` (registry: `loss.reduce_weighted_values`); see `recording_loss_reductions`."""
    from keras.src.losses import loss as loss_module

    state = _reduction_records

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

    return reduce_weighted_values


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

    Through the registry's `loss.reduce_weighted_values` (installed with every
    tfdist strategy, and here if not yet; it defers to Keras and records
    nothing outside the context). Verified on Keras 3.10 to 3.15.
    """
    patches.install_named("loss.reduce_weighted_values")
    return _thread_setting(_reduction_records, "records", [])


@contextlib.contextmanager
def _thread_setting(state: threading.local, name: str, value):
    """Sets `state.<name>` to `value` for the context (this thread); yields `value`."""
    outer = getattr(state, name, None)
    setattr(state, name, value)
    try:
        yield value
    finally:
        setattr(state, name, outer)


_output_loss_weights = threading.local()


def _weighted_output_losses(original):
    """Wrapper of `CompileLoss.call` (registry: `CompileLoss.call`); see `output_losses_weighted`."""
    state = _output_loss_weights

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

    return call


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
    as the logged total loss is. Through the registry's `CompileLoss.call`
    (installed with every tfdist strategy, and here if not yet; it defers to
    Keras outside the context; per thread: MirroredStrategy traces replicas in
    threads); a Keras without `CompileLoss._flat_losses` keeps its own
    weighting. Verified on Keras 3.15.
    """
    patches.install_named("CompileLoss.call")
    state = _output_loss_weights

    return _thread_setting(state, "weight", weight)


def trackable_children(cls, obj, save_type, **kwargs) -> dict:
    """`cls`'s own `_trackable_children` of `obj` (TensorFlow's checkpoint dependencies; verified on TF 2.16-2.21)."""
    return cls._trackable_children(obj, save_type, **kwargs)


def uses_weight_decay(optimizer, variable) -> bool:
    return optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)


def slots_initialised_from_weights(optimizer) -> tuple[str, ...]:
    """Slots an optimizer's `build` fills with a copy of the variable (not zeros).

    Keras's ScheduleFreeAdamW starts its momentum at the weights (verified on
    Keras 3.11 to 3.15).
    """
    schedule_free = getattr(keras.optimizers, "ScheduleFreeAdamW", None)
    if schedule_free is not None and isinstance(optimizer, schedule_free):
        return ("momentum",)
    return ()


def keras_update_is_elementwise(optimizer) -> bool:
    """Whether `optimizer` updates with one of Keras's element-wise built-in updates, unchanged.

    The built-ins whose `update_step` reads and writes each element of a
    variable and of its slots alone (verified on Keras 3.10 to 3.15): SGD, Adam
    (and AdamW, which keeps Adam's), Adamax, Adagrad, Adadelta, RMSprop,
    Nadam, Lion, Ftrl, ScheduleFreeAdamW. Lamb (its trust ratio), Adafactor
    (factored moments), Muon (orthogonalisation) and MultiOptimizer are not.
    The class's `update_step` and `_backend_update_step` must be the
    built-in's own: a subclass that changes either may do anything.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    names = ("SGD", "Adam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Lion", "Ftrl", "ScheduleFreeAdamW")
    classes = [getattr(keras.optimizers, name) for name in names if hasattr(keras.optimizers, name)]
    cls = type(optimizer)
    backends = {c._backend_update_step for c in classes} | {TFOptimizer._backend_update_step}
    return cls.update_step in {c.update_step for c in classes} and cls._backend_update_step in backends


def clip_gradients_as(cls, optimizer, grads: Sequence) -> list:
    """`cls`'s own `_clip_gradients` of `optimizer` (Keras's clipping, not a subclass's)."""
    return cls._clip_gradients(optimizer, list(grads))


def variable_at_path(path: str, value, trainable: bool = False) -> keras.Variable:
    """A Keras variable holding `value` whose `path` (and so `name`) is `path`, as another variable's.

    Keras derives a variable's path from its name-scope stack
    (`keras.src.backend.common.name_scope`, `override_parent`; verified on
    Keras 3.10 to 3.15); optimizers route and exclude variables by it
    (MultiOptimizer's map, Muon's `exclude_layers`, `exclude_from_weight_decay`
    names).
    """
    from keras.src.backend.common.name_scope import name_scope

    parent, _, name = path.rpartition("/")
    if not parent:
        return keras.Variable(value, trainable=trainable, name=name)
    above, _, last = parent.rpartition("/")
    with name_scope(last, override_parent=above, deduplicate=False):
        return keras.Variable(value, trainable=trainable, name=name)


def state_by_variable(optimizer) -> dict:
    """`{id(TensorFlow variable it trains): [(list attribute, state variable), ...]}` of `optimizer`'s per-variable state.

    Keras optimizers keep per-variable state in list attributes indexed by
    the variable's position among the variables they were built on
    (`self._momentums[self._get_variable_index(v)]`: slots, Adafactor's
    factored moments, EMA's `_model_variables_moving_average`; verified on
    Keras 3.10 to 3.15). A MultiOptimizer's sub-optimizers keep theirs.
    """
    optimizers = [optimizer] + (list(optimizer._inner_optimizers) if is_multi_optimizer(optimizer) else [])
    out: dict = {}
    for opt in optimizers:
        trained = list(getattr(opt, "_trainable_variables", []))
        for attribute, value in vars(opt).items():
            if attribute in ("_variables", "_trainable_variables") or not isinstance(value, list):
                continue
            if len(value) != len(trained):
                continue
            for variable, entry in zip(trained, value):
                if isinstance(entry, keras.Variable) and entry is not variable:
                    out.setdefault(id(tf_variable(variable)), []).append((attribute, entry))
    return out


@contextlib.contextmanager
def updates_as(optimizer, variable, stand_in):
    """Inside: `optimizer` finds `variable`'s state for `stand_in`, a real `tf.Variable` it updates in its place.

    Keras (verified on 3.10 to 3.15, TensorFlow backend) finds a variable's
    slots by its position, `_trainable_variables_indices[_var_key(v)]`
    (`_get_variable_index`); `stand_in` gets `variable`'s position for the
    duration, so `update_step(gradient, stand_in, lr)` reads and writes a
    variable with every behaviour of one (reads where they are used, writes
    in program order, `tf.cond`, `scatter_*`) and the slots of `variable`.
    """
    indices = optimizer._trainable_variables_indices
    key = optimizer._var_key(stand_in)
    position = indices.get(optimizer._var_key(variable))
    added = position is not None and key not in indices
    if added:
        indices[key] = position
    try:
        yield stand_in
    finally:
        if added:
            del indices[key]


@contextlib.contextmanager
def slots_as_parts(optimizer, variable, index: int):
    """Inside: part `index` of `variable` (held in parts) is updated as `variable`, its slots reading as their part.

    Yields the part, a `tf.Variable` (`updates_as`). Keras optimizers keep
    per-variable state in list attributes indexed by the variable's position
    (`self._momentums[self._get_variable_index(v)]`, the index from the
    private `_trainable_variables_indices`; verified on Keras 3.15: Adam,
    AdamW, SGD, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Lion, Ftrl, and
    EMA's `_model_variables_moving_average`). The entry at `variable`'s
    position of every such list, when it is a Keras variable whose value is a
    `ShardedVariable`, is replaced by that value's part `index` for the
    duration, then restored: only entries split exactly as `variable` is (a
    slot, part beside part), never `variable` itself. A variable the
    optimizer does not train (an EMA average) has no slots: nothing is
    replaced.
    """
    parts = variable_parts(variable)
    layout = [(p.shape, p.device) for p in parts]

    def part(entry):
        if not (isinstance(entry, keras.Variable) and is_sharded(entry)):
            return None
        # A slot is split like its variable, part beside part: a list that is
        # not indexed by variable (the optimizer's `_variables`) is left alone.
        if [(p.shape, p.device) for p in variable_parts(entry)] != layout:
            return None
        return tf_variable(entry).variables[index]

    with _slot_entries_replaced(optimizer, variable, part), updates_as(optimizer, variable, parts[index]) as own:
        yield own


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


def all_layers(model) -> list:
    """Every layer of `model`, nested ones included (Keras's private `_flatten_layers`)."""
    return list(model._flatten_layers(include_self=False))


def top_level_layers(model) -> list:
    """The layers `model` calls directly (Keras's private `_flatten_layers`, not recursive)."""
    return list(model._flatten_layers(include_self=False, recursive=False))


def stateless_values(scope) -> dict:
    """`{id(variable): value}` of a `keras.StatelessScope`: its mapping and the updates recorded so far.

    Private: `StatelessScope.state_mapping` (the dict `get_current_value`
    reads and `add_update` writes). Verified on Keras 3.10 to 3.15.
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
    Verified on Keras 3.10 to 3.15.
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
    verified on Keras 3.10 to 3.15.
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
    `keras.src.backend.common.global_state`. Verified on Keras 3.10 to 3.15.
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


# ---------------------------------------------------------------------------
# The wrappers this module provides to the patch registry (tfdist._compat.patches);
# tfdist.keras_integration provides the integration's.
# ---------------------------------------------------------------------------


def patch_implementations() -> dict:
    """`{patch name: wrapper(original) -> replacement}` for the registry's accessor-level patches."""
    return {
        "Variable.__int__": _number_conversion(int),
        "Variable.__float__": _number_conversion(float),
        "loss.scale_loss_for_distribution": _unscaled_loss_scaling,
        "loss.reduce_weighted_values": _recording_reductions,
        "CompileLoss.call": _weighted_output_losses,
        "Variable.numpy": _ps_variable_numpy,
        "Variable.__array__": _ps_variable_array,
        "Variable.assign_add": _ps_variable_increment("assign_add"),
        "Variable.assign_sub": _ps_variable_increment("assign_sub"),
        "Variable._serialize_to_tensors": _ps_variable_serialize,
    }


def model_strategy(model):
    """The strategy a model was built under (Keras's `_distribute_strategy`), or None."""
    return getattr(model, "_distribute_strategy", None)


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
    Keras 3.10 to 3.15): the strategy's `experimental_distribute_dataset` result, or None."""
    return getattr(epoch_iterator, "_distributed_dataset", None)


def epoch_batch_size(epoch_iterator):
    """The batch size an epoch iterator's data adapter knows (`EpochIterator.data_adapter.batch_size`), or None."""
    adapter = getattr(epoch_iterator, "data_adapter", None)
    size = getattr(adapter, "batch_size", None) if adapter is not None else None
    return size if isinstance(size, int) else None


def redirect_backup_and_restore(callback, backup_dir: str) -> None:
    """Points a `BackupAndRestore` at `backup_dir` after it restored (its private paths;
    verified on Keras 3.10 to 3.15)."""
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


def is_remote_path(path: str) -> bool:
    """Keras's test for a path it writes through `tf.io.gfile` (`gs://`, `/cns`, ...)."""
    from keras.src.utils import file_utils

    return bool(file_utils.is_remote_path(path))


def ask_to_proceed_with_overwrite(path: str) -> bool:
    """Keras's interactive prompt of `save(..., overwrite=False)` for an existing file."""
    from keras.src.utils import io_utils

    return bool(io_utils.ask_to_proceed_with_overwrite(path))


_derived: dict = {}


def same_named_subclass(cls, mixin):
    """`cls` with `mixin` in front, same name and module; cached; known to Keras's serialization.

    Keras writes the subclass under `cls`'s public or registered name
    (`keras.optimizers.Adam`): its `serialize_keras_object` names a class by
    its exact entry in `api_export.REGISTERED_OBJS_TO_NAMES` (built-in
    classes) or `object_registration.GLOBAL_CUSTOM_NAMES`
    (`register_keras_serializable`), else by its module
    (`keras.src.optimizers.adam`), which a loader without tfdist must not be
    asked to import. Verified on Keras 3.10 to 3.15.
    """
    key = (cls, mixin)
    if key not in _derived:
        from keras.src.api_export import REGISTERED_OBJS_TO_NAMES
        from keras.src.saving import object_registration

        derived = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        if cls in REGISTERED_OBJS_TO_NAMES:
            REGISTERED_OBJS_TO_NAMES[derived] = REGISTERED_OBJS_TO_NAMES[cls]
        if cls in object_registration.GLOBAL_CUSTOM_NAMES:
            object_registration.GLOBAL_CUSTOM_NAMES[derived] = object_registration.GLOBAL_CUSTOM_NAMES[cls]
        _derived[key] = derived
    return _derived[key]


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
    attributes. Verified on Keras 3.10-3.15.
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
    `H5IOStore` on a `BytesIO`, then `_save_state` (Keras 3.10 to 3.15). The
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

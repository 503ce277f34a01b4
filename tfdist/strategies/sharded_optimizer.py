"""Data parallelism with the optimizer state split across replicas (ZeRO stages 1, 2 and 3).

Plain data parallelism keeps a full copy of the optimizer state on every
replica: Adam's two float32 slots are 8 bytes per parameter on each device.
Here each replica owns one even 1/N slice of the flattened trainable
parameters — one chunk of every bucket (`tfdist.sharding.FlatLayout`) — and
keeps the optimizer state of that slice only (Rajbhandari et al., "ZeRO",
2020).

One step, per replica:

1. local gradients (the step engine's phase 1);
2. reduction to the replica's slice: on one host, in a plain `fit` step,
   inside the backward pass, group of layers by group as each group's
   backward ends (`tfdist.engine.gather.LayerReductions`,
   `ShardedState.reduce_by_unit`), so a replica holds about one group's
   local gradients at a time; otherwise stage 1 all-reduces the gradients
   and keeps its slice, and stage 2 reduce-scatters the flattened gradient
   bucket by bucket (`tfdist.collectives.reduce_scatter_sum`), so a replica
   never holds more than its gradient slice and two buckets;
3. the engine's `finish` on the slice (normalise, unscale, clip — clipping
   norms are summed across slices, so `clipnorm` and `global_clipnorm` match
   one device);
4. the optimizer's own `update_step` on the slice, read from the weights and
   updated as a tensor (no float32 copy of it is kept), with its state for
   the slice only; weight decay, learning-rate schedules and EMA as in Keras;
5. all-gather of the updated chunks bucket by bucket, each written straight
   into the replicated model variables it covers.

The model's optimizer is the user's Keras optimizer, unchanged in class and
config; it is built on one flat per-replica variable (which holds no memory)
instead of the model's variables, and it saves and loads a canonical (unsharded) state, the one a
single-device optimizer would save, so checkpoints move freely between this
strategy, mirrored, one device and other replica counts.

Stage 3 (one host) also holds the parameters in shards: every trainable
variable is a `ShardedVariable` whose rows are split over the replicas'
devices (`tfdist._compat.tf.shard_trainable_variables`), the optimizer's
slots split alike; each replica gathers each layer's variables just before
the layer runs and frees them after, gathers them again for the layer's
backward pass (the layer recomputed: `tfdist.engine.gather`), each part's
rows of the replicas' gradients are summed on the part's device, and the
user's optimizer, unchanged, updates each part on its device
(`SHARDED_PARAMETERS`, below).

Across the worker processes of a job (TF_CONFIG with several workers, or
`cluster_resolver=`), `ShardedOptimizerStrategy(...)` returns a
`MultiWorkerShardedOptimizerStrategy`: the multi-worker strategy with this
step, replicas numbered across workers; saving all-gathers the state.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import collectives
from tfdist import options as options_lib
from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine import update
from tfdist.engine.step import ALL_REDUCE, GradientPath, regroup, summed_riders
from tfdist.sharding import (
    FlatLayout,
    dense_only,
    gather_range,
    gather_shard,
    gather_shard_slices,
    has_sparse,
    rows_in,
)
from tfdist.strategies.base import run_creation_hooks
from tfdist.strategies.mirrored import MirroredStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

# The default of `shard_bucket_bytes`: on one host, the flat layout's buckets
# are at most this many bytes (and at most `bucket_bytes`). A bucket's chunk
# is the unit of the optimizer update (`_OwnedSlices.chunked`) and of the
# all-gather into the weights, so a replica's update temporaries and gathered
# weights are about this size at a time, not its whole slice; fewer, larger
# buckets mean fewer collectives and ops per step. 2 MiB: on the benchmark's
# 3 x 2048 MLP it keeps stages 1 and 2 at mirrored's step time at N = 2 and
# 4 on the 2-core CPU host, where 1 MiB took 1.5x at N = 4 (docs/sharded_optimizer.md, Memory).
LAYOUT_BUCKET_BYTES = 2 << 20
SHARD_BUCKET_BYTES = options_lib.Option(
    name="shard_bucket_bytes",
    default=LAYOUT_BUCKET_BYTES,
    types=(int,),
    expected="an integer >= 0 (bytes per bucket of the sharded update; 0: the step's bucket_bytes)",
    doc=(
        "On one host, stages 1 and 2 update and all-gather the parameters in buckets of at most "
        "this many bytes (and at most bucket_bytes), and sum a gradient larger than it in pieces "
        "of this size: smaller lowers the step's peak memory, larger runs fewer collectives and "
        "ops. Default 2 MiB; 0 uses bucket_bytes (across workers bucket_bytes always)."
    ),
    check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
)
STAGE = options_lib.Option(
    name="stage",
    default=1,
    types=(int,),
    expected="1, 2 or 3",
    doc=(
        "ZeRO stage: 1 shards the optimizer state; 2 also reduce-scatters the "
        "gradients so each replica keeps only its slice; 3 also shards the "
        "parameters (one host)."
    ),
    check=lambda v: v in (1, 2, 3),
)

# Optimizers whose update needs whole-tensor quantities a slice does not have.
_WHOLE_TENSOR_OPTIMIZERS = {
    "Lamb": "its trust ratio needs each variable's whole weight and update norms",
    "Adafactor": "its factored second moments need each variable's whole rows and columns",
    "Muon": "it orthogonalises each variable's whole update matrix",
    "MultiOptimizer": "it routes each model variable to its own sub-optimizer, and a slice mixes "
    "elements of several variables",
}

def _updates_per_element(optimizer) -> bool:
    """Whether `optimizer`'s update is element-wise, so it can run on any part of a variable and its slots."""
    return type(optimizer).__name__ not in _WHOLE_TENSOR_OPTIMIZERS and not kc.is_multi_optimizer(optimizer)


_TF_KERAS_MESSAGE = (
    "tf-keras models cannot be trained under the 'sharded_optimizer' strategy: tf-keras "
    "runs its own distributed step and would keep a full optimizer state on every replica. "
    "Use Keras 3 (`import keras`), or tfdist.get_strategy('mirrored') with tf-keras."
)


class _ShardedStrategyMixin:
    """What the single-host and the multi-worker sharded strategies share."""

    # Reduce-scatter, update of the owned slices, all-gather (`sharded_optimizer_path`, below).
    gradient_path = GradientPath("sharded_optimizer", lambda step, data: sharded_optimizer_path(step, data))
    stage: int

    def unsupported(self, feature: str, model=None) -> str | None:
        dtype = self.options.allreduce_dtype
        if self.stage == 3 and feature != "estimator":
            return self._unsupported_at_stage_3(feature, model)
        if feature == "step_options" and dtype != "float32" and self.stage == 2:
            return (
                f"allreduce_dtype={dtype!r} is not used by the 'sharded_optimizer' strategy at stage=2: "
                "its reduce-scatter exchanges float32. Use stage=1 (whose all-reduce it compresses), or "
                "leave allreduce_dtype='float32'."
            )
        if feature == "optimizer":
            name = type(model.optimizer).__name__
            reason = _WHOLE_TENSOR_OPTIMIZERS.get(name)
            if reason:
                return (
                    f"Optimizer {name} is not supported by the 'sharded_optimizer' "
                    f"strategy: {reason}, and each replica holds only a flat slice. Use the mirrored "
                    "strategy, or an optimizer with per-element state (Adam, AdamW, SGD, Lion, ...)."
                )
        if feature == "run_eagerly" and self.shards_optimizer_state:
            return (
                f"run_eagerly=True is not supported by the 'sharded_optimizer' strategy at stage={self.stage} "
                f"with {self.num_replicas_in_sync} replicas: its replicas reduce and gather the optimizer's "
                "slices inside the traced step, and run eagerly the step hangs. Leave run_eagerly False (the "
                "default), or debug under the 'mirrored' strategy (the same replicas; stages 1 and 2 train to "
                "its weights within 1e-6) or at stage=3."
            )
        if feature == "estimator":
            return (
                "Strategy 'sharded_optimizer' is not supported by tfdist.estimator yet: it shards the "
                "optimizer state of a compiled Keras model (model.compile), and a model_fn has none. "
                "Use train_distribute='mirrored' (same replicas, full optimizer state per device)."
            )
        return None

    def _unsupported_at_stage_3(self, feature: str, model=None) -> str | None:
        if feature == "step_options" and self.options.allreduce_dtype != "float32":
            return (
                f"allreduce_dtype={self.options.allreduce_dtype!r} is not used by the 'sharded_optimizer' "
                "strategy at stage=3: each shard's gradient is summed onto the shard's device in float32, "
                "with no all-reduce to compress. Use stage=1, or leave allreduce_dtype='float32'."
            )
        if feature == "optimizer":
            overwritten = [v for v in model.trainable_variables if kc.overwrites_with_gradient(model.optimizer, v)]
            if overwritten:
                return (
                    f"The 'sharded_optimizer' strategy at stage=3 does not train {overwritten[0].path!r}: a "
                    "float8 layer's scales take their gradient as their value. Train float8 models under "
                    "mirrored."
                )
        return None

    def on_compile(self, model) -> None:
        """Makes the compiled optimizer build and save sharded state (after validation).

        At stage 3 the optimizer is the user's, unchanged: its slots are
        created beside each parameter part (`tfc.shard_trainable_variables`).
        Every stage: a failed `load_weights` leaves the model and optimizer as
        they were.
        """
        if model.optimizer is None:
            return
        if self.shards_optimizer_state:
            if kc.sharded_state(model.optimizer) is None:
                self._shard(model.optimizer)
            built_on = kc.sharded_state(model.optimizer).variables
            if model.built and built_on:
                _check_same_trainable_variables(model, built_on)
            elif model.built and not model.optimizer.built and model.trainable_variables:
                # Built now, not at the first step: a checkpoint restored between
                # `compile` and `fit` (`tf.train.Checkpoint(model=..., optimizer=...)
                # .restore(...)`) then finds the sharded slots to restore into.
                # Built later, TensorFlow's deferred restoration of the optimizer's
                # slot list never reached the sharded state's own: the moments were
                # dropped silently (tests/strategies/test_sharded_optimizer.py).
                model.optimizer.build(model.trainable_variables)
                # Ahead of Keras, which builds it at the first fit: until then
                # `load_weights` treats it as Keras treats an unbuilt one.
                kc.sharded_state(model.optimizer).built_ahead = True
        if not getattr(model, "_tfdist_load_guarded", False):
            kc.guard_load_weights(model, lambda: _snapshot(model), lambda saved: _restore(model, saved))
            object.__setattr__(model, "_tfdist_load_guarded", True)

    def on_keras_build(self, model) -> None:
        """Keras would build an unbuilt optimizer here: one built at `compile` now loads state as any built one."""
        state = kc.sharded_state(model.optimizer) if model.optimizer is not None else None
        if state is not None:
            state.built_ahead = False

    @property
    def shards_optimizer_state(self) -> bool:
        """Stages 1 and 2 over more than one replica: the optimizer becomes a sharded one.

        With one replica there is nothing to split: the optimizer stays
        Keras's own and the step is mirrored's (`_one_replica_trains_as_mirrored`),
        as fast as plain Keras; its checkpoints have the single-device layout
        the sharded optimizer also saves, so they move to and from any replica count.
        """
        return self.stage != 3 and self.num_replicas_in_sync > 1

    def _one_replica_trains_as_mirrored(self) -> None:
        """Called at the end of `__init__`: with one replica (stages 1 and 2), mirrored's gradient path."""
        if self.stage != 3 and not self.shards_optimizer_state:
            self.gradient_path = ALL_REDUCE

    def _shard(self, optimizer) -> None:
        """Stages 1 and 2: the optimizer becomes a sharded one (`ShardedState`)."""
        # Under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer:
        # the inner one is sharded (its slices read float32 weights: the master
        # copy), the engine's step scales the loss and gates the update.
        wrapper = optimizer if kc.is_loss_scale_optimizer(optimizer) else None
        optimizer = kc.inner_optimizer(optimizer)
        if optimizer.built:
            raise ValueError(
                f"The optimizer {optimizer.name!r} was already built (it holds full state for "
                f"{len(optimizer.variables)} variables), so it cannot be sharded. Pass a new, "
                "unbuilt optimizer to model.compile() under the 'sharded_optimizer' strategy."
            )
        # What Keras's `load_weights` loads into the unbuilt optimizer (iterations, learning rate).
        unbuilt = list((wrapper if wrapper is not None else optimizer).variables)
        state = ShardedState(self, optimizer, under_loss_scale=wrapper is not None, unbuilt_variables=unbuilt)
        kc.make_sharded_optimizer(optimizer, state, loss_scale_optimizer=wrapper)


class _ShardedStrategyType(type):
    """Makes the multi-worker variant count as a `ShardedOptimizerStrategy` in `isinstance`."""

    def __instancecheck__(cls, instance) -> bool:
        if cls is ShardedOptimizerStrategy and isinstance(instance, MultiWorkerShardedOptimizerStrategy):
            return True
        return super().__instancecheck__(instance)


class ShardedOptimizerStrategy(_ShardedStrategyMixin, MirroredStrategy, metaclass=_ShardedStrategyType):
    """Splits the optimizer state (stage 1), the gradients (stage 2) and the parameters (stage 3) across replicas.

    Parameters stay replicated on every device, as under mirrored; each
    replica keeps the optimizer state of an even 1/N slice of the flattened
    parameters, updates only that slice, and the slices are all-gathered back
    into the replicated weights after every step. Any Keras 3 optimizer whose
    update is per element works unchanged (SGD with momentum, Adam, AdamW,
    RMSprop, Adagrad, Adadelta, Adamax, Nadam, Lion, Ftrl).

    Args:
        stage: int, 1, 2 or 3. 1 all-reduces the gradients and each replica
            keeps its slice; 2 reduce-scatters them so each replica only ever
            holds its gradient slice after reduction; 3 (one host) holds each
            trainable variable and its optimizer state as parts, one per
            device, gathered layer by layer by each replica for its forward
            pass and again for its backward pass. Default 1.
        devices: Optional list of device strings (one host). Default: every
            local GPU, else every logical CPU device.
        cluster, cluster_resolver, communication, collective_timeout,
            devices_per_worker, auto_shard, hierarchical: run across the worker processes of
            a job, as the 'multi_worker' strategy does (same arguments, same
            TF_CONFIG resolution and validation). A TF_CONFIG listing several
            chief/worker tasks, or any of these arguments, makes the strategy
            a `MultiWorkerShardedOptimizerStrategy` (still an instance of this
            class): replicas are every device of every worker, and each owns
            1/N of the parameters, N = `num_replicas_in_sync` over the job.
        **options: step options (see `tfdist.options.STEP_OPTIONS`).

    Raises:
        ValueError: `stage` is not 1, 2 or 3, `devices` is given with a
            cluster, or `stage=3` with a cluster of several workers.
        tfdist.ClusterConfigError: TF_CONFIG (or `cluster`) is invalid.

    Example:

    ```python
    strategy = tfdist.get_strategy("sharded_optimizer", stage=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64)
    tfdist.memory_report(model)   # optimizer state: 1/N per device
    ```
    """

    name = "sharded_optimizer"
    # On one host, stages 1 and 2 reduce each group of layers' gradients as its backward pass ends.
    gradient_path = GradientPath(
        "sharded_optimizer", lambda step, data: sharded_optimizer_path(step, data), reduces_by_layer=True
    )
    # The multi-worker arguments are listed so that presets and error messages know them; given
    # (not None), they select MultiWorkerShardedOptimizerStrategy in __new__.
    PARAMS = {"stage": STAGE, "shard_bucket_bytes": SHARD_BUCKET_BYTES, "devices": options_lib.DEVICES,
              **MultiWorkerMirroredStrategy.PARAMS}

    def __new__(cls, *args, **kwargs):
        if cls is ShardedOptimizerStrategy and _runs_across_workers(kwargs):
            if kwargs.get("devices") is not None:
                raise ValueError(
                    "The 'sharded_optimizer' strategy takes 'devices' on one host only; across "
                    "workers use 'devices_per_worker'. Received: devices="
                    f"{kwargs['devices']!r} with a cluster of several workers"
                )
            kwargs.pop("devices", None)
            # Not a subclass, so Python does not call __init__ again.
            return MultiWorkerShardedOptimizerStrategy(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, stage: int = 1, devices: Sequence[str] | None = None, **options):
        _check_stage(stage)
        for name in MultiWorkerMirroredStrategy.PARAMS:  # None here, or moot (`hierarchical`): one host
            options.pop(name, None)
        super().__init__(devices=devices, stage=stage, **options)
        self.stage = stage
        if stage == 3:
            # Parameters and optimizer state in shards over the replicas' devices.
            tfc.shard_trainable_variables(self, self.extended.worker_devices)
            kc.patch_variables_for_parameter_servers()
            self.gradient_path = SHARDED_PARAMETERS
            run_creation_hooks("sharded_parameters", self)
        self._one_replica_trains_as_mirrored()
        tfc.refuse_tf_keras_variables(self, _TF_KERAS_MESSAGE)

    @classmethod
    def demo_kwargs(cls):
        return {"stage": 2}


class MultiWorkerShardedOptimizerStrategy(_ShardedStrategyMixin, MultiWorkerMirroredStrategy):
    """The sharded-optimizer strategy across the worker processes of a job.

    What `tfdist.get_strategy("sharded_optimizer", ...)` returns when TF_CONFIG
    lists several chief/worker tasks, or a `cluster`/`cluster_resolver` (or
    another multi-worker argument) is given; `isinstance(s,
    ShardedOptimizerStrategy)` holds. It is the 'multi_worker' strategy
    (TF_CONFIG, `cluster="slurm"` or `cluster_resolver=`, validated the same
    way; TensorFlow's collectives over gRPC; non-chief `fit` callbacks write
    to temporary directories; `write_dir`) with the sharded step: replicas are
    every device of every worker, replica `r` (`replica_id_in_sync_group`,
    worker-major) owns slice `r` of the flat parameters and keeps the
    optimizer state of that slice only. Saving (`model.save`,
    `save_weights`, `tf.train.Checkpoint`, ModelCheckpoint, BackupAndRestore)
    all-gathers the optimizer state across workers, so every worker must call
    it (the non-chief ones on `strategy.write_dir(path)`), as the multi-worker
    rule already asks.

    Args:
        stage: int, 1 or 2 (stage 3 runs on one host only: `ValueError`).
        **kwargs: the 'multi_worker' strategy's arguments (`cluster`,
            `cluster_resolver`, `communication`, `collective_timeout`,
            `devices_per_worker`, `auto_shard`) and step options.
    """

    name = "sharded_optimizer"
    PARAMS = {"stage": STAGE, "shard_bucket_bytes": SHARD_BUCKET_BYTES, **MultiWorkerMirroredStrategy.PARAMS}

    def __init__(self, stage: int = 1, **kwargs):
        _check_stage(stage)
        if stage == 3:
            raise ValueError(
                "The 'sharded_optimizer' strategy runs stage=3 on the devices of one host; across the "
                "workers of a job (TF_CONFIG, cluster or cluster_resolver) use stage=2, which shards "
                "the gradients and optimizer state. Received: stage=3 with a cluster of several workers"
            )
        super().__init__(stage=stage, **kwargs)
        self.stage = stage
        self._one_replica_trains_as_mirrored()
        tfc.refuse_tf_keras_variables(self, _TF_KERAS_MESSAGE)

    @classmethod
    def demo_kwargs(cls):
        return None


def _check_stage(stage) -> None:
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise options_lib.OptionError(f"Argument 'stage' must be 1, 2 or 3. Received: stage={stage!r}")


# The multi-worker strategy's own arguments: any of them selects the multi-worker variant
# (`hierarchical` does not: it only says how a job of several workers sums).
_CLUSTER_ARGUMENTS = tuple(name for name in MultiWorkerMirroredStrategy.PARAMS if name != "hierarchical")


def _runs_across_workers(kwargs: dict) -> bool:
    """Whether the arguments or TF_CONFIG ask for a job of several worker processes."""
    if any(kwargs.get(name) is not None for name in _CLUSTER_ARGUMENTS):
        return True
    if not os.environ.get("TF_CONFIG", "").strip():
        return False
    # Validated as the multi-worker strategy does (ClusterConfigError on a bad TF_CONFIG).
    config = cluster_lib.parse_tf_config()
    return config.num_workers > 1 and config.task_type != "evaluator"


def _snapshot(model) -> tuple:
    """Host copies of the model's weights and its optimizer's state (canonical at stages 1 and 2).

    At stage 3 the optimizer is the user's: its variables, read whole from their parts.
    """
    optimizer = model.optimizer
    state = kc.sharded_state(optimizer) if optimizer is not None else None
    if state is None:
        values = [(v, np.array(v.numpy())) for v in (optimizer.variables if optimizer is not None else [])]
    else:
        values = state.canonical_values() if state.layout is not None else None
    return [np.array(v.numpy()) for v in model.weights], state, values


def _restore(model, saved: tuple) -> None:
    weights, state, values = saved
    for v, value in zip(model.weights, weights):
        v.assign(value)
    if state is None:
        for v, value in values:
            v.assign(value)
    elif values is not None:
        state.load_canonical_values(values)


def canonical_optimizer_layout(optimizer, flat_variable, num_variables: int) -> list:
    """How `optimizer`'s state, built on `flat_variable`, maps to a single-device build.

    A template of the user's optimizer class (same config) is built on
    `num_variables` one-element proxies; its `variables` list is the order a
    single-device optimizer would save. Slots are matched by what
    `add_variable_from_reference` recorded (reference and slot name), no
    variable name is parsed. Returns one entry per template variable:
    `("slot", slot_name, variable_index)` for a per-variable slot (Adam's
    momentum of variable 3, ...), or `("plain", variable)` for the optimizer's
    own state (iterations, learning rate, Nadam's `u_product`), matched in
    order; and the slots built on `flat_variable` by name.
    """
    template = kc.recording_copy(optimizer)
    proxies = [keras.Variable(np.zeros((1,), "float32"), name=f"proxy{i}") for i in range(num_variables)]
    template.build(proxies)
    index = {id(p): i for i, p in enumerate(proxies)}
    template_slots = {
        id(v): (name, index[id(ref)])
        for ref, name, v in kc.slot_records(template)
        if id(ref) in index
    }
    slots = {
        name: v for ref, name, v in kc.slot_records(optimizer) if ref is flat_variable
    }
    slot_ids = {id(v) for v in slots.values()}
    plain = [v for v in optimizer.variables if id(v) not in slot_ids]
    entries = []
    plain_iter = iter(plain)
    for tv in template.variables:
        if id(tv) in template_slots and template_slots[id(tv)][0] in slots:
            name, i = template_slots[id(tv)]
            entries.append(("slot", name, i))
        else:
            v = next(plain_iter, None)
            if v is None or tuple(v.shape) != tuple(tv.shape):
                raise NotImplementedError(
                    f"{type(optimizer).__name__} keeps state the sharded optimizer cannot map to "
                    f"its single-device layout (variable {tv.name!r}). Use mirrored, or an "
                    "optimizer whose state is per element (SGD, Adam, AdamW, RMSprop, Adagrad, "
                    "Nadam, Lion, ...)."
                )
            entries.append(("plain", v))
    return entries, slots


class ShardedState:
    """The sharded side of one Keras optimizer: layout, flat slice variable, canonical state.

    Created by `ShardedOptimizerStrategy.on_compile`; its methods are
    called by the optimizer, whose class becomes a same-named subclass of the user's
    (`tfdist._compat.keras.make_sharded_optimizer`).

    Attributes:
        layout: the `FlatLayout` of the model's trainable variables.
        flat: the variable the optimizer is built on: a mirrored variable of
            `S` elements per replica in name, none in memory (released after
            the build). It gives the slots their shape, devices and key; each
            step updates the slice read from the model's weights in its place
            (`_OwnedSlices`).
        variables: the model's trainable variables, in layout order.
    """

    def __init__(
        self, strategy: ShardedOptimizerStrategy, optimizer, under_loss_scale: bool = False,
        unbuilt_variables: Sequence = (),
    ):
        self.strategy = strategy
        self.optimizer = optimizer
        # Wrapped by a LossScaleOptimizer (mixed_float16): the engine's step
        # scales and gates; Keras's own loss-scale apply is not supported.
        self.under_loss_scale = under_loss_scale
        self.layout: FlatLayout | None = None
        self.flat = None
        self.variables: list = []
        self.entries: list = []
        self.slots: dict = {}
        self.decay: list | None = None
        # Variables whose gradient is None in the step being traced (set by `reduce`).
        self._without_gradient: frozenset = frozenset()
        self._checkpoint_children: dict | None = None
        self._gather_functions: dict = {}
        # Gradient elements of the largest group of layers a traced step reduced at once (`reduce_by_unit`).
        self.largest_group = 0
        # Whether the slots were put in copy-on-read mode for chunked updates (`_updates_by_chunk`).
        self._slots_chunked = False
        # Built by `compile` (`on_compile`) before Keras would build it (the first
        # fit, evaluate, train_on_batch or test_on_batch, `optimizer.build`, `apply`):
        # until then `load_weights` loads as into the unbuilt optimizer (`loads_as_unbuilt`).
        self.built_ahead = False
        # The variables the optimizer (or its LossScaleOptimizer) held unbuilt.
        self.unbuilt_variables = list(unbuilt_variables)

    # What the sharded optimizer class calls ----------------------------------
    def build(self, variables) -> None:
        optimizer = self.optimizer
        if optimizer.built:
            # Built again by its owner (the user before a restore, Keras's
            # `compile_from_config` in `load_model`): as on one device, it now loads state.
            self.built_ahead = False
            return
        variables = list(variables)
        bad = [v for v in variables if tf.as_dtype(v.dtype) != tf.float32]
        if bad:
            raise NotImplementedError(
                f"The 'sharded_optimizer' strategy trains float32 variables; {bad[0].path!r} is "
                f"{bad[0].dtype}. Keep variables in float32 (mixed precision policies such as "
                "'mixed_bfloat16' already do)."
            )
        overwritten = [v for v in variables if kc.overwrites_with_gradient(optimizer, v)]
        if overwritten:
            raise NotImplementedError(
                f"The 'sharded_optimizer' strategy does not train {overwritten[0].path!r}: a float8 "
                "layer's scales and amax histories take their gradient as their value "
                "(overwrite_with_gradient), and the flat slices hold optimizer-updated weights only. "
                "Train float8 models under mirrored, central_storage or multi_worker."
            )
        self.variables = variables
        bucket_bytes = self.strategy.options.bucket_bytes
        shard_bytes = self.shard_bucket_bytes
        if bucket_bytes > 0 and shard_bytes > 0:
            bucket_bytes = min(bucket_bytes, shard_bytes)
        self.layout = FlatLayout.for_variables(variables, self.strategy.num_replicas_in_sync, bucket_bytes)
        with self.strategy.scope():
            self.flat = keras.Variable(
                initializer="zeros",
                # The slice as rows, one per chunk (`FlatLayout.slot_shape`): the slots take this shape.
                shape=self.layout.slot_shape,
                dtype="float32",
                trainable=False,
                name="tfdist_parameter_shard",
            )
            kc.build_optimizer(optimizer, [self.flat])
            self.entries, self.slots = canonical_optimizer_layout(optimizer, self.flat, len(variables))
            # State an optimizer starts from the weights (ScheduleFreeAdamW's
            # momentum): its `build` copied the flat variable, read in
            # cross-replica context (one replica's zeros); each replica's copy
            # must start from that replica's slice of the weights.
            initial = kc.slots_initialised_from_weights(optimizer)
            if initial:
                with tf.init_scope():
                    weights = self.layout.flatten_numpy([np.asarray(v.numpy()) for v in variables])
                    for slot in initial:
                        self._scatter_eager(self.slots[slot], weights)
            # The flat variable only names the optimizer's slots (their shape,
            # devices and key): the update reads each slice from the weights
            # (`_OwnedSlices`), so no float32 copy of the slice is kept.
            with tf.init_scope():
                for _, copy in self._components(self.flat):
                    with tf.device(copy.device):
                        tf.raw_ops.AssignVariableOp(
                            resource=copy.handle, value=tf.zeros([0], tf.float32), validate_shape=False
                        )
        if optimizer.weight_decay is not None:
            self.decay = [kc.uses_weight_decay(optimizer, v) for v in variables]
        self._checkpoint_children = None

    def clip_slices(self, grads: list) -> list:
        """The optimizer's clipping on gradient slices, with norms summed across replicas.

        Runs in replica context (the engine's `finish`), on `[slice]`.
        """
        optimizer = self.optimizer
        (g,) = grads
        # A sparse slice (`gather_shard_slices`): its norms are taken over the
        # values, duplicates counted apart, as Keras takes them on one device;
        # Keras's per-variable and by-value clipping keep the gradient sparse
        # (clipping each row apart), its global clipping densifies it.
        sparse = isinstance(g, tf.IndexedSlices)
        values = g.values if sparse else g
        if optimizer.clipnorm and optimizer.clipnorm > 0:
            ctx = tf.distribute.get_replica_context()
            replica = tf.get_static_value(ctx.replica_id_in_sync_group)
            ids = self.layout.segment_ids(replica)
            if sparse:
                ids = tf.gather(ids, g.indices)
            squares = tf.math.unsorted_segment_sum(tf.square(values), ids, len(self.variables) + 1)
            squares = ctx.all_reduce(tf.distribute.ReduceOp.SUM, squares)
            l2sum = tf.gather(squares, ids)
            # Keras's `_clip_by_norm`, per variable.
            pred = l2sum > 0
            l2norm = tf.where(pred, tf.sqrt(tf.where(pred, l2sum, tf.ones_like(l2sum))), l2sum)
            clip = tf.cast(optimizer.clipnorm, values.dtype)
            clipped = values * clip / tf.maximum(l2norm, clip)
            return [tf.IndexedSlices(clipped, g.indices, g.dense_shape) if sparse else clipped]
        if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
            ctx = tf.distribute.get_replica_context()
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.reduce_sum(tf.square(values)))
            norm = tf.sqrt(total)
            clip = tf.cast(optimizer.global_clipnorm, values.dtype)
            # Keras's `clip_by_global_norm`, NaN-propagating.
            scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
            return [tf.convert_to_tensor(g) * scale if sparse else g * scale]
        if optimizer.clipvalue and optimizer.clipvalue > 0:
            v = tf.cast(optimizer.clipvalue, values.dtype)
            clipped = tf.clip_by_value(values, -v, v)
            return [tf.IndexedSlices(clipped, g.indices, g.dense_shape) if sparse else clipped]
        return [g]

    def finalize_variable_values(self, var_list) -> None:
        """At the end of `fit` with `use_ema`: the model takes the averaged weights."""
        if not self.optimizer.use_ema or self.layout is None:
            return
        average = kc.ema_average(self.optimizer)
        self._assign_model_variables(self._gather_eager(average))

    def save_own_variables(self, store) -> None:
        """Keras `.keras` / `.weights.h5`: the single-device optimizer's variables, in its order."""
        for i, value in enumerate(self.canonical_values()):
            store[str(i)] = value

    def load_own_variables(self, store) -> None:
        """Loads a single-device-layout optimizer state, resharding it onto this replica count."""
        if self.loads_as_unbuilt(store, self.optimizer.name):
            return
        if self.layout is None:
            raise ValueError(
                f"The optimizer {self.optimizer.name!r} of a 'sharded_optimizer' model is not "
                "built yet, so it cannot load state. Build the model and call "
                "model.optimizer.build(model.trainable_variables) first (fit does)."
            )
        if not self.skips_other_state(len(store.keys())):
            self.load_canonical_values([store[str(i)] for i in range(len(store.keys()))])

    def loads_as_unbuilt(self, store, name: str) -> bool:
        """Keras's `load_own_variables` of the unbuilt optimizer, when this one was built ahead of Keras; whether it ran.

        On one device the optimizer is unbuilt from `compile` to the first
        `fit` (or `evaluate`, `train_on_batch`, `optimizer.build`), and Keras's
        `load_weights` there loads a file's optimizer variables only where it
        holds as many as the unbuilt optimizer (iterations, learning rate);
        otherwise it keeps the optimizer's state with its warning. Fine-tuning
        (compile with a new optimizer, load pretrained weights, fit) so keeps
        the new learning rate, a step count of 0 and zero moments; before,
        stages 1 and 2 took the pretrained run's. `name`: the optimizer Keras
        loads (a LossScaleOptimizer's, under mixed_float16).
        """
        if not self.built_ahead:
            return False
        unbuilt = self.unbuilt_variables
        if len(store.keys()) != len(unbuilt):
            warnings.warn(
                f"Skipping variable loading for optimizer '{name}', because it has {len(unbuilt)} "
                f"variables whereas the saved optimizer has {len(store.keys())} variables. ",
                stacklevel=4,
            )
            return True
        for i, variable in enumerate(unbuilt):
            variable.assign(store[str(i)])
        return True

    def skips_other_state(self, saved: int, own: int = 0) -> bool:
        """True, with Keras's warning, when a file holds another number of optimizer variables than this one.

        As Keras's `Optimizer.load_own_variables`: `load_weights` of a file
        saved from an uncompiled model, or with another optimizer, loads the
        layers' weights and keeps this optimizer's state. `own`: variables a
        wrapper (`LossScaleOptimizer`) holds before the canonical ones.
        """
        expected = own + len(self.canonical_shapes())
        if saved == expected:
            return False
        warnings.warn(
            f"Skipping variable loading for optimizer '{self.optimizer.name}', because it has {expected} "
            f"variables whereas the saved optimizer has {saved} variables. ",
            stacklevel=3,
        )
        return True

    def trackable_children(self, save_type="checkpoint", **kwargs) -> dict:
        """`tf.train.Checkpoint` and `tf.saved_model.save`: the children a single-device Keras optimizer has."""
        children = kc.class_trackable_children(self.optimizer, save_type, **kwargs)
        if self.layout is None:
            return children
        if save_type != "checkpoint":
            # A SavedModel recreates each variable at load and traces each
            # object's restore function at save, which the checkpoint's
            # canonical values (read and written eagerly) cannot be: it gets
            # plain variables holding the canonical state, taken now. As it
            # was, it held the flat variable (declared with the slots' row
            # shape, holding [0]) and one replica's slices, and
            # tf.saved_model.load failed ("Received incompatible tensor with
            # shape (0,) ... tfdist_parameter_shard:0").
            children.update(self._canonical_children(self._snapshot_values()))
            return children
        if self._checkpoint_children is None:
            self._checkpoint_children = self._canonical_children(self._checkpoint_values())
        children.update(self._checkpoint_children)
        return children

    # Canonical state -------------------------------------------------------
    def canonical_shapes(self) -> list[tuple[int, ...]]:
        return [
            self.layout.shapes[e[2]] if e[0] == "slot" else tuple(e[1].shape) for e in self.entries
        ]

    def _components(self, variable) -> list:
        """This worker's copies of a flat variable: `[(job-wide replica id, copy), ...]`."""
        local = self.strategy.experimental_local_results(kc.tf_variable(variable))
        return [(tfc.replica_id_in_sync_group(self.strategy, i), c) for i, c in enumerate(local)]

    @property
    def shard_bucket_bytes(self) -> int:
        """The strategy's `shard_bucket_bytes` on one host; 0 (use `bucket_bytes`) across workers."""
        if self.across_workers:
            return 0
        return int(self.strategy._tfdist_params.get("shard_bucket_bytes", LAYOUT_BUCKET_BYTES))

    @property
    def across_workers(self) -> bool:
        """Whether other worker processes hold some of the slices."""
        return len(self.strategy.extended.worker_devices) != self.strategy.num_replicas_in_sync

    def _gather_tensor(self, variable) -> tf.Tensor:
        """The whole flat `variable` (padded), from every replica's slice (on this worker).

        Across workers this is an all-gather, a collective: every worker must
        call it, in the same order (saving is done by every worker).
        """
        if not self.across_workers:
            comps = [c for _, c in self._components(variable)]
            with tf.device("/cpu:0"):
                return self.layout.from_slices(tf.concat([tf.reshape(c, [-1]) for c in comps], axis=0))
        v = kc.tf_variable(variable)
        function = self._gather_functions.get(id(v))
        if function is None:
            strategy = self.strategy

            def gather():
                return collectives.all_gather_shards(tf.reshape(v, [-1]))

            # Traced once per variable: eager `strategy.run` would retrace TensorFlow's gather every call.
            function = tf.function(lambda: strategy.experimental_local_results(strategy.run(gather))[0])
            self._gather_functions[id(v)] = function
        return self.layout.from_slices(function())

    def _gather_eager(self, variable) -> np.ndarray:
        if not self.across_workers:
            slices = np.concatenate([np.asarray(c.numpy()).reshape(-1) for _, c in self._components(variable)])
            return self.layout.from_slices(slices)
        return np.asarray(self._gather_tensor(variable).numpy())

    def canonical_values(self) -> list[np.ndarray]:
        """The optimizer state as a single-device optimizer holds it (numpy, in its order)."""
        gathered = {}
        values = []
        for entry in self.entries:
            if entry[0] == "plain":
                values.append(np.asarray(entry[1].numpy()))
                continue
            _, slot, index = entry
            if slot not in gathered:
                gathered[slot] = self.layout.unflatten_numpy(self._gather_eager(self.slots[slot]))
            values.append(gathered[slot][index])
        return values

    def load_canonical_values(self, values: Sequence) -> None:
        """Validates every value against this model, then writes them; nothing changes on error."""
        expected = self.canonical_shapes()
        if len(values) != len(expected):
            raise ValueError(
                f"The checkpoint holds {len(values)} optimizer variables; this model's "
                f"{type(self.optimizer).__name__} has {len(expected)} (for "
                f"{len(self.variables)} trainable variables). The checkpoint belongs to a "
                "different model or optimizer. Nothing was loaded."
            )
        for i, (value, shape) in enumerate(zip(values, expected)):
            if tuple(np.shape(value)) != tuple(shape):
                raise ValueError(
                    f"Optimizer variable {i} in the checkpoint has shape {tuple(np.shape(value))}; "
                    f"this model needs {tuple(shape)}. The checkpoint belongs to a different model "
                    "or optimizer. Nothing was loaded."
                )
        per_slot: dict = {}
        for entry, value in zip(self.entries, values):
            if entry[0] == "plain":
                entry[1].assign(value)
            else:
                per_slot.setdefault(entry[1], [None] * len(self.variables))[entry[2]] = value
        for slot, arrays in per_slot.items():
            self._scatter_eager(self.slots[slot], self.layout.flatten_numpy(arrays))

    def _scatter_eager(self, variable, flat: np.ndarray) -> None:
        slices = self.layout.to_slices_numpy(flat)
        for r, component in self._components(variable):
            with tf.device(component.device):
                component.assign(slices[r].reshape(component.shape))

    def _checkpoint_values(self) -> list:
        """Per canonical slot entry (in `entries` order), a trackable that checkpoints as its variable."""

        def value_of(slot, index):
            def read():
                flat = self._gather_tensor(self.slots[slot])
                with tf.device("/cpu:0"):
                    offset, size = self.layout.offsets[index], self.layout.sizes[index]
                    return tf.reshape(flat[offset:offset + size], self.layout.shapes[index])

            def write(value):
                # One model variable's piece of a slot: rewrite the parts of
                # this worker's slices that cover it (eagerly; restoring runs
                # eagerly; no collective, so workers need not restore in step).
                piece = np.asarray(value, np.float32).reshape(-1)
                for r, component in self._components(self.slots[slot]):
                    mine = [p for p in self.layout.pieces(r) if p.variable == index]
                    if mine:
                        current = np.array(component.numpy()).reshape(-1)
                        for p in mine:
                            current[p.offset:p.offset + p.stop - p.start] = piece[p.start:p.stop]
                        with tf.device(component.device):
                            component.assign(current.reshape(component.shape))

            return tfc.canonical_checkpoint_value(read, write, self.layout.shapes[index])

        return [value_of(entry[1], entry[2]) for entry in self.entries if entry[0] == "slot"]

    def _snapshot_values(self) -> list:
        """Per canonical slot entry, a new variable on the host holding its value now (for a SavedModel)."""
        values = self.canonical_values()
        snapshot = []
        with tf.init_scope(), tf.device("/cpu:0"):
            for entry, value in zip(self.entries, values):
                if entry[0] == "slot":
                    snapshot.append(tf.Variable(value, trainable=False, name=f"{entry[1]}_{entry[2]}"))
        return snapshot

    def _canonical_children(self, slot_values: list) -> dict:
        """The single-device optimizer's children, its slot entries given by `slot_values` (in order)."""
        canonical = []
        by_slot: dict = {}
        values = iter(slot_values)
        for entry in self.entries:
            if entry[0] == "plain":
                canonical.append(entry[1])
            else:
                value = next(values)
                canonical.append(value)
                by_slot.setdefault(entry[1], []).append(value)
        children = {
            "_variables": tfc.trackable_list(canonical),
            "_trainable_variables": tfc.trackable_list(self.variables),
        }
        # Keras optimizers also keep each slot's list as an attribute, checkpointed
        # by its name, which each class chooses (Adam's `_momentums`, SGD's
        # `momentums`, Adamax's `_m` and `_u`, Ftrl's `_linears`, gradient
        # accumulation's `_accumulated_gradients`, ...): any list of one slot's
        # flat variables gets that slot's canonical values, one per model
        # variable. Left as it was, it checkpointed one replica's flat slice
        # under a key of its own, restored into every replica (SGD's momentum:
        # 0.50 relative from uninterrupted training after one epoch).
        slot_of = {id(v): name for name, v in self.slots.items()}
        for attribute, child in kc.class_trackable_children(self.optimizer, "checkpoint").items():
            if attribute in children or not isinstance(child, (list, tuple)):
                continue
            names = {slot_of.get(id(item)) for item in child}
            if len(names) == 1 and (slot := next(iter(names))) in by_slot:
                children[attribute] = tfc.trackable_list(by_slot[slot])
        return children

    # The step ----------------------------------------------------------------
    def reduce(self, bucket_bytes: int, values: list, riders: list = ()) -> list:
        """Replica context: `[weighted grads..., weight]` -> `[this replica's summed slice, total weight]`.

        `riders` (the step's metric state, `TrainStep.metric_riders`) are summed
        over the replicas in the same all-reduce as the gradients (stage 1) or
        the total weight (stage 2) and returned after the two.
        """
        ctx = tf.distribute.get_replica_context()
        replica = tf.get_static_value(ctx.replica_id_in_sync_group)
        grads = values[:-1]
        self._without_gradient = frozenset(i for i, g in enumerate(grads) if g is None)
        riders = list(riders)
        if self.strategy.stage == 1:
            summed = collectives.all_reduce_sum(
                values + riders, bucket_bytes, self.strategy.options.allreduce_dtype
            )
            riders, summed = summed[len(values):], summed[: len(values)]
            grads = summed[:-1]
            shard = gather_shard(self.layout, dense_only(grads), replica)
            total = summed[-1]
        else:
            shard = collectives.reduce_scatter_sum(dense_only(grads), self.layout)
            # One collective for the weight and the riders (TensorFlow packs one call's values).
            total, *riders = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [values[-1]] + riders)
            if has_sparse(grads):
                # Sparse rows are all-gathered, as under mirrored, never densified.
                grads = collectives.all_reduce_sum(
                    [g if isinstance(g, tf.IndexedSlices) else None for g in grads], bucket_bytes
                )
        if has_sparse(grads):
            shard = gather_shard_slices(self.layout, shard, grads, replica)
        return [shard, total] + riders

    def reduce_by_unit(self, step, batch, riders: list = ()) -> list:
        """Replica context: `[this replica's summed slice, total weight] + riders`, reduced layer by layer.

        As each group of layers finishes its backward pass, its weights'
        gradients are summed across the replicas (`bucket_bytes` buckets; a
        variable larger than one travels alone, with no packing copy; on CPU
        an all-reduce of the group is how a reduce-scatter runs, as in
        `tfdist.collectives.reduce_scatter_sum`) and this replica keeps its
        pieces of them (copied out, so the sum is freed); the layer below
        starts its backward pass once that is done. The slice is assembled
        from the pieces at the end. Stage 1 and stage 2 give the same slice.
        """
        ctx = tf.distribute.get_replica_context()
        replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
        mine: dict = {}
        for p in self.layout.pieces(replica):
            mine.setdefault(p.variable, []).append(p)
        kept: dict = {}

        def keep(i: int, a: int, n: int, total) -> list:
            """This replica's pieces of variable `i`'s summed gradient elements `[a, a + n)` (`total`), copied out."""
            out = []
            for p in mine.get(i, []):
                lo, hi = max(p.start, a), min(p.stop, a + n)
                if lo >= hi:
                    continue
                own = collectives.copy_out(total[lo - a:hi - a])
                parts = kept.setdefault((i, p.start), {})
                parts[lo] = own if lo not in parts else parts[lo] + own
                out.append(parts[lo])
            return out

        reduced: set = set()

        def reducer(indices, grads):
            dense = [(i, g) for i, g in zip(indices, grads) if g is not None]
            reduced.update(i for i, _ in dense)
            if not dense:
                return []
            sizes = self.layout.sizes  # static, where a gradient's shape may not be
            # With shard_bucket_bytes, a gradient larger than it is summed in
            # pieces of that size; without, every gradient as it is (packed
            # into bucket_bytes, a larger one alone).
            piece_bytes = self.shard_bucket_bytes
            piece = piece_bytes // 4 if piece_bytes > 0 else max(sizes)
            pack_bytes = min(step.options.bucket_bytes, piece_bytes) if piece_bytes > 0 else step.options.bucket_bytes
            small = [(i, g) for i, g in dense if sizes[i] <= piece]
            done = []
            if small:
                summed = collectives.all_reduce_sum([g for _, g in small], pack_bytes)
                for (i, _), total in zip(small, summed):
                    done += keep(i, 0, sizes[i], tf.reshape(total, [-1]))
                done = done or [summed[0]]
            # A larger gradient is summed piece after piece, each once the
            # previous one's pieces are kept: not packed into a copy beside
            # itself, and the collective's buffers (a ring all-reduce holds
            # about (N - 1) / N of its input in temporary chunks) are one
            # piece's size, not the variable's.
            previous = list(done)
            for i, g in dense:
                if sizes[i] <= piece:
                    continue
                flat = tf.reshape(g, [sizes[i]])
                for a in range(0, sizes[i], piece):
                    with tf.control_dependencies(previous):
                        part = tf.identity(flat[a:a + piece])
                    (total,) = collectives.all_reduce_sum([part], piece_bytes)
                    previous = keep(i, a, min(piece, sizes[i] - a), total) or [total]
                    done += previous
            return done

        self.largest_group = max(self.largest_group, step.layer_reductions.largest_group)
        values = step.compute_gradients(batch, reducer=reducer)
        grads = values[:-1]
        self._without_gradient = frozenset(
            i for i, g in enumerate(grads) if g is None and i not in reduced
        )
        total, *riders = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [values[-1]] + list(riders))
        shard = self._slice_from_pieces(kept, replica)
        if has_sparse(grads):
            # Rows gathered from a weight outside an Embedding came back from the tape: all-gathered, kept sparse.
            sparse = collectives.all_reduce_sum(
                [g if isinstance(g, tf.IndexedSlices) else None for g in grads], step.options.bucket_bytes
            )
            shard = gather_shard_slices(self.layout, shard, sparse, replica)
        return [shard, total] + riders

    def _slice_from_pieces(self, kept: dict, replica: int) -> tf.Tensor:
        """Replica `replica`'s slice from its pieces `{(variable, start): {element: values}}`; zeros elsewhere."""
        parts = []
        for lo, hi in self.layout.owned_ranges(replica):
            position = 0
            for p in self.layout.range_pieces(lo, hi):
                value = kept.get((p.variable, p.start))
                if value is None:
                    parts.append(tf.zeros([p.stop - p.start], tf.float32))
                else:
                    parts += [value[start] for start in sorted(value)]
                position = p.offset + p.stop - p.start
            if position < hi - lo:
                parts.append(tf.zeros([hi - lo - position], tf.float32))
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

    def gradient_buffer_estimate(self) -> int:
        """Bytes of reduced gradient one replica's step holds at most (not counting sparse rows).

        Once a step has been traced reducing layer by layer (`reduce_by_unit`),
        at either stage: the replica's slice, plus the largest group's reduced
        gradients. Otherwise stage 1: every reduced gradient, whole (each has
        its variable's size); stage 2: the replica's slice, plus the two
        buckets (`N` chunks each) that can be alive at once
        (`tfdist.collectives.reduce_scatter_sum`).
        """
        layout = self.layout
        if self.largest_group:
            return (layout.shard_size + self.largest_group) * 4
        if self.strategy.stage == 1:
            return layout.total * 4
        bucket = layout.num_shards * layout.chunk_size
        return (layout.shard_size + min(2, layout.num_buckets) * bucket) * 4

    def apply_reduced(self, grads: list) -> None:
        """Cross-replica context (the engine's step): update every slice, then all-gather into the model."""
        updated = self._update_slices(grads)
        after: dict = {}
        for k in range(self.layout.num_buckets):
            gathered = self.strategy.run(lambda k=k: self._gather_bucket(k, updated, after))
            self._write_bucket(k, gathered, after)
        self._finish_step()

    def _update_slices(self, grads: list):
        """Cross-replica context: each replica's optimizer update of its own slice.

        Returns the updated slices for the all-gather, `{job-wide replica id:
        [chunk of bucket 0, chunk of bucket 1, ...]}` for this worker's
        replicas. Each replica's slice is read from the model's variables —
        they are the truth: `set_weights`, `load_weights` and restored
        checkpoints write them — and updated as a tensor (`_OwnedSlices`): no
        copy of the slice outlives the step. An element-wise optimizer on a
        dense slice updates it chunk by chunk (`_OwnedSlices.chunked`).
        """
        (g,) = grads
        placement = _OwnedSlices(self, after=g, chunked=self._updates_by_chunk(g))

        # Keras skips a variable whose gradient is None (a branch under
        # stop_gradient): no update, so no weight decay either.
        decay = None if self.decay is None else [
            d and i not in self._without_gradient for i, d in enumerate(self.decay)
        ]

        def mask():
            # Evaluated where each replica's update runs: decay only the
            # elements of variables that take weight decay.
            replica = tfc.replica_id_in_sync_group(self.strategy, tfc.update_replica_id())
            full = self.layout.mask(replica, decay)
            if full is None or placement.chunk is None:
                return full
            return full[placement.chunk[0]:placement.chunk[1]]

        update.apply_update(
            self.optimizer, [g], [self.flat], placement,
            decay_mask=mask if self.decay is not None else None, constrain=False, count=False,
        )
        c, buckets = self.layout.chunk_size, self.layout.num_buckets
        updated = {}
        for (replica, k), stand_in in placement.stand_ins.items():
            if k is None:
                # Cut where the slice is: without a device, on the first replica's (a round trip of every slice).
                with tf.device(stand_in.value.device):
                    updated[replica] = [stand_in.value[b * c:(b + 1) * c] for b in range(buckets)]
            else:
                updated.setdefault(replica, [None] * buckets)[k] = stand_in.value
        return updated

    def _updates_by_chunk(self, g) -> bool:
        """Whether the update runs chunk by chunk (one chunk per bucket): its temporaries one chunk's size.

        Needs several buckets of at most `shard_bucket_bytes` (with
        `shard_bucket_bytes=0`, the faster whole-slice update), a dense
        gradient slice, and an optimizer whose update is element-wise and
        touches nothing but its slots (no EMA average, which is updated from
        the whole slice).
        """
        optimizer = self.optimizer
        chunked = (
            self.layout.num_buckets > 1
            and self.shard_bucket_bytes > 0
            and not any(isinstance(v, tf.IndexedSlices) for v in self.strategy.experimental_local_results(g))
            and _updates_per_element(optimizer)
            and not optimizer.use_ema
        )
        if chunked and not self._slots_chunked:
            # Once, outside the step (`init_scope`): the slots go to copy-on-read mode (`kc.SlotChunk.prepare`).
            with tf.init_scope():
                for v in optimizer.variables:
                    if v is not self.flat and tuple(v.shape) == tuple(self.flat.shape):
                        for _, copy in self._components(v):
                            kc.SlotChunk.prepare(copy)
            self._slots_chunked = True
        return chunked

    @tf.autograph.experimental.do_not_convert
    def _gather_bucket(self, k: int, updated: dict, after: dict) -> tf.Tensor:
        """Replica context: bucket `k` of the updated parameters, all-gathered from every replica's chunk.

        Sent once this replica has written the previous bucket into the model
        (`after`), so that about one gathered bucket is alive at a time.
        """
        ctx = tf.distribute.get_replica_context()
        replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
        with tf.control_dependencies(after.get(replica, [])):
            chunk = tf.identity(updated[replica][k])
        return collectives.all_gather_shards(chunk)

    @tf.autograph.experimental.do_not_convert
    def _write_bucket(self, k: int, gathered, after: dict) -> None:
        """Cross-replica context: writes bucket `k` into the variables it covers, straight from it.

        A bucket is a contiguous range of the flat parameters: a variable
        inside it is assigned a copy of its slice of the gathered bucket (no
        whole-model buffer, unpadding copy or split). A variable that spans
        buckets gets each bucket's part written into its own buffer as it
        arrives (`write_in_place`: whole rows by `ResourceScatterUpdate`, a
        block copy each), and leaves TensorFlow's copy-on-read mode
        (`DisableCopyOnRead`) at its last part, so the forward pass reads it
        without a copy. No buffer of the variable's size is made. Writing each
        part into a copy of the variable (`TensorStridedSliceUpdate`, an
        element-wise strided copy) cost stage 2 at N = 2 a third of its step
        on the benchmark's model; keeping the parts and assigning their
        concatenation, a block copy, is faster still but holds two more
        variable-sized buffers while the largest variable is written, on
        every replica at once. `after` gets each replica's writes and
        gathered bucket, for the next bucket to wait on.
        """
        layout, strategy = self.layout, self.strategy
        done: dict = {}
        for p in layout.range_pieces(*layout.bucket_range(k)):
            size = layout.sizes[p.variable]

            def write(x, value, p=p, size=size, shape=layout.shapes[p.variable]):
                replica = int(tfc.replica_id_in_sync_group(strategy, tfc.update_replica_id()))
                piece = value[p.offset:p.offset + p.stop - p.start]
                if p.start == 0 and p.stop == size:
                    # A slice at an aligned offset shares the gathered bucket's buffer, and a
                    # variable assigned from it would keep the whole bucket alive between steps
                    # (measured: 2 model-sized buffers over 4 replicas): copy it.
                    whole = collectives.copy_out(piece)
                else:
                    # In place, straight from the bucket; the last part ends copy-on-read mode.
                    ops = write_in_place(x, piece, p.start, p.stop, last=p.stop == size)
                    done.setdefault(replica, []).extend(ops)
                    return ops[-1]
                op = x.assign(tf.reshape(whole, shape), read_value=False)
                done.setdefault(replica, []).append(op)
                return op

            strategy.extended.update(kc.tf_variable(self.variables[p.variable]), write, args=(gathered,), group=False)
        after.clear()
        for i, value in enumerate(strategy.experimental_local_results(gathered)):
            replica = int(tfc.replica_id_in_sync_group(strategy, i))
            after[replica] = done.get(replica, []) + [value]

    @tf.autograph.experimental.do_not_convert
    def _finish_step(self) -> None:
        """Cross-replica context: constraints on the whole variables, as in Keras; the step is done."""
        for v in self.variables:
            if v.constraint is not None:
                self.strategy.extended.update(
                    kc.tf_variable(v),
                    lambda x, c=v.constraint: x.assign(c(tf.convert_to_tensor(x)), read_value=False),
                    group=False,
                )
        kc.advance_iterations(self.optimizer)

    # Not converted by autograph (plain Python around TensorFlow calls): converting
    # it, and the methods it calls inside merge_call, failed in long test runs with
    # "tf___gathered_values() takes from 0 to 1 positional arguments but 3 were given".
    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None) -> None:
        """`optimizer.apply` from a custom `train_step` or training loop (replica context).

        Each replica passes its own gradients (Keras's `compute_loss` already
        divided the loss by the replica count, so they sum to the global
        gradient); they are reduced to slices as in the engine's step (stage 1
        all-reduce, stage 2 reduce-scatter), clipped on the summed slice, and
        each replica updates its slice; the slices are all-gathered into the
        model. Keras's own optimizer would clip each replica's gradient before
        summing; here clipping sees the summed gradient, as on one device.
        """
        if self.under_loss_scale:
            raise NotImplementedError(
                f"A LossScaleOptimizer (mixed_float16) over the 'sharded_optimizer' strategy's optimizer "
                f"{self.optimizer.name!r} cannot apply gradients from a custom training loop: Keras's "
                "loss-scale update (per-replica finiteness check, then the inner optimizer) does not "
                "match the sharded update, and its steps would differ from one device's. Train with "
                "model.fit (tfdist's step scales the loss and skips non-finite steps on every replica), "
                "or use precision='mixed_bfloat16', which needs no loss scaling."
            )
        ctx = tf.distribute.get_replica_context()
        if ctx is None or tf.distribute.in_cross_replica_context():
            raise RuntimeError(
                f"The 'sharded_optimizer' strategy's optimizer {self.optimizer.name!r} applies "
                "gradients per replica: call optimizer.apply(...) inside strategy.run(...) (as a "
                "train_step or a custom training loop does), not in cross-replica context."
            )
        grads = list(grads)
        optimizer = self.optimizer
        self.built_ahead = False  # on one device `apply` builds it
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not optimizer.built:
                optimizer.build(trainable_variables)
        elif not optimizer.built:
            raise ValueError(
                "When passing `grads` without `variables`, the optimizer must already be built "
                "on a list of variables. Call `optimizer.build(trainable_variables)` first."
            )
        else:
            trainable_variables = self.variables
        ordered, missing = kc.reorder_like(grads, trainable_variables, self.variables)
        if missing:
            raise ValueError(
                f"optimizer.apply() was given {len(trainable_variables)} variables without "
                f"{missing[0].path!r}, which the 'sharded_optimizer' optimizer was built on: pass the "
                "gradients of all of `model.trainable_variables` (a missing gradient may be None)."
            )
        if len(trainable_variables) != len(self.variables):
            raise ValueError(
                f"optimizer.apply() was given {len(trainable_variables)} variables; the "
                f"'sharded_optimizer' optimizer was built on {len(self.variables)}. Pass the "
                "gradients of exactly `model.trainable_variables`."
            )
        scale = optimizer.loss_scale_factor
        if scale is not None:
            ordered = [g if g is None else g / scale for g in ordered]
        ordered = [tf.convert_to_tensor(g) if isinstance(g, keras.Variable) else g for g in ordered]
        shard, _ = self.reduce(self.strategy.options.bucket_bytes, ordered + [tf.constant(1.0)])
        (shard,) = self.clip_slices([shard])
        updated = ctx.merge_call(lambda _, g: self._update_slices([g]), args=(shard,))
        after: dict = {}
        for k in range(self.layout.num_buckets):
            gathered = self._gather_bucket(k, updated, after)
            ctx.merge_call(lambda _, g, k=k: self._write_bucket(k, g, after), args=(gathered,))
        ctx.merge_call(lambda _: self._finish_step())

    def _assign_model_variables(self, flat: np.ndarray) -> None:
        for v, value in zip(self.variables, self.layout.unflatten_numpy(flat)):
            v.assign(value)


class _OwnedSlices(update.Placement):
    """Where the sharded optimizer's update runs: each replica's owned slice, as a tensor.

    `apply_update` updates the optimizer's flat variable (`ShardedState.flat`,
    which holds no elements: it only names the slots); here each replica's
    update reads its slice from the model's variables into a
    `VariableStandIn`, which the optimizer's `update_step`, weight decay and
    EMA overwrite update in its place. Other variables (the EMA averages) are
    updated on every copy, with the stand-in's value wherever the flat
    variable is an argument.

    Args:
        state: the `ShardedState`.
    """

    def __init__(self, state: ShardedState, after=None, chunked: bool = False):
        self.state = state
        self.chunked = chunked
        # `[lo, hi)` of the slice while one chunk's update is being built (chunked).
        self.chunk: tuple[int, int] | None = None
        # {(job-wide replica id, chunk or None): VariableStandIn}
        self.stand_ins: dict = {}
        # Each replica's slice is read once its gradient slice exists (`after`,
        # per replica): left free, TensorFlow reads it while the gradients are
        # still being reduced, a whole model's worth of slices alive at the
        # step's peak for nothing.
        self.after = state.strategy.experimental_local_results(after) if after is not None else None
        flat = kc.tf_variable(state.flat)
        # `extended.update` hands a mirrored argument over whole, a copy of it as itself.
        self.flat_copies = {id(flat)} | {id(c) for c in state.strategy.experimental_local_results(flat)}

    def stand_in(self, k: int | None = None):
        """Inside `strategy.extended.update`: this replica's slice, or its chunk `k` (read from the model at first use)."""
        state = self.state
        replica = int(tfc.replica_id_in_sync_group(state.strategy, tfc.update_replica_id()))
        if (replica, k) not in self.stand_ins:
            after = [self.after[tfc.update_replica_id()]] if self.after is not None else []
            ranges = state.layout.owned_ranges(replica)
            needed = {p.variable for lo, hi in (ranges if k is None else [ranges[k]])
                      for p in state.layout.range_pieces(lo, hi)}
            with tf.control_dependencies(after):
                weights = [tf.convert_to_tensor(kc.tf_variable(v)) if i in needed else None
                           for i, v in enumerate(state.variables)]
            if k is None:
                value = gather_shard(state.layout, weights, replica)
            else:
                value = gather_range(state.layout, weights, *ranges[k])
            self.stand_ins[(replica, k)] = kc.VariableStandIn(state.optimizer, state.flat, value)
        return self.stand_ins[(replica, k)]

    def run(self, variable, fn, *args) -> None:
        state = self.state

        slot_shape = tuple(state.layout.slot_shape)

        def flat_view(v):
            # A variable of the slots' row shape (an EMA average) as the flat slice.
            return kc.SlotRows(v) if isinstance(v, tf.Variable) and tuple(v.shape) == slot_shape else v

        def on_replica(copy, *values):
            local = tfc.update_replica_id()

            def local_copy(slot):
                return state.strategy.experimental_local_results(kc.tf_variable(slot))[local]

            if not (self.chunked and variable is state.flat):
                # The whole slice: the slots (rows of chunks) read and written as flat vectors.
                values = [self.stand_in().value if id(v) in self.flat_copies else flat_view(v) for v in values]
                with kc.slots_as_flat(state.optimizer, state.flat, local_copy):
                    return fn(self.stand_in() if variable is state.flat else flat_view(copy), *values)
            # Chunk by chunk: each chunk's slots are read and written in place,
            # one row each (`kc.slots_as_chunks`), and each chunk's work waits for
            # the previous chunk's writes, so one chunk's temporaries are alive at a time.
            c = state.layout.chunk_size
            previous: list = []
            for k in range(state.layout.num_buckets):
                self.chunk = (k * c, (k + 1) * c)
                with tf.control_dependencies(previous):
                    stand_in = self.stand_in(k)
                    chunk_values = [
                        stand_in.value if id(v) in self.flat_copies
                        else v[k * c:(k + 1) * c] if _is_slice_sized(v, state.layout.shard_size)
                        else v
                        for v in values
                    ]
                    with kc.slots_as_chunks(state.optimizer, state.flat, k, local_copy) as slots:
                        fn(stand_in, *chunk_values)
                previous = [op for slot in slots for op in slot.writes] + [stand_in.value]
            self.chunk = None

        state.strategy.extended.update(kc.tf_variable(variable), on_replica, args=args, group=False)


def write_in_place(variable, value, start: int, stop: int, last: bool = True) -> list:
    """Writes `value` (1-D) into the flattened elements `[start, stop)` of `variable`, in place; returns the writes.

    For a variable of rank 2 or more, the whole rows (along its first axis)
    inside the range are written with one `ResourceScatterUpdate` (a block
    copy per row), and a row the range covers in part is read
    (`ResourceGather`), updated and written back. A 1-D variable is written
    with `ResourceStridedSliceAssign`. No buffer of the variable's size is
    made (unless something still holds its current value, which TensorFlow
    then copies once). These writes put the variable in TensorFlow's
    copy-on-read mode (`EnsureSparseVariableAccess`), in which every read
    copies it; with `last` (the variable's last part is in) the returned
    writes end with `DisableCopyOnRead`, so its reads share its buffer again.
    Writes to the same variable run in program order (automatic control
    dependencies).
    """
    ops = _writes_in_place(variable, value, start, stop)
    if last:
        ops.append(tf.raw_ops.DisableCopyOnRead(resource=variable.handle))
    return ops


def _writes_in_place(variable, value, start: int, stop: int) -> list:
    shape = variable.shape.as_list()
    handle, dtype = variable.handle, variable.dtype
    if len(shape) < 2:
        return [tf.raw_ops.ResourceStridedSliceAssign(
            ref=handle, begin=[start], end=[stop], strides=[1], value=value,
        )]
    row = math.prod(shape[1:])

    def part_of_row(r: int, lo: int, hi: int, values):
        # int64 indices: on a GPU an int32 tensor lives in host memory and is copied to the device for each op.
        current = tf.reshape(tf.raw_ops.ResourceGather(resource=handle, indices=tf.constant(r, tf.int64), dtype=dtype), [row])
        updated = tf.raw_ops.TensorStridedSliceUpdate(input=current, begin=[lo], end=[hi], strides=[1], value=values)
        return tf.raw_ops.ResourceScatterUpdate(
            resource=handle, indices=tf.constant(r, tf.int64), updates=tf.reshape(updated, shape[1:]),
        )

    r = start // row
    if stop - start < row and stop <= (r + 1) * row:  # inside one row, not the whole of it
        return [part_of_row(r, start - r * row, stop - r * row, value)]
    first, last = -(-start // row), stop // row  # whole rows [first, last)
    ops = []
    head = first * row - start
    if head:
        ops.append(part_of_row(first - 1, row - head, row, value[:head]))
    if first < last:
        rows = value[head:head + (last - first) * row]
        ops.append(tf.raw_ops.ResourceScatterUpdate(
            resource=handle, indices=tf.range(first, last, dtype=tf.int64),
            updates=tf.reshape(rows, [last - first] + shape[1:]),
        ))
    if last * row < stop:
        ops.append(part_of_row(last, 0, stop - last * row, value[head + (last - first) * row:]))
    return ops


def _is_slice_sized(value, size: int) -> bool:
    """Whether an update argument is a tensor of the slice's `[S]` shape (cut into chunks), not a scalar."""
    return tf.is_tensor(value) and value.shape.rank == 1 and value.shape[0] == size


def _check_same_trainable_variables(model, sharded) -> None:
    """Raises if `model` now trains other variables than its optimizer's state was sharded over."""
    now = [id(kc.tf_variable(v)) for v in model.trainable_variables]
    if now == [id(kc.tf_variable(v)) for v in sharded]:
        return
    raise ValueError(
        f"The optimizer {model.optimizer.name!r} of this 'sharded_optimizer' model holds its state in "
        f"slices laid out for the {len(sharded)} variables it was built on; the model now trains "
        f"{len(now)} (a layer's `trainable` changed since). The slices cannot be laid out again. "
        "Compile with a new optimizer, e.g. model.compile(optimizer=keras.optimizers.Adam(...), ...), "
        "inside the strategy's scope. The weights and the optimizer's state are unchanged."
    )


def sharded_optimizer_path(step, data):
    """The gradient path of `ShardedOptimizerStrategy`: reduce to slices, update slices, all-gather.

    Returns the replicas' summed metric state where it rode in the reduction
    (`TrainStep.metric_riders`), else None.
    """
    state = kc.sharded_state(step.optimizer)

    def replica_fn(batch):
        if step.layer_reductions is not None:
            shard, total, *riders = state.reduce_by_unit(step, batch, step.metric_riders())
            return step.finish([shard, total]), riders
        values = step.local_gradients(batch)
        shard, total, *riders = state.reduce(step.options.bucket_bytes, values, step.metric_riders())
        return step.finish([shard, total]), riders

    grads, riders = step.strategy.run(replica_fn, args=(data,))
    step.apply(grads, update_fn=state.apply_reduced)
    return summed_riders(step.strategy, riders)



class _ShardsInPlace(update.Placement):
    """Stage 3's update placement: each part of a variable held in parts on its own device.

    With `optimizer` (an optimizer whose update is per element), element-wise
    work (`run`: the optimizer's `update_step`, weight decay, EMA) runs part
    by part on each part's device, with the optimizer's slots reading as
    their own part (`kc.slots_as_parts`), so its temporaries are one part's
    size and no device computes another's update. Without it (an optimizer
    that needs whole tensors: Lamb, Adafactor, Muon, MultiOptimizer) and for
    `run_whole` (constraints), the whole variable is updated and the result
    split into its parts. A variable not held in parts is updated on every copy.
    """

    def __init__(self, strategy, optimizer=None):
        self.every_copy = update.EveryCopy(strategy)
        self.optimizer = optimizer if optimizer is not None and _updates_per_element(optimizer) else None

    def run(self, variable, fn, *args) -> None:
        if not kc.is_sharded(variable):
            self.every_copy.run(variable, fn, *args)
            return
        if self.optimizer is None:
            fn(kc.tf_variable(variable), *args)
            return
        offset = 0
        for i, part in enumerate(kc.variable_parts(variable)):
            rows = int(part.shape[0])
            with tf.device(part.device), kc.slots_as_parts(self.optimizer, variable, i):
                fn(kc.PartStandIn(variable, part), *[_part_of(a, i, offset, rows, variable) for a in args])
            offset += rows

    def run_whole(self, variable, fn, *args) -> None:
        if kc.is_sharded(variable):
            fn(kc.tf_variable(variable), *args)
        else:
            self.every_copy.run(variable, fn, *args)


@tf.autograph.experimental.do_not_convert
def _part_of(value, index: int, offset: int, rows: int, variable):
    """Part `index` (rows `offset` to `offset + rows`) of `value`, an argument of `variable`'s update.

    A variable held in parts gives its part; sparse rows those that fall in
    the part, renumbered from its first row; a tensor of the variable's
    shape its rows; anything else (a scalar) is the same for every part.
    """
    if kc.is_sharded(value):
        return kc.variable_parts(value)[index]
    if isinstance(value, tf.IndexedSlices):
        return rows_in(value, offset, rows)
    if isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank and value.shape == variable.shape:
        return value[offset:offset + rows]
    return value


@tf.autograph.experimental.do_not_convert
def _sum_onto_parts(grads: list, variable, shared_rows: bool = False):
    """The replicas' gradients of `variable` summed, each part's rows on that part's device.

    A reduce-scatter over the parameter shards: part i's rows of every
    replica's gradient are copied to part i's device and added there.
    Sparse gradients (Embedding rows) are concatenated, as one device sees
    them, except rows that are the same on every replica (`shared_rows`, a
    position embedding: `collectives.rows_shared_by_replicas`), whose values
    are summed. Returns one gradient for the whole variable.
    """
    if isinstance(grads[0], tuple):
        # One gradient per part from each replica (`tfdist.engine.gather`): part i's summed on its device.
        if all(g is None for g in grads[0]):
            return None
        if not any(isinstance(g, tf.IndexedSlices) for parts in grads for g in parts):
            pieces = []
            for i, part in enumerate(kc.variable_parts(variable)):
                with tf.device(part.device):
                    pieces.append(tf.add_n([parts[i] for parts in grads]) if len(grads) > 1 else grads[0][i])
            return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)
        grads = [regroup(variable, list(parts)) for parts in grads]
    if grads[0] is None:
        return None
    if shared_rows and len(grads) > 1:
        return tf.IndexedSlices(tf.add_n([g.values for g in grads]), grads[0].indices, grads[0].dense_shape)
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        slices = [g if isinstance(g, tf.IndexedSlices) else tf.IndexedSlices(g, tf.range(tf.shape(g)[0])) for g in grads]
        return tf.IndexedSlices(
            tf.concat([g.values for g in slices], 0),
            tf.concat([tf.cast(g.indices, tf.int64) for g in slices], 0),
            slices[0].dense_shape,
        )
    if len(grads) == 1:
        return grads[0]
    if not kc.is_sharded(variable):
        return tf.add_n(list(grads))
    pieces, offset = [], 0
    for part in kc.variable_parts(variable):
        rows = int(part.shape[0])
        with tf.device(part.device):
            pieces.append(tf.add_n([g[offset:offset + rows] for g in grads]))
        offset += rows
    return tf.concat(pieces, axis=0)


def _local_results(strategy, value):
    """Each local replica's `value`; a tuple of per-replica parts gives a tuple per replica."""
    if value is None:
        return None
    if isinstance(value, tuple):
        per_part = [strategy.experimental_local_results(p) if p is not None else None for p in value]
        replicas = len(strategy.extended.worker_devices)
        return [tuple(p[r] if p is not None else None for p in per_part) for r in range(replicas)]
    return strategy.experimental_local_results(value)


def sharded_parameters_path(step, data) -> None:
    """Stage 3's gradient path: per-shard sums of the replicas' gradients, each shard updated where it lives."""
    strategy = step.strategy
    shared = set()

    def replica_fn(batch):
        values = step.local_gradients(batch)
        for i, g in enumerate(values[:-1]):
            if isinstance(g, tf.IndexedSlices) and collectives.rows_shared_by_replicas(g):
                shared.add(i)
        return values

    per_replica = strategy.run(replica_fn, args=(data,))
    local = [_local_results(strategy, v) for v in per_replica]
    summed = [
        None if g is None else _sum_onto_parts(list(g), v, i in shared)
        for i, (g, v) in enumerate(zip(local[:-1], step.variables))
    ]
    summed.append(tf.add_n(list(local[-1])))
    placement = _ShardsInPlace(strategy, step.update_optimizer)
    step.apply(
        step.finish(summed),
        update_fn=lambda grads: update.apply_update(step.update_optimizer, grads, step.variables, placement),
    )


# Stage 3: parameters are parts on the replicas' devices, not copies on each (a replica's XLA
# program takes their gathered values as inputs: `gathers_parameters`).
SHARDED_PARAMETERS = GradientPath(
    "sharded_parameters", sharded_parameters_path, _ShardsInPlace, variables_on_replicas=False,
    gathers_parameters=True,
)

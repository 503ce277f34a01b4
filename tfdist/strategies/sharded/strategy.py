"""The sharded-optimizer strategies: ZeRO stages 1, 2 and 3 on one host, stages 1 and 2 across workers.

Data parallelism with the optimizer state split across replicas
(Rajbhandari et al., "ZeRO", 2020). This module holds what is particular to
the strategy: its options, what it refuses (`unsupported`), and what it does
at `compile` (the optimizer becomes a sharded one: `ShardedState`). How a
step reduces and updates is in `tfdist.strategies.sharded.step` (stages 1 and
2) and `tfdist.strategies.sharded.stage3`; the state and its checkpoint
layout in `state`, `slices`, `owned` and `checkpoint`.

Across the worker processes of a job (TF_CONFIG with several workers, or
`cluster_resolver=`), `ShardedOptimizerStrategy(...)` returns a
`MultiWorkerShardedOptimizerStrategy`: the multi-worker strategy with this
step, replicas numbered across workers; saving all-gathers the state.
"""

from __future__ import annotations

import os
from typing import Sequence

from tfdist import cluster as cluster_lib
from tfdist import options as options_lib
from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine.step import ALL_REDUCE, GradientPath
from tfdist.strategies.base import run_creation_hooks
from tfdist.strategies.mirrored import MirroredStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.sharded import checkpoint
from tfdist.strategies.sharded.optimizer import make_sharded_optimizer, sharded_state, updates_elementwise
from tfdist.strategies.sharded.owned import OwnedState
from tfdist.strategies.sharded.slices import LAYOUT_BUCKET_BYTES, SlicedState
from tfdist.strategies.sharded.stage3 import SHARDED_PARAMETERS
from tfdist.strategies.sharded.step import sharded_optimizer_path

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
            if sharded_state(model.optimizer) is None:
                self._shard(model.optimizer)
            built_on = sharded_state(model.optimizer).variables
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
                sharded_state(model.optimizer).built_ahead = True
        if not getattr(model, "_tfdist_load_guarded", False):
            kc.guard_load_weights(
                model, lambda: checkpoint.snapshot(model, sharded_state(model.optimizer)),
                lambda saved: checkpoint.restore(model, saved),
            )
            object.__setattr__(model, "_tfdist_load_guarded", True)

    def on_keras_build(self, model) -> None:
        """Keras would build an unbuilt optimizer here: one built at `compile` now loads state as any built one."""
        state = sharded_state(model.optimizer) if model.optimizer is not None else None
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
        """Stages 1 and 2: the optimizer becomes a sharded one: by flat slices, or by whole variables.

        An element-wise optimizer (`updates_elementwise`) is sharded by flat
        slices (`SlicedState`); any other by whole variables (`OwnedState`).
        """
        # Under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer:
        # the inner one is sharded (it reads float32 weights: the master
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
        kind = SlicedState if updates_elementwise(optimizer) else OwnedState
        state = kind(self, optimizer, under_loss_scale=wrapper is not None, unbuilt_variables=unbuilt)
        make_sharded_optimizer(optimizer, state, loss_scale_optimizer=wrapper)


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

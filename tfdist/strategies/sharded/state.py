"""The sharded side of one Keras optimizer: what the optimizer's class asks of it, for every kind of sharding.

A `ShardedState` is created by the strategy at `compile` (stages 1 and 2,
several replicas) and attached to the user's optimizer, whose class becomes a
same-named subclass of its own (`tfdist.strategies.sharded.optimizer`). Two
kinds, chosen by `optimizer.updates_elementwise`:

* `SlicedState` (`tfdist.strategies.sharded.slices`): each replica owns an
  even flat slice of the parameters, one chunk of every bucket, and keeps the
  optimizer state of its slice only;
* `OwnedState` (`tfdist.strategies.sharded.owned`): each replica owns whole
  variables (balanced by size) and keeps their optimizer state only, as
  PyTorch's ZeroRedundancyOptimizer partitions by parameter.

Both read and write the state a single-device optimizer would hold
(`canonical_values`), so checkpoints move freely between strategies and
replica counts. This module holds what the two share: the optimizer-facing
methods, Keras's saving protocol and `tf.train.Checkpoint`'s.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.strategies.sharded import checkpoint
from tfdist.strategies.sharded.optimizer import class_trackable_children


def fill(variable, value) -> tf.Operation:
    """Writes `value` into `variable` (a `tf.Variable` emptied by `empty`), in place of what it holds."""
    return tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value, validate_shape=False)


def empty(variable) -> tf.Operation:
    """Releases `variable`'s buffer until the next `fill`; its declared shape stays.

    The sharded update fills a variable with a replica's values, updates it
    and reads it within one step; between steps it holds nothing. The empty
    value's shape is unknown to the graph (it has no elements), as a graph
    may not assign a value of another static shape.
    """
    rank = len(variable.shape)
    with tf.device(variable.device):
        # Of the variable's rank (Grappler, seeing an unknown rank assigned, once dropped a
        # reshape of a later read of it), of no elements.
        nothing = tf.raw_ops.PlaceholderWithDefault(
            input=tf.zeros([0] * rank, variable.dtype), shape=tf.TensorShape([None] * rank)
        )
        return tf.raw_ops.AssignVariableOp(resource=variable.handle, value=nothing, validate_shape=False)


class ShardedState:
    """The sharded side of one Keras optimizer (see the module docstring).

    Attributes:
        strategy: the sharded-optimizer strategy.
        optimizer: the user's optimizer (its class now the sharded subclass).
        variables: the model's trainable variables, in order (after `build`).
        entries: the single-device optimizer's variables, in its order:
            `("slot", name, variable index)` or `("plain", variable)`.
    """

    # Whether the optimizer's clipping runs on flat slices (norms summed across replicas).
    clips_slices = False

    def __init__(self, strategy, optimizer, under_loss_scale: bool = False, unbuilt_variables: Sequence = ()):
        self.strategy = strategy
        self.optimizer = optimizer
        # Wrapped by a LossScaleOptimizer (mixed_float16): the engine's step
        # scales and gates; Keras's own loss-scale apply is not supported.
        self.under_loss_scale = under_loss_scale
        self.variables: list = []
        self.entries: list = []
        self._checkpoint_children: dict | None = None
        # Built by `compile` (`on_compile`) before Keras would build it (the first
        # fit, evaluate, train_on_batch or test_on_batch, `optimizer.build`, `apply`):
        # until then `load_weights` loads as into the unbuilt optimizer (`loads_as_unbuilt`).
        self.built_ahead = False
        # The variables the optimizer (or its LossScaleOptimizer) held unbuilt.
        self.unbuilt_variables = list(unbuilt_variables)

    @property
    def built(self) -> bool:
        return bool(self.entries)

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
        self.build_state(variables)
        self._checkpoint_children = None

    def build_state(self, variables: list) -> None:
        """Creates the kind's variables and builds the optimizer on them (`optimizer.built` after)."""
        raise NotImplementedError

    def clip(self, grads: list) -> list:
        """The optimizer's clipping, where the engine's `finish` (or a custom loop's apply) calls it."""
        raise NotImplementedError

    def run_step(self, step, data):
        """Cross-replica context: one training step's reduction and update (the strategy's gradient path)."""
        raise NotImplementedError

    def apply(self, grads, trainable_variables=None) -> None:
        """`optimizer.apply` from a custom `train_step` or training loop (replica context)."""
        raise NotImplementedError

    def finalize_variable_values(self, var_list) -> None:
        """At the end of `fit` with `use_ema`: the model takes the averaged weights."""
        if not self.optimizer.use_ema or not self.built:
            return
        for v, value in zip(self.variables, self.averaged_weights()):
            v.assign(value)

    def averaged_weights(self) -> list:
        """The EMA of each model variable (numpy), as one device's optimizer holds it."""
        raise NotImplementedError

    def save_own_variables(self, store) -> None:
        """Keras `.keras` / `.weights.h5`: the single-device optimizer's variables, in its order."""
        for i, value in enumerate(self.canonical_values()):
            store[str(i)] = value

    def load_own_variables(self, store) -> None:
        """Loads a single-device-layout optimizer state, resharding it onto this replica count."""
        if self.loads_as_unbuilt(store, self.optimizer.name):
            return
        if not self.built:
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
        the new learning rate, a step count of 0 and zero moments. `name`: the
        optimizer Keras loads (a LossScaleOptimizer's, under mixed_float16).
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
        children = class_trackable_children(self.optimizer, save_type, **kwargs)
        if not self.built:
            return children
        if save_type != "checkpoint":
            # A SavedModel recreates each variable at load and traces each
            # object's restore function at save, which the checkpoint's
            # canonical values (read and written eagerly) cannot be: it gets
            # plain variables holding the canonical state, taken now.
            children.update(self._canonical_children(self._snapshot_values()))
            return children
        if self._checkpoint_children is None:
            self._checkpoint_children = self._canonical_children(self.checkpoint_values())
        children.update(self._checkpoint_children)
        return children

    # Canonical state ---------------------------------------------------------
    def canonical_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the single-device optimizer's variables, in its order."""
        raise NotImplementedError

    def canonical_values(self) -> list[np.ndarray]:
        """The optimizer state as a single-device optimizer holds it (numpy, in its order)."""
        raise NotImplementedError

    def write_canonical_values(self, values: Sequence) -> None:
        """Writes `values` (validated: one per canonical entry, of its shape) into the sharded state."""
        raise NotImplementedError

    def checkpoint_values(self) -> list:
        """Per canonical slot entry, a trackable that checkpoints as its variable."""
        raise NotImplementedError

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
        self.write_canonical_values(values)

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
        return checkpoint.canonical_children(self, slot_values)

    # Memory (`tfdist.memory_report`) ------------------------------------------
    def held_state(self) -> list:
        """The optimizer's variables (or copies of them) that hold memory on this worker's devices."""
        return list(self.optimizer.variables)

    def replica_copies(self) -> list:
        """One variable copy per local replica, on that replica's device."""
        raise NotImplementedError

    def gradient_buffer_estimate(self) -> int:
        """Bytes of reduced gradient one replica's step holds at most (not counting sparse rows)."""
        raise NotImplementedError

    # Shared by the kinds -----------------------------------------------------
    def components(self, variable) -> list:
        """This worker's copies of a mirrored variable: `[(job-wide replica id, copy), ...]`."""
        local = self.strategy.experimental_local_results(kc.tf_variable(variable))
        return [(tfc.replica_id_in_sync_group(self.strategy, i), c) for i, c in enumerate(local)]

    @property
    def across_workers(self) -> bool:
        """Whether other worker processes hold some of the replicas."""
        return len(self.strategy.extended.worker_devices) != self.strategy.num_replicas_in_sync

    def check_custom_loop(self) -> tf.distribute.ReplicaContext:
        """The replica context of an `optimizer.apply` from a custom loop; raises where the sharded update cannot run."""
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
        return ctx

    def ordered_gradients(self, grads, trainable_variables) -> list:
        """A custom loop's gradients in the order of the variables the optimizer was built on (building it first)."""
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
        return [tf.convert_to_tensor(g) if isinstance(g, keras.Variable) else g for g in ordered]

    @tf.autograph.experimental.do_not_convert
    def finish_step(self) -> None:
        """Cross-replica context: constraints on the whole variables, as in Keras; the step is done."""
        for v in self.variables:
            if v.constraint is not None:
                self.strategy.extended.update(
                    kc.tf_variable(v),
                    lambda x, c=v.constraint: x.assign(c(tf.convert_to_tensor(x)), read_value=False),
                    group=False,
                )
        kc.iterations_variable(self.optimizer).assign_add(1)

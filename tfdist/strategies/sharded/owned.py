"""Sharding by whole variables: each replica owns some variables and updates them whole (any optimizer).

An optimizer whose update is not element-wise (Lamb's trust ratio,
Adafactor's factored moments, Muon's orthogonalisation, a user's per-tensor
norm, or one that does not declare itself element-wise) cannot update a
slice of a variable. Here every trainable variable is owned by one replica
(greedily balanced by size, largest first), as PyTorch's
ZeroRedundancyOptimizer partitions by parameter, and only its owner keeps its
optimizer state:

* the optimizer is built on one variable per model variable (`OwnedState
  .owned`: the model variable's shape, dtype and path, a copy per replica),
  so its slots, factored moments and EMA averages have the single-device
  shapes; every replica's copy of a variable's state but its owner's holds no
  memory;
* a step all-reduces the gradients (bucketed, as stage 1 does), and each
  owner fills its copy of the owned variable with the weights, runs the
  optimizer's own `update_step` on it (a real variable: the optimizer sees
  exactly what it sees on one device) through the engine's one update
  (`tfdist.engine.update.apply_update`), and the updated variables are
  all-gathered into every replica's weights (one collective).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine import update
from tfdist.engine.step import all_reduce
from tfdist.strategies.sharded.optimizer import build_optimizer, unsharded_class
from tfdist.strategies.sharded.state import ShardedState, empty, fill


def balanced_owners(sizes: list[int], replicas: int) -> list[int]:
    """The replica owning each variable: largest first, each to the least-loaded replica (ties: the lowest id).

    Args:
        sizes: elements of each variable.
        replicas: number of replicas.

    Example:

    ```python
    balanced_owners([100, 10, 60, 50], 2)   # [0, 1, 1, 1]: 100 against 120 elements
    ```
    """
    load = [0] * replicas
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners



class OwnedState(ShardedState):
    """Each replica owns whole variables and keeps their optimizer state only (see the module docstring).

    Attributes:
        owners: per model variable, the replica that owns it.
        owned: the variables the optimizer is built on, one per model
            variable (same shape, dtype and path), a copy per replica: the
            owner's copy holds the variable while its update runs, every
            other copy never.
        state_owner: `{id(optimizer variable): owner}` for the optimizer's
            per-variable state (slots, factored moments, EMA averages).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owners: list[int] = []
        self.owned: list = []
        self.state_owner: dict = {}
        self._slot_attribute: dict = {}
        # `{id(TensorFlow variable): model variable index}` of the owned variables, and of their state.
        self.owned_index: dict = {}
        self.state_index: dict = {}
        self.decay: list | None = None
        self._gather_functions: dict = {}

    def build_state(self, variables: list) -> None:
        optimizer = self.optimizer
        sizes = [int(np.prod(v.shape)) for v in variables]
        self.owners = balanced_owners(sizes, self.strategy.num_replicas_in_sync)
        with self.strategy.scope():
            # Holding the weights while the optimizer builds: state that starts
            # from them (ScheduleFreeAdamW's momentum) starts right.
            self.owned = [kc.variable_at_path(v.path, np.asarray(v.numpy()), trainable=False) for v in variables]
            build_optimizer(optimizer, self.owned)
        self.owned_index = {id(kc.tf_variable(v)): i for i, v in enumerate(self.owned)}
        per_variable = kc.state_by_variable(optimizer)
        for i, v in enumerate(self.owned):
            for attribute, state in per_variable.get(id(kc.tf_variable(v)), []):
                self.state_owner[id(state)] = self.owners[i]
                self._slot_attribute[id(state)] = attribute
                self.state_index[id(kc.tf_variable(state))] = i
        self.entries = [
            ("slot", self._slot_attribute[id(v)], j) if id(v) in self.state_owner else ("plain", v)
            for j, v in enumerate(optimizer.variables)
        ]
        with tf.init_scope():
            for v in self.owned:
                for _, copy in self.components(v):
                    empty(copy)
            for v in optimizer.variables:
                owner = self.state_owner.get(id(v))
                if owner is not None:
                    for r, copy in self.components(v):
                        if r != owner:
                            empty(copy)
        if optimizer.weight_decay is not None:
            self.decay = [kc.uses_weight_decay(optimizer, v) for v in variables]

    def held_state(self) -> list:
        held = []
        for v in self.optimizer.variables:
            owner = self.state_owner.get(id(v))
            if owner is None:
                held.append(v)
            elif (copy := self._owner_copy(v, owner)) is not None:
                held.append(copy)
        return held

    def replica_copies(self) -> list:
        return [copy for _, copy in self.components(self.owned[0])]

    def gradient_buffer_estimate(self) -> int:
        """The whole reduced gradient: every replica all-reduces all of it, as under mirrored."""
        return sum(int(np.prod(v.shape)) for v in self.variables) * 4

    def run_step(self, step, data):
        """The gradients all-reduced, as under mirrored; each owner updates its own variables."""
        return all_reduce(step, data, update_fn=self.update)

    def slot_names(self) -> dict:
        return dict(self._slot_attribute)

    def clip(self, grads: list) -> list:
        """Keras's own clipping, on whole gradients summed over the replicas."""
        return kc.clip_gradients_as(unsharded_class(self.optimizer), self.optimizer, grads)

    # Canonical state ------------------------------------------------------------
    def canonical_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(v.shape) for v in self.optimizer.variables]

    def _owner_copy(self, variable, owner: int):
        """The owner's copy of `variable`, where this worker holds it, else None."""
        for r, copy in self.components(variable):
            if r == owner:
                return copy
        return None

    def _read_owned(self, variable, owner: int) -> tf.Tensor:
        """`variable`'s value, read from its owner's copy (across workers: gathered, a collective)."""
        if not self.across_workers:
            return tf.convert_to_tensor(self._owner_copy(variable, owner))
        key = id(variable)
        function = self._gather_functions.get(key)
        if function is None:
            strategy, shape = self.strategy, variable.shape

            def gather():
                ctx = tf.distribute.get_replica_context()
                replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
                local = kc.tf_variable(variable)
                mine = tf.reshape(local, [-1]) if replica == owner else tf.zeros([0], variable.dtype)
                return tf.reshape(ctx.all_gather(mine, axis=0), shape)

            function = tf.function(lambda: strategy.experimental_local_results(strategy.run(gather))[0])
            self._gather_functions[key] = function
        return function()

    def canonical_values(self) -> list[np.ndarray]:
        values = []
        for v in self.optimizer.variables:
            owner = self.state_owner.get(id(v))
            values.append(np.asarray(v.numpy() if owner is None else self._read_owned(v, owner).numpy()))
        return values

    def write_canonical_values(self, values) -> None:
        for v, value in zip(self.optimizer.variables, values):
            owner = self.state_owner.get(id(v))
            if owner is None:
                v.assign(value)
                continue
            copy = self._owner_copy(v, owner)
            if copy is not None:
                with tf.device(copy.device):
                    copy.assign(value)

    def checkpoint_values(self) -> list:
        def value_of(v, owner):
            def read():
                return self._read_owned(v, owner)

            def write(value):
                copy = self._owner_copy(v, owner)
                if copy is not None:
                    with tf.device(copy.device):
                        copy.assign(value)

            return tfc.canonical_checkpoint_value(read, write, tuple(v.shape))

        return [value_of(v, self.state_owner[id(v)]) for v in self.optimizer.variables if id(v) in self.state_owner]

    def averaged_weights(self) -> list:
        averages = kc.ema_averages(self.optimizer)
        return [np.asarray(self._read_owned(a, owner).numpy()) for a, owner in zip(averages, self.owners)]

    # The update ------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def update(self, grads: list) -> None:
        """Cross-replica context: each owner updates its variables whole, then every replica gets them."""
        placement = OnOwners(self, grads)
        decay = self.decay

        def mask():
            # Keras's per-variable rule, decided on the model's variable (its
            # exclusions may name it, `exclude_from_weight_decay(var_list=...)`).
            return None if decay[placement.current] else 0.0

        update.apply_update(
            self.optimizer, list(grads), list(self.owned), placement,
            decay_mask=mask if decay is not None else None, constrain=False, count=False,
        )
        self._broadcast([g is not None for g in grads])
        self.finish_step()

    @tf.autograph.experimental.do_not_convert
    def _broadcast(self, updated: list) -> None:
        """Every replica's copy of each variable takes its owner's update (one all-gather); the owned copies empty.

        A variable without a gradient (`updated` False) was not updated: its
        owner sends the weights it holds.
        """
        sizes = [int(np.prod(v.shape)) for v in self.variables]
        replicas = self.strategy.num_replicas_in_sync
        offsets, length = [0] * len(sizes), [0] * replicas
        for i, owner in enumerate(self.owners):
            offsets[i] = length[owner]
            length[owner] += sizes[i]
        width = max(length)

        def send():
            ctx = tf.distribute.get_replica_context()
            replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
            mine = [
                tf.reshape(kc.tf_variable(owned if fresh else v), [-1])
                for v, owned, owner, fresh in zip(self.variables, self.owned, self.owners, updated)
                if owner == replica
            ]
            if length[replica] < width:
                mine.append(tf.zeros([width - length[replica]], tf.float32))
            return collectives.all_gather_shards(tf.concat(mine, axis=0) if len(mine) > 1 else mine[0])

        gathered = self.strategy.run(send)
        for i, (v, owner) in enumerate(zip(self.variables, self.owners)):
            start = owner * width + offsets[i]

            def write(x, value, start=start, size=sizes[i], shape=tuple(v.shape)):
                # A copy: a slice of the gathered buffer would keep it alive between steps.
                return x.assign(tf.reshape(collectives.copy_out(value[start:start + size]), shape), read_value=False)

            self.strategy.extended.update(kc.tf_variable(v), write, args=(gathered,), group=False)
        for v, fresh in zip(self.owned, updated):
            if fresh:
                self.strategy.extended.update(kc.tf_variable(v), empty, group=False)

    # A custom loop's `optimizer.apply` ----------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None) -> None:
        """`optimizer.apply` from a custom `train_step` or training loop (replica context).

        The replicas' gradients are summed (Keras's `compute_loss` already
        divided each replica's loss by the replica count), clipped as Keras
        clips them on one device, and each owner updates its variables.
        """
        ctx = self.check_custom_loop()
        ordered = self.ordered_gradients(grads, trainable_variables)
        summed = collectives.all_reduce_sum(ordered, self.strategy.options.bucket_bytes)
        update.apply_gradients(
            self.optimizer, summed, lambda finished: ctx.merge_call(lambda _, *g: self.update(list(g)), args=tuple(finished))
        )


class OnOwners(update.EveryCopy):
    """Where an `OwnedState`'s update runs: on the owner's copy of each owned variable (and its state), filled first.

    `apply_update` runs the optimizer's own `update_step` (and weight decay,
    EMA) on each owned variable through `strategy.extended.update`, as on a
    mirrored variable; only the owner's copy runs it. Before its first use in
    a step, the owner's copy is filled with the model variable's weights
    (once its gradient exists).
    """

    def __init__(self, state: OwnedState, grads: list):
        super().__init__(state.strategy)
        self.state = state
        self.grads = [None if g is None else state.strategy.experimental_local_results(g) for g in grads]
        self.filled: set = set()
        # The model variable whose update is being built (for the weight-decay mask).
        self.current: int | None = None

    def run(self, variable, fn, *args) -> None:
        state = self.state
        key = id(kc.tf_variable(variable))
        is_owned = key in state.owned_index
        i = state.owned_index.get(key, state.state_index.get(key))
        if i is None:
            super().run(variable, fn, *args)
            return
        owner = state.owners[i]
        # Owned variables read as arguments (EMA's average moves towards its variable).
        read = [(n, state.owned_index[id(a)]) for n, a in enumerate(args) if id(a) in state.owned_index]

        def on_replica(copy, *values):
            local = tfc.update_replica_id()
            if int(tfc.replica_id_in_sync_group(state.strategy, local)) != owner:
                return None
            for n, j in read:
                self._fill(values[n], j, local)
            if is_owned:
                self._fill(copy, i, local)
            self.current = i
            return fn(copy, *values)

        state.strategy.extended.update(kc.tf_variable(variable), on_replica, args=args, group=False)

    def _fill(self, copy, i: int, local: int) -> None:
        if (local, i) in self.filled:
            return
        grads = self.grads[i]
        after = []
        if grads is not None:
            g = grads[local]
            after = [g.values if isinstance(g, tf.IndexedSlices) else g]
        with tf.control_dependencies(after):
            fill(copy, tf.convert_to_tensor(kc.tf_variable(self.state.variables[i])))
        self.filled.add((local, i))


"""Stage 3: parameters held in parts, one per replica's device; each part updated where it lives.

Every trainable variable is a `ShardedVariable` whose rows are split over the
replicas' devices (`tfdist._compat.tf.shard_trainable_variables`), and Keras
creates each slot beside its variable, split alike. Each replica gathers each
layer's variables for its forward and again for its backward pass
(`tfdist.engine.gather`); each part's rows of the replicas' gradients are
summed on that part's device (`sharded_parameters_path`); the engine's one
update (`tfdist.engine.update.apply_update`) then runs the user's optimizer,
unchanged, where `ShardsInPlace` places each variable's update:

* an element-wise optimizer (`updates_elementwise`) updates each part on its
  own device, the part a real variable standing for the whole
  (`kc.slots_as_parts`: its slots read as their parts), so its temporaries
  are one part's size and no device computes another's update;
* any other optimizer updates each variable whole on its owner's device, on
  a real variable filled from the parts and written back into them.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import collectives
from tfdist._compat import keras as kc
from tfdist.engine import update
from tfdist.engine.step import GradientPath, regroup
from tfdist.sharding import rows_in
from tfdist.strategies.sharded.optimizer import updates_elementwise
from tfdist.strategies.sharded.owned import balanced_owners
from tfdist.strategies.sharded.state import empty, fill


class ShardsInPlace(update.Placement):
    """Stage 3's update placement: each variable held in parts updated where its parts live.

    Args:
        strategy: the stage-3 strategy.
        optimizer: the optimizer whose update runs (None: every variable
            held in parts is updated whole, as a `ShardedVariable`).
        scratch: a dict kept across traces, for the whole variables that a
            non-element-wise optimizer updates (created at first use).
        variables: the trainable variables (to balance their owners).
    """

    def __init__(self, strategy, optimizer=None, scratch: dict | None = None, variables=()):
        self.every_copy = update.EveryCopy(strategy)
        self.strategy = strategy
        self.optimizer = optimizer
        self.elementwise = optimizer is not None and updates_elementwise(optimizer)
        self.scratch = scratch if scratch is not None else {}
        variables = list(variables)
        owners = balanced_owners([int(v.shape.num_elements()) for v in variables], strategy.num_replicas_in_sync)
        self.owner_device = {id(kc.tf_variable(v)): strategy.extended.worker_devices[o]
                             for v, o in zip(variables, owners)}

    def run(self, variable, fn, *args) -> None:
        if not kc.is_sharded(variable):
            self.every_copy.run(variable, fn, *args)
            return
        if self.elementwise:
            offset = 0
            for i, part in enumerate(kc.variable_parts(variable)):
                rows = int(part.shape[0])
                with tf.device(part.device), kc.slots_as_parts(self.optimizer, variable, i) as own:
                    fn(own, *[_part_of(a, i, offset, rows, variable) for a in args])
                offset += rows
            return
        device = self.owner_device.get(id(kc.tf_variable(variable)))
        if self.optimizer is None or device is None:
            # Not a trained variable (an EMA average: element-wise), or no optimizer to find its state.
            fn(kc.tf_variable(variable), *args)
            return
        whole = self._whole(variable, device)
        with tf.device(device):
            fill(whole, tf.convert_to_tensor(kc.tf_variable(variable)))
            with kc.updates_as(self.optimizer, variable, whole):
                fn(whole, *args)
            kc.tf_variable(variable).assign(tf.convert_to_tensor(whole))
            empty(whole)

    def run_whole(self, variable, fn, *args) -> None:
        if kc.is_sharded(variable):
            fn(kc.tf_variable(variable), *args)
        else:
            self.every_copy.run(variable, fn, *args)

    def _whole(self, variable, device: str):
        """A variable of `variable`'s shape on `device`, holding nothing between updates (made once)."""
        key = id(kc.tf_variable(variable))
        if key not in self.scratch:
            with tf.init_scope(), tf.device(device):
                whole = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                    name="tfdist_whole_variable")
                for copy in self.strategy.experimental_local_results(whole):
                    empty(copy)
            self.scratch[key] = whole
        copies = self.strategy.experimental_local_results(self.scratch[key])
        same = [c for c in copies if tf.DeviceSpec.from_string(c.device) == tf.DeviceSpec.from_string(device)]
        return same[0] if same else copies[0]



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
    """Stage 3's gradient path: per-part sums of the replicas' gradients, each part updated where it lives."""
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
    # Kept across traces: the whole variables a non-element-wise optimizer updates.
    scratch = vars(step).setdefault("_tfdist_whole_variables", {})
    placement = ShardsInPlace(strategy, step.update_optimizer, scratch, step.variables)
    step.apply(
        step.finish(summed),
        update_fn=lambda grads: update.apply_update(step.update_optimizer, grads, step.variables, placement),
    )


# Stage 3: parameters are parts on the replicas' devices, not copies on each (a replica's XLA
# program takes their gathered values as inputs: `gathers_parameters`).
SHARDED_PARAMETERS = GradientPath(
    "sharded_parameters", sharded_parameters_path, ShardsInPlace, variables_on_replicas=False,
    gathers_parameters=True,
)

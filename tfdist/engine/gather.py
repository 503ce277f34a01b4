"""The sharded optimizer's layer units: stage 3 gathers by layer (FSDP); stages 1 and 2 reduce by layer.

`LayerReductions` (stages 1 and 2, at the end of this module) makes each
group of top-level layers hand its gradients to the reduction as soon as its
backward pass ends. What follows is stage 3's.

Under the sharded optimizer's stage 3 every trainable variable is held in
parts, one per replica device (`tfdist._compat.tf.shard_trainable_variables`).
A replica that gathered all of them before its pass would hold a whole copy of
the model for the whole step, and its backward pass would keep each gathered
value alive until that variable's gradient exists: N whole copies at the
step's peak. Here each top-level layer of the model is a unit
(`LayerGathers.plan`):

* forward: the unit's variables are gathered (their parts concatenated on the
  replica's device) once the unit's inputs exist, the layer runs on them, and
  nothing of the gathered values outlives the layer's call;
* backward: once the gradient of the unit's outputs arrives, its variables are
  gathered again, the layer's forward is recomputed from its saved inputs
  (Chen et al. 2016; FSDP with activation checkpointing at the same
  granularity) and differentiated; the variables' gradients leave as one
  gradient per part (rows of the variable), which the stage-3 path sums onto
  the part's device.

So a replica holds the gathered values of about one unit at a time, at the
cost of one more forward pass of each unit. The recomputation reads the
state the forward read (dropout seeds, BatchNorm statistics) and its inputs
carry the Keras masks the forward's call received (a layer may clear them as
it runs): the unit's other variables keep their forward values, and the
forward's updates and added losses leave the unit as outputs
(`tf.custom_gradient`), recorded in the step's `keras.StatelessScope` as
Keras would record them.

A layer is not a unit — its variables are gathered whole before the pass,
as before — when it contains an `Embedding` (its gradient is sparse rows,
which the stage-3 path sums or concatenates by where their indices come
from, `collectives.rows_shared_by_replicas`), a synchronized BatchNorm (a
collective inside the forward, which recomputation would repeat), or a
quantized layer; and under XLA, where the pass is one compiled program.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat import keras as kc
from tfdist.sharding import rows_in


@dataclasses.dataclass(frozen=True)
class Unit:
    """One top-level layer, the step variables (indices) it gathers itself, and the others it reads.

    `also` are the layer's other trainable step variables (not held in
    parts, or gathered by another unit): the unit takes their values as
    inputs and returns their gradients.
    """

    layer: object
    variables: tuple[int, ...]
    also: tuple[int, ...] = ()


def _top_level_layers_holding(model, variables: list):
    """`(layer, indices)` for each top-level layer: which of `variables` it holds as trainable weights."""
    index = {id(kc.tf_variable(v)): i for i, v in enumerate(variables)}
    for layer in kc.top_level_layers(model):
        held: list[int] = []
        for v in layer.trainable_weights:
            i = index.get(id(kc.tf_variable(v)))
            if i is not None and i not in held:
                held.append(i)
        yield layer, held


def _eligible(layer) -> bool:
    if "call" in vars(layer):  # a `call` of the instance's own
        return False
    for sub in [layer] + kc.all_layers(layer):
        if isinstance(sub, keras.layers.Embedding):
            return False
        if getattr(sub, "synchronized", False) or getattr(sub, "quantization_mode", None) is not None:
            return False
    return True


class LayerGathers:
    """The units of a model's forward pass under stage 3, and the calls that gather per unit.

    Args:
        units: the `Unit`s, in the order the model lists its layers.
        variables: the step's trainable variables (gradient order).
    """

    def __init__(self, units: list[Unit], variables: list):
        self.units = units
        self.variables = variables

    @classmethod
    def plan(cls, model, variables: list) -> LayerGathers | None:
        """The units of `model` over `variables` (its trainable variables held in parts), or None if none.

        A variable belongs to the first top-level layer that holds it (a
        variable shared by two layers is gathered by the first; the second
        reads it whole, gathered where it is read).
        """
        if model is None:
            return None
        claimed: set[int] = set()
        units = []
        for layer, held in _top_level_layers_holding(model, variables):
            if not _eligible(layer):
                continue
            mine = [i for i in held if kc.is_sharded(variables[i]) and i not in claimed]
            claimed.update(mine)
            if mine:
                units.append(Unit(layer, tuple(mine), tuple(i for i in held if i not in mine)))
        return cls(units, variables) if units else None

    @property
    def gathered_by_units(self) -> set[int]:
        return {i for unit in self.units for i in unit.variables}

    def calls(self, parts: dict, values: list) -> dict:
        """`{layer: call}` for `kc.calls_replaced`: each unit's layer gathering `parts[i]` (the part values).

        `values` are the step variables' values as the pass reads them
        outside the units (a unit's `also` inputs).
        """
        # The backward pass of one replica: each unit's regather waits for the gradients of the
        # unit whose backward was built before it (`previous`), so about one unit is gathered at a time.
        previous: list = []
        return {unit.layer: _unit_call(unit, self.variables, parts, values, previous) for unit in self.units}


def whole(variable, part_values: list):
    """`variable`'s value from its parts' values (rows, concatenated)."""
    value = part_values[0] if len(part_values) == 1 else tf.concat(part_values, axis=0)
    return tf.reshape(value, variable.shape)


class _LayerCall:
    """One call of a unit's layer: its arguments' tensors, and the layer's own `call` re-run on others.

    `masks` are the tensors' Keras masks as the call receives them: a layer
    may clear its inputs' masks as it runs (`MultiHeadAttention` does, after
    reading the query's mask in place of its `query_mask` argument), so a
    re-run carries these, not what the tensors hold by then.

    The layer runs in a `keras.StatelessScope` of its own, which starts from
    the step's (`outer`) with some variables mapped to other values; what it
    records (updates, added losses) is handed back by `updates` and
    `scope.losses`.
    """

    def __init__(self, layer, args, kwargs):
        self.layer, self.args, self.kwargs = layer, args, kwargs
        self.original = type(layer).call.__get__(layer)
        self.flat = tf.nest.flatten((args, kwargs))
        self.positions = [k for k, a in enumerate(self.flat) if tf.is_tensor(a)]
        self.inputs = [self.flat[k] for k in self.positions]
        self.masks = [kc.keras_mask(t) for t in self.inputs]
        self.outer = kc.stateless_scope()

    def run(self, tensors: list, mapping: dict):
        """The layer's `call` on `tensors` in place of `inputs`, its variables read from `mapping`."""
        flat = list(self.flat)
        for k, value in zip(self.positions, tensors):
            flat[k] = value
        args, kwargs = tf.nest.pack_sequence_as((self.args, self.kwargs), flat)
        with kc.stateless_scope_with(mapping) as scope:
            out = self.original(*args, **kwargs)
        return out, scope


def _updates(scope, mapping: dict, skip) -> list:
    """`(variable id, value)` that `scope` recorded beyond `mapping`, except the variables in `skip`."""
    return [(key, value) for key, value in kc.stateless_values(scope).items()
            if key not in skip and mapping.get(key) is not value]


def with_outside_reads(gradient, part_values: list) -> list:
    """A unit variable's `(part gradients, gradient of its whole value read outside the units)` as part gradients.

    The whole value (`whole`) is what the pass reads outside a unit's call:
    a weight regularizer, a loss the model's `call` adds, a layer tied to
    the variable. Its gradient (None where nothing read it) is split by rows
    and added to the parts' gradients from the units.
    """
    part_grads, outside = gradient
    part_grads = list(part_grads)
    if outside is None:
        return part_grads
    # A sparse piece (rows gathered from the weight) is added densely.
    return [
        extra if own is None else own if extra is None else tf.convert_to_tensor(own) + tf.convert_to_tensor(extra)
        for own, extra in zip(part_grads, _per_part(outside, part_values))
    ]


def _control_inputs(tensors) -> list:
    """`tensors` (None dropped, sparse ones by their values) for `tf.control_dependencies`."""
    return [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors if t is not None]


def _per_part(gradient, part_values: list):
    """A variable's gradient as one gradient per part (its rows of each)."""
    rows = [int(p.shape[0]) for p in part_values]
    if gradient is None:
        return [None] * len(rows)
    if isinstance(gradient, tf.IndexedSlices):
        offsets = np.cumsum([0] + rows[:-1])
        return [rows_in(gradient, int(offset), n) for offset, n in zip(offsets, rows)]
    return tf.split(gradient, rows, axis=0) if len(rows) > 1 else [gradient]


def _unit_call(unit: Unit, variables: list, parts: dict, values: list, previous: list):
    """The replacement `call` of `unit.layer`: gather, run, and recompute for the backward pass."""
    layer = unit.layer
    keras_variables = [variables[i] for i in unit.variables]
    ids = [id(v) for v in keras_variables]
    also_ids = [id(variables[i]) for i in unit.also]
    also_values = [values[i] for i in unit.also]
    # The layer's other state (seeds, BatchNorm statistics): read as the forward read it.
    others = [v for v in layer.variables if id(v) not in set(ids) | set(also_ids)]
    counts = [len(parts[i]) for i in unit.variables]
    flat_parts = [p for i in unit.variables for p in parts[i]]

    def call(*args, **kwargs):
        this = _LayerCall(layer, args, kwargs)
        inputs = this.inputs
        state = kc.stateless_values(this.outer)
        for v in others:
            if id(v) not in state:
                state[id(v)] = tf.convert_to_tensor(kc.tf_variable(v))
        structure: dict = {}
        # The backward pass re-runs the layer outside `Layer.__call__`: with the forward's training flag and autocast.
        call_state = kc.layer_call_state()

        def run(tensors, gathered, read):
            mapping = dict(state)
            mapping.update(zip(ids, gathered))
            mapping.update(zip(also_ids, read))
            return (*this.run(tensors, mapping), mapping)

        def gathered_after(anchors, values):
            with tf.control_dependencies(_control_inputs(anchors)):
                return [whole(v, p) for v, p in zip(keras_variables, _split(values, counts))]

        @tf.custom_gradient
        def unit_pass(*values):
            tensors = values[: len(inputs)]
            own_parts = list(values[len(inputs):len(values) - len(also_values)])
            read = list(values[len(values) - len(also_values):])
            anchors = [t for t in tensors if t.dtype.is_floating] or list(tensors)
            out, scope, mapping = run(tensors, gathered_after(anchors[:1], own_parts), read)
            leaves = tf.nest.flatten(out)
            outputs = [leaf for leaf in leaves if tf.is_tensor(leaf)]
            updates = _updates(scope, mapping, set(ids))
            structure.update(out=out, leaves=leaves, outputs=len(outputs), losses=len(scope.losses),
                             updates=[k for k, _ in updates])
            results = outputs + list(scope.losses) + [value for _, value in updates]

            def grad(*dys, variables=None):
                wanted = dys[: len(outputs) + len(scope.losses)]
                regathered = gathered_after(list(wanted) + previous, own_parts)
                # A tensor passed twice (attention's query and value) gets its two gradients apart.
                # Carrying the masks the forward's call saw: its layer may have cleared the tensors'.
                fresh = [kc.with_keras_mask(tf.identity(t), m) for t, m in zip(tensors, this.masks)]
                sources = [t for t in fresh if t.dtype.is_floating]
                read2 = [tf.identity(r) for r in read]
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch(sources + regathered + read2)
                    with kc.restored_layer_call_state(call_state):
                        out2, scope2, _ = run(fresh, regathered, read2)
                targets = [leaf for leaf in tf.nest.flatten(out2) if tf.is_tensor(leaf)] + list(scope2.losses)
                pairs = [(t, d) for t, d in zip(targets, wanted) if d is not None and t.dtype.is_floating]
                if pairs:
                    grads = tape.gradient(
                        [t for t, _ in pairs], sources + regathered + read2, output_gradients=[d for _, d in pairs]
                    )
                else:
                    grads = [None] * (len(sources) + len(regathered) + len(read2))
                by_input = iter(grads[: len(sources)])
                input_grads = [next(by_input) if t.dtype.is_floating else None for t in tensors]
                part_grads = []
                for g, v_parts in zip(grads[len(sources):len(sources) + len(regathered)], _split(own_parts, counts)):
                    part_grads += _per_part(g, v_parts)
                read_grads = list(grads[len(sources) + len(regathered):])
                done = input_grads + part_grads + read_grads
                previous[:] = _all_replicas_done([g for g in done if g is not None])
                return done, [None] * len(variables or ())

            return results, grad

        results = unit_pass(*inputs, *flat_parts, *also_values)
        results = list(results) if isinstance(results, (list, tuple)) else [results]
        n, m = structure["outputs"], structure["losses"]
        for loss in results[n:n + m]:
            kc.add_layer_loss(this.outer, layer, loss)
        for key, value in zip(structure["updates"], results[n + m:]):
            kc.record_stateless_update(this.outer, key, value)
        tensors = iter(results[:n])
        leaves = [next(tensors) if tf.is_tensor(leaf) else leaf for leaf in structure["leaves"]]
        return tf.nest.pack_sequence_as(structure["out"], leaves)

    return call


def _all_replicas_done(tensors: list):
    """Replica context: a token that exists once every replica has computed its `tensors`.

    The next unit's regather waits for it, so the replicas go through the
    backward pass unit by unit together: a replica that ran ahead would keep
    every unit's weight gradient alive until the slowest replica's arrives
    to be summed with it (measured: the fastest replicas held every layer's
    gradient at the step's peak).
    """
    ctx = tf.distribute.get_replica_context()
    anchors = _control_inputs(tensors)
    if ctx is None or ctx.num_replicas_in_sync == 1 or not anchors:
        return anchors

    def barrier(strategy, per_replica):
        ops = [t for value in per_replica for t in strategy.experimental_local_results(value)]
        with tf.control_dependencies(ops):
            return tf.no_op()

    return [ctx.merge_call(barrier, args=(anchors,))]


def _split(flat: list, counts: list) -> list:
    out, start = [], 0
    for n in counts:
        out.append(flat[start:start + n])
        start += n
    return out


# ---------------------------------------------------------------------------
# Stages 1 and 2: the weight gradients reduced group by group as the backward pass goes.
# ---------------------------------------------------------------------------
class LayerReductions:
    """The units of a model's forward pass under stages 1 and 2, whose gradients leave group by group.

    Each top-level layer enters through an identity (`tf.custom_gradient`)
    on its inputs and on its weights' values, whose gradient function runs
    once the layer's backward pass is done. Consecutive layers form groups
    of at most `bucket_bytes` of gradients (one larger layer alone), in
    backward order; when a group's last layer is done, its gradients go to a
    reducer (which sums them across the replicas and keeps this replica's
    pieces of its slice), and the layer's input gradient goes on to the
    layer before only once that is done. So a replica holds the local
    gradients of about one group at a time, not all of them until the
    backward pass ends, nothing is recomputed, and there are about as many
    collectives as buckets. A layer called several times is done when every
    call's gradient has arrived; what is left at the end (a layer whose
    output the loss does not use) is reduced by `flush`. A sparse gradient
    (a weight gathered by rows outside an Embedding) goes on to the tape as
    usual.

    Args:
        units: the `Unit`s (every step variable belongs to one).
        variables: the step's trainable variables.
        bucket_bytes: the largest group of gradients, in bytes.
    """

    def __init__(self, units: list[Unit], variables: list, bucket_bytes: int):
        self.units = units
        self.variables = variables
        self.groups: list[tuple[int, ...]] = []
        self.largest_group = 0  # elements of gradient
        current, size = [], 0
        for u in reversed(range(len(units))):
            nbytes = sum(int(np.prod(variables[i].shape)) * 4 for i in units[u].variables)
            if current and bucket_bytes > 0 and size + nbytes > bucket_bytes:
                self.groups.append(tuple(current))
                self.largest_group = max(self.largest_group, size // 4)
                current, size = [], 0
            current.append(u)
            size += nbytes
        if current:
            self.groups.append(tuple(current))
            self.largest_group = max(self.largest_group, size // 4)

    @classmethod
    def plan(cls, model, variables: list, bucket_bytes: int) -> LayerReductions | None:
        """Units covering every one of `variables`, each held by one eligible top-level layer; else None."""
        if model is None:
            return None
        claimed: set[int] = set()
        units = []
        for layer, held in _top_level_layers_holding(model, variables):
            mine = [i for i in held if i not in claimed]
            if not mine:
                continue
            if not _eligible(layer):
                return None
            claimed.update(mine)
            units.append(Unit(layer, tuple(mine)))
        return cls(units, variables, bucket_bytes) if len(claimed) == len(variables) else None

    def pass_(self, reads: list, reducer) -> _ReductionPass:
        """One replica's pass: the calls to install (`calls`) and the reduction of what is left (`flush`).

        `reads` are the variables' values the pass reads; `reducer(indices,
        gradients)` runs in replica context and returns what the layer
        before must wait for.
        """
        return _ReductionPass(self, reads, reducer)


class _ReductionPass:
    def __init__(self, plan: LayerReductions, reads: list, reducer):
        self.plan, self.reads, self.reducer = plan, reads, reducer
        self.called = [0] * len(plan.units)
        self.arrived = [0] * len(plan.units)
        self.gradients: dict = {}  # variable index -> summed local gradient of this pass
        self.reduced: set[int] = set()
        self.calls = {unit.layer: _entry_call(self, u) for u, unit in enumerate(plan.units)}

    def arrive(self, u: int, grads: list) -> list:
        """Unit `u`'s call is done backward: keeps its gradients; reduces the groups now complete."""
        for i, g in zip(self.plan.units[u].variables, grads):
            if g is not None:
                self.gradients[i] = g if i not in self.gradients else self.gradients[i] + g
        self.arrived[u] += 1
        done = []
        for group in self.plan.groups:
            if group[0] in self.reduced or any(self.arrived[v] < self.called[v] for v in group):
                continue
            if not any(self.called[v] for v in group):
                continue
            self.reduced.update(group)
            done += self._reduce([i for v in group for i in self.plan.units[v].variables])
        return done

    def flush(self) -> None:
        """Reduces the gradients no complete group has taken (after the backward pass)."""
        if self.gradients:
            self._reduce(sorted(self.gradients))

    def _reduce(self, indices: list) -> list:
        grads = [self.gradients.pop(i, None) for i in indices]
        return self.reducer(indices, grads)


def _entry_call(reduction: _ReductionPass, u: int):
    unit = reduction.plan.units[u]
    layer = unit.layer
    ids = [id(reduction.plan.variables[i]) for i in unit.variables]

    def call(*args, **kwargs):
        this = _LayerCall(layer, args, kwargs)
        inputs = this.inputs
        weights = [reduction.reads[i] for i in unit.variables]
        reduction.called[u] += 1

        @tf.custom_gradient
        def entry(*values):
            def grad(*dys, variables=None):
                dxs, dws = list(dys[: len(inputs)]), list(dys[len(inputs):])
                sparse = [g if isinstance(g, tf.IndexedSlices) else None for g in dws]
                done = reduction.arrive(u, [None if s is not None else g for g, s in zip(dws, sparse)])
                with tf.control_dependencies(_control_inputs(done)):
                    dxs = [_after(d) for d in dxs]
                return dxs + sparse, [None] * len(variables or ())

            return [tf.identity(v) for v in values], grad

        passed = entry(*inputs, *weights)
        passed = list(passed) if isinstance(passed, (list, tuple)) else [passed]
        tensors = [kc.with_keras_mask(p, m) for p, m in zip(passed[: len(inputs)], this.masks)]
        mapping = kc.stateless_values(this.outer)
        mapping.update(zip(ids, passed[len(inputs):]))
        out, scope = this.run(tensors, mapping)
        for loss in scope.losses:
            kc.add_layer_loss(this.outer, layer, loss)
        for key, value in _updates(scope, mapping, set(ids)):
            kc.record_stateless_update(this.outer, key, value)
        return out

    return call


def _after(gradient):
    """`gradient` passed through an op made now (under the caller's control dependencies)."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(gradient.values), gradient.indices, gradient.dense_shape)
    return tf.identity(gradient)

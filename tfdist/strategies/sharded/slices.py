"""Sharding by flat slices: each replica updates an even slice of the parameters (element-wise optimizers).

The trainable variables are laid out as one flat float32 vector, cut into
buckets of `N x C` elements (`tfdist.sharding.FlatLayout`); replica `r` owns
chunk `r` of every bucket, and its slice is its chunks in bucket order.

The optimizer is built on one variable per chunk (`SlicedState.chunks`, `C`
elements each, a copy per replica): Keras creates each slot beside it, so a
replica's copies of the slots hold its slice's state, one variable per chunk,
and no other replica's. In a step each replica's copy of a chunk variable is
filled with its chunk of the weights, the optimizer's own `update_step` runs
on it — a real variable, so any optimizer reads and writes it exactly as on
one device — through the engine's one update (`tfdist.engine.update
.apply_update`), chunk after chunk so that one chunk's temporaries are alive
at a time; each bucket's updated chunks are then all-gathered straight into
the weights, and the chunk variables emptied: no float32 copy of the slice
outlives the step.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine import update
from tfdist.sharding import FlatLayout, gather_range
from tfdist.strategies.sharded.checkpoint import canonical_optimizer_layout
from tfdist.strategies.sharded.optimizer import build_optimizer
from tfdist.strategies.sharded.state import ShardedState, empty, fill
from tfdist.strategies.sharded.step import reduce_to_slice, slices_path

# The default of `shard_bucket_bytes`: on one host, the flat layout's buckets
# are at most this many bytes (and at most `bucket_bytes`). A bucket's chunk
# is the unit of the optimizer update and of the all-gather into the weights,
# so a replica's update temporaries and gathered weights are about this size
# at a time, not its whole slice; fewer, larger buckets mean fewer collectives
# and ops per step. 2 MiB: on the benchmark's 3 x 2048 MLP it keeps stages 1
# and 2 at mirrored's step time at N = 2 and 4 on the 2-core CPU host, where
# 1 MiB took 1.5x at N = 4 (docs/sharded_optimizer.md, Memory).
LAYOUT_BUCKET_BYTES = 2 << 20



class SlicedState(ShardedState):
    """Each replica owns one chunk of every bucket of the flat parameters, and that slice's optimizer state.

    Attributes:
        layout: the `FlatLayout` of the model's trainable variables.
        chunks: the variables the optimizer is built on, one per bucket: a
            copy per replica of `C` elements in name, none in memory between
            steps. Each step fills a replica's copy of chunk `k` with its
            chunk of the weights and updates it in place.
        slots: `{slot name: [the slot of each chunk]}`.
        decay: per model variable, whether it takes weight decay (or None).
    """

    clips_slices = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layout: FlatLayout | None = None
        self.chunks: list = []
        self.slots: dict = {}
        self.decay: list | None = None
        # Variables whose gradient is None in the step being traced (set by the reduction).
        self.without_gradient: frozenset = frozenset()
        self._gather_functions: dict = {}
        # Gradient elements of the largest group of layers a traced step reduced at once (`reduce_by_unit`).
        self.largest_group = 0

    @property
    def shard_bucket_bytes(self) -> int:
        """The strategy's `shard_bucket_bytes` on one host; 0 (use `bucket_bytes`) across workers."""
        if self.across_workers:
            return 0
        return int(self.strategy._tfdist_params.get("shard_bucket_bytes", LAYOUT_BUCKET_BYTES))

    def build_state(self, variables: list) -> None:
        optimizer = self.optimizer
        bucket_bytes = self.strategy.options.bucket_bytes
        shard_bytes = self.shard_bucket_bytes
        if bucket_bytes > 0 and shard_bytes > 0:
            bucket_bytes = min(bucket_bytes, shard_bytes)
        self.layout = layout = FlatLayout.for_variables(variables, self.strategy.num_replicas_in_sync, bucket_bytes)
        with self.strategy.scope():
            self.chunks = [
                keras.Variable(initializer="zeros", shape=(layout.chunk_size,), dtype="float32", trainable=False,
                               name=f"tfdist_parameter_shard_{k}")
                for k in range(layout.num_buckets)
            ]
            build_optimizer(optimizer, self.chunks)
            self.entries, self.slots = canonical_optimizer_layout(optimizer, self.chunks, len(variables))
            with tf.init_scope():
                # State an optimizer starts from the weights (ScheduleFreeAdamW's
                # momentum): its `build` copied the chunk variable, read in
                # cross-replica context (one replica's zeros); each replica's
                # copy must start from that replica's slice of the weights.
                initial = kc.slots_initialised_from_weights(optimizer)
                if initial:
                    weights = layout.flatten_numpy([np.asarray(v.numpy()) for v in variables])
                    for slot in initial:
                        self.scatter_eager(self.slots[slot], weights)
                for chunk in self.chunks:
                    for _, copy in self.components(chunk):
                        empty(copy)
        if optimizer.weight_decay is not None:
            self.decay = [kc.uses_weight_decay(optimizer, v) for v in variables]

    def replica_copies(self) -> list:
        return [copy for _, copy in self.components(self.chunks[0])]

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

    def slot_names(self) -> dict:
        return {id(v): name for name, per_chunk in self.slots.items() for v in per_chunk}

    def run_step(self, step, data):
        return slices_path(self, step, data)

    # Clipping ---------------------------------------------------------------
    def clip(self, grads: list) -> list:
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
            squares = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.reduce_sum(tf.square(values)))
            # The one global-norm factor of the engine's chain (Keras's `clip_by_global_norm`).
            scale = update.global_norm_factor(tf.sqrt(squares), optimizer.global_clipnorm)
            return [tf.convert_to_tensor(g) * scale if sparse else g * scale]
        if optimizer.clipvalue and optimizer.clipvalue > 0:
            v = tf.cast(optimizer.clipvalue, values.dtype)
            clipped = tf.clip_by_value(values, -v, v)
            return [tf.IndexedSlices(clipped, g.indices, g.dense_shape) if sparse else clipped]
        return [g]

    # Canonical state ----------------------------------------------------------
    def canonical_shapes(self) -> list[tuple[int, ...]]:
        return [self.layout.shapes[e[2]] if e[0] == "slot" else tuple(e[1].shape) for e in self.entries]

    def replica_chunks(self, chunks: list) -> list:
        """This worker's copies of per-chunk variables: `[(job-wide replica id, [copy of each chunk]), ...]`."""
        local = [self.strategy.experimental_local_results(kc.tf_variable(c)) for c in chunks]
        return [(tfc.replica_id_in_sync_group(self.strategy, i), [copies[i] for copies in local])
                for i in range(len(local[0]))]

    def gather_eager(self, chunks: list) -> np.ndarray:
        """The whole flat state held in per-chunk variables (unpadded), from every replica's slice.

        Across workers this is an all-gather, a collective: every worker must
        call it, in the same order (saving is done by every worker).
        """
        if not self.across_workers:
            slices = [np.concatenate([np.asarray(c.numpy()).reshape(-1) for c in copies])
                      for _, copies in self.replica_chunks(chunks)]
            return self.layout.from_slices(np.concatenate(slices))
        return np.asarray(self._gather_tensor(chunks).numpy())

    def _gather_tensor(self, chunks: list) -> tf.Tensor:
        """`gather_eager` as a tensor (readable inside a traced function)."""
        if not self.across_workers:
            with tf.device("/cpu:0"):
                return self.layout.from_slices(tf.concat(
                    [tf.reshape(c, [-1]) for _, copies in self.replica_chunks(chunks) for c in copies], axis=0))
        key = tuple(id(c) for c in chunks)
        function = self._gather_functions.get(key)
        if function is None:
            strategy = self.strategy
            variables = [kc.tf_variable(c) for c in chunks]

            def gather():
                return collectives.all_gather_shards(tf.concat([tf.reshape(v, [-1]) for v in variables], axis=0))

            # Traced once per state: eager `strategy.run` would retrace TensorFlow's gather every call.
            function = tf.function(lambda: strategy.experimental_local_results(strategy.run(gather))[0])
            self._gather_functions[key] = function
        return self.layout.from_slices(function())

    def scatter_eager(self, chunks: list, flat: np.ndarray) -> None:
        """Writes the whole flat state `flat` into per-chunk variables, each replica its slice."""
        slices = self.layout.to_slices_numpy(flat)
        c = self.layout.chunk_size
        for r, copies in self.replica_chunks(chunks):
            for k, copy in enumerate(copies):
                with tf.device(copy.device):
                    copy.assign(slices[r][k * c:(k + 1) * c])

    def canonical_values(self) -> list[np.ndarray]:
        gathered: dict = {}
        values = []
        for entry in self.entries:
            if entry[0] == "plain":
                values.append(np.asarray(entry[1].numpy()))
                continue
            _, slot, index = entry
            if slot not in gathered:
                gathered[slot] = self.layout.unflatten_numpy(self.gather_eager(self.slots[slot]))
            values.append(gathered[slot][index])
        return values

    def write_canonical_values(self, values) -> None:
        per_slot: dict = {}
        for entry, value in zip(self.entries, values):
            if entry[0] == "plain":
                entry[1].assign(value)
            else:
                per_slot.setdefault(entry[1], [None] * len(self.variables))[entry[2]] = value
        for slot, arrays in per_slot.items():
            self.scatter_eager(self.slots[slot], self.layout.flatten_numpy(arrays))

    def checkpoint_values(self) -> list:
        layout = self.layout

        def value_of(slot, index):
            def read():
                whole = self._gather_tensor(self.slots[slot])
                with tf.device("/cpu:0"):
                    offset, size = layout.offsets[index], layout.sizes[index]
                    return tf.reshape(whole[offset:offset + size], layout.shapes[index])

            def write(value):
                # One model variable's piece of a slot: rewrite the parts of
                # this worker's slices that cover it (eagerly; restoring runs
                # eagerly; no collective, so workers need not restore in step).
                piece = np.asarray(value, np.float32).reshape(-1)
                c = layout.chunk_size
                for r, copies in self.replica_chunks(self.slots[slot]):
                    mine = [p for p in layout.pieces(r) if p.variable == index]
                    if not mine:
                        continue
                    current = np.concatenate([np.array(copy.numpy()).reshape(-1) for copy in copies])
                    for p in mine:
                        current[p.offset:p.offset + p.stop - p.start] = piece[p.start:p.stop]
                    for k, copy in enumerate(copies):
                        with tf.device(copy.device):
                            copy.assign(current[k * c:(k + 1) * c])

            return tfc.canonical_checkpoint_value(read, write, layout.shapes[index])

        return [value_of(entry[1], entry[2]) for entry in self.entries if entry[0] == "slot"]

    def averaged_weights(self) -> list:
        return self.layout.unflatten_numpy(self.gather_eager(kc.ema_averages(self.optimizer)))

    # The update -----------------------------------------------------------------
    def chunks_of(self, g) -> list:
        """Replica context: a finished gradient slice, cut into one gradient per chunk variable."""
        c, buckets = self.layout.chunk_size, self.layout.num_buckets
        if isinstance(g, tf.IndexedSlices):
            out = []
            for k in range(buckets):
                inside = (g.indices >= k * c) & (g.indices < (k + 1) * c)
                indices = tf.boolean_mask(g.indices, inside) - tf.cast(k * c, g.indices.dtype)
                out.append(tf.IndexedSlices(tf.boolean_mask(g.values, inside), indices,
                                            tf.constant([c], g.indices.dtype)))
            return out
        return [g] if buckets == 1 else [g[k * c:(k + 1) * c] for k in range(buckets)]

    @tf.autograph.experimental.do_not_convert
    def update(self, grads: list) -> None:
        """Cross-replica context: each replica's update of its slice, then the all-gather into the weights."""
        placement = OwnedSlices(self, grads)
        # Keras skips a variable whose gradient is None (a branch under
        # stop_gradient): no update, so no weight decay either.
        decay = None if self.decay is None else [
            d and i not in self.without_gradient for i, d in enumerate(self.decay)
        ]

        def mask():
            # Evaluated where each replica's update of a chunk runs: decay only
            # the elements of variables that take weight decay.
            replica = tfc.replica_id_in_sync_group(self.strategy, tfc.update_replica_id())
            full = self.layout.mask(replica, decay)
            if full is None:
                return None
            k, c = placement.chunk, self.layout.chunk_size
            return full[k * c:(k + 1) * c]

        update.apply_update(
            self.optimizer, list(grads), list(self.chunks), placement,
            decay_mask=mask if self.decay is not None else None, constrain=False, count=False,
        )
        after: dict = {}
        for k in range(self.layout.num_buckets):
            gathered = self.strategy.run(lambda k=k: self._gather_bucket(k, after))
            self._write_bucket(k, gathered, after)
        self.finish_step()

    @tf.autograph.experimental.do_not_convert
    def _gather_bucket(self, k: int, after: dict) -> tf.Tensor:
        """Replica context: bucket `k` of the updated parameters, all-gathered from every replica's chunk.

        Sent once this replica has written the previous bucket into the model
        (`after`), so that about one gathered bucket is alive at a time.
        """
        ctx = tf.distribute.get_replica_context()
        replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
        with tf.control_dependencies(after.get(replica, [])):
            chunk = tf.identity(kc.tf_variable(self.chunks[k]))
        return collectives.all_gather_shards(chunk)

    @tf.autograph.experimental.do_not_convert
    def _write_bucket(self, k: int, gathered, after: dict) -> None:
        """Cross-replica context: writes bucket `k` into the variables it covers, straight from it; empties chunk `k`.

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
        # Each replica's chunk was read for the gather: its buffer goes until the next step fills it.
        strategy.extended.update(kc.tf_variable(self.chunks[k]), empty, group=False)
        after.clear()
        for i, value in enumerate(strategy.experimental_local_results(gathered)):
            replica = int(tfc.replica_id_in_sync_group(strategy, i))
            after[replica] = done.get(replica, []) + [value]

    # A custom loop's `optimizer.apply` ---------------------------------------------
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
        ctx = self.check_custom_loop()
        ordered = self.ordered_gradients(grads, trainable_variables)
        shard, _ = reduce_to_slice(self, self.strategy.options.bucket_bytes, ordered + [tf.constant(1.0)])

        def apply(finished):
            ctx.merge_call(lambda _, *g: self.update(list(g)), args=tuple(self.chunks_of(finished[0])))

        # Unscaled and clipped on the summed slice (norms summed across replicas: `clip`).
        update.apply_gradients(self.optimizer, [shard], apply)


class OwnedSlices(update.EveryCopy):
    """Where a `SlicedState`'s update runs: on every replica's copy of each chunk variable, filled first.

    `apply_update` runs the optimizer's own `update_step` (and weight decay,
    EMA) on each chunk variable through `strategy.extended.update`, as on
    every copy of a mirrored variable; each replica's copy holds that
    replica's chunk. Before its first use in a step, a copy is filled with
    the replica's chunk of the weights (read on the replica's device, once
    its gradient exists: left free, TensorFlow reads every chunk while the
    gradients are still being reduced). Each chunk's work waits for the
    previous chunk's, so one chunk's temporaries (Adam's `g - m`, `g**2`,
    `sqrt(v)`) are alive at a time, not the slice's. Other variables (the EMA
    averages) are updated on every copy, unordered.

    Args:
        state: the `SlicedState`.
        grads: the per-chunk gradients (per-replica values).
    """

    def __init__(self, state: SlicedState, grads: list):
        super().__init__(state.strategy)
        self.state = state
        self.index = {id(kc.tf_variable(c)): k for k, c in enumerate(state.chunks)}
        self.grads = [state.strategy.experimental_local_results(g) for g in grads]
        self.filled: set = set()
        self.previous: dict = {}
        # The chunk whose update is being built (for the weight-decay mask).
        self.chunk: int | None = None

    def run(self, variable, fn, *args) -> None:
        k = self.index.get(id(kc.tf_variable(variable)))
        # Chunk variables read as arguments (EMA's average moves towards them).
        read = [(i, self.index[id(a)]) for i, a in enumerate(args) if id(a) in self.index]
        if k is None and not read:
            super().run(variable, fn, *args)
            return

        def on_replica(copy, *values):
            local = tfc.update_replica_id()
            for i, j in read:
                self._fill(values[i], j, local)
            if k is None:
                return fn(copy, *values)
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            with tf.control_dependencies(self.previous.get(local, [])):
                self._fill(copy, k, local)
                self.chunk = k
                out = fn(copy, *values)
            created = graph.get_operations()[first:]
            if created:
                with tf.control_dependencies(created):
                    self.previous[local] = [tf.no_op()]
            return out

        self.state.strategy.extended.update(kc.tf_variable(variable), on_replica, args=args, group=False)

    def _fill(self, copy, k: int, local: int) -> None:
        """Fills replica `local`'s copy of chunk variable `k` with its chunk of the weights, once per step."""
        if (local, k) in self.filled:
            return
        state = self.state
        layout = state.layout
        replica = int(tfc.replica_id_in_sync_group(state.strategy, local))
        lo, hi = layout.owned_ranges(replica)[k]
        needed = {p.variable for p in layout.range_pieces(lo, hi)}
        grad = self.grads[k][local]
        after = [grad.values if isinstance(grad, tf.IndexedSlices) else grad]
        with tf.control_dependencies(after):
            weights = [tf.convert_to_tensor(kc.tf_variable(v)) if i in needed else None
                       for i, v in enumerate(state.variables)]
        fill(copy, gather_range(layout, weights, lo, hi))
        self.filled.add((local, k))


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

    Args:
        variable: a `tf.Variable`.
        value: 1-D tensor of `stop - start` elements.
        start, stop: the range of the variable's flattened elements.
        last: whether this is the variable's last part this step.

    Example:

    ```python
    write_in_place(v, tf.ones([5]), 3, 8)   # v's flattened elements 3..7 become 1
    ```
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
            resource=handle, indices=tf.range(first, last, dtype=tf.int64), updates=tf.reshape(rows, [last - first] + shape[1:]),
        ))
    if last * row < stop:
        ops.append(part_of_row(last, 0, stop - last * row, value[head + (last - first) * row:]))
    return ops

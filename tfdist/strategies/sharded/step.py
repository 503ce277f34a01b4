"""The sharded optimizer's gradient paths at stages 1 and 2: how the replicas' gradients reach each owner.

`sharded_optimizer_path` is the strategy's `GradientPath`: in cross-replica
context it runs each replica's forward and backward pass (the engine's
`local_gradients`), reduces the gradients to what this replica updates, runs
the engine's `finish` (normalise, unscale, clip) and hands the result to the
state's update (`TrainStep.apply`, so loss-scale gating holds):

* by flat slices (`SlicedState`): on one host, in a plain `fit` step, inside
  the backward pass, group of layers by group as each group's backward ends
  (`reduce_by_unit`); otherwise stage 1 all-reduces the gradients and keeps
  its slice, and stage 2 reduce-scatters the flattened gradient bucket by
  bucket (`tfdist.collectives.reduce_scatter_sum`), so a replica never holds
  more than its gradient slice and two buckets (`reduce_to_slice`);
* by whole variables (`OwnedState.run_step`): the gradients are all-reduced,
  as under mirrored (`tfdist.engine.step.all_reduce`), and each owner updates
  its own.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import collectives
from tfdist.engine.step import summed_riders
from tfdist.sharding import dense_only, gather_shard, gather_shard_slices, has_sparse
from tfdist.strategies.sharded.optimizer import sharded_state


def sharded_optimizer_path(step, data):
    """The gradient path of `ShardedOptimizerStrategy` at stages 1 and 2: the optimizer's sharded state runs it.

    Returns the replicas' summed metric state where it rode in the reduction
    (`TrainStep.metric_riders`), else None.
    """
    return sharded_state(step.optimizer).run_step(step, data)


def slices_path(state, step, data):
    """A `SlicedState`'s step: reduce to each replica's slice, finish, update the slices and all-gather."""

    def replica_fn(batch):
        if step.layer_reductions is not None:
            shard, total, *riders = reduce_by_unit(state, step, batch, step.metric_riders())
        else:
            values = step.local_gradients(batch)
            shard, total, *riders = reduce_to_slice(state, step.options.bucket_bytes, values, step.metric_riders())
        (shard,) = step.finish([shard, total])
        return state.chunks_of(shard), riders

    grads, riders = step.strategy.run(replica_fn, args=(data,))
    step.apply(list(grads), update_fn=state.update)
    return summed_riders(step.strategy, riders)


def reduce_to_slice(state, bucket_bytes: int, values: list, riders: list = ()) -> list:
    """Replica context: `[weighted grads..., weight]` -> `[this replica's summed slice, total weight] + riders`.

    `riders` (the step's metric state, `TrainStep.metric_riders`) are summed
    over the replicas in the same all-reduce as the gradients (stage 1) or
    the total weight (stage 2) and returned after the two.
    """
    ctx = tf.distribute.get_replica_context()
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    grads = values[:-1]
    state.without_gradient = frozenset(i for i, g in enumerate(grads) if g is None)
    riders = list(riders)
    if state.strategy.stage == 1:
        summed = collectives.all_reduce_sum(values + riders, bucket_bytes, state.strategy.options.allreduce_dtype)
        riders, summed = summed[len(values):], summed[: len(values)]
        grads = summed[:-1]
        shard = gather_shard(state.layout, dense_only(grads), replica)
        total = summed[-1]
    else:
        shard = collectives.reduce_scatter_sum(dense_only(grads), state.layout)
        # One collective for the weight and the riders (TensorFlow packs one call's values).
        total, *riders = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [values[-1]] + riders)
        if has_sparse(grads):
            # Sparse rows are all-gathered, as under mirrored, never densified.
            grads = collectives.all_reduce_sum(
                [g if isinstance(g, tf.IndexedSlices) else None for g in grads], bucket_bytes
            )
    if has_sparse(grads):
        shard = gather_shard_slices(state.layout, shard, grads, replica)
    return [shard, total] + riders


def reduce_by_unit(state, step, batch, riders: list = ()) -> list:
    """Replica context: `[this replica's summed slice, total weight] + riders`, reduced layer by layer.

    As each group of layers finishes its backward pass, its weights'
    gradients are summed across the replicas (`bucket_bytes` buckets; a
    variable larger than one travels alone, with no packing copy; on CPU an
    all-reduce of the group is how a reduce-scatter runs, as in
    `tfdist.collectives.reduce_scatter_sum`) and this replica keeps its
    pieces of them (copied out, so the sum is freed); the layer below starts
    its backward pass once that is done. The slice is assembled from the
    pieces at the end. Stage 1 and stage 2 give the same slice.
    """
    layout = state.layout
    ctx = tf.distribute.get_replica_context()
    replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
    mine: dict = {}
    for p in layout.pieces(replica):
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
        sizes = layout.sizes  # static, where a gradient's shape may not be
        # With shard_bucket_bytes, a gradient larger than it is summed in
        # pieces of that size; without, every gradient as it is (packed
        # into bucket_bytes, a larger one alone).
        piece_bytes = state.shard_bucket_bytes
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

    state.largest_group = max(state.largest_group, step.layer_reductions.largest_group)
    values = step.compute_gradients(batch, reducer=reducer)
    grads = values[:-1]
    state.without_gradient = frozenset(i for i, g in enumerate(grads) if g is None and i not in reduced)
    total, *riders = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [values[-1]] + list(riders))
    shard = _slice_from_pieces(layout, kept, replica)
    if has_sparse(grads):
        # Rows gathered from a weight outside an Embedding came back from the tape: all-gathered, kept sparse.
        sparse = collectives.all_reduce_sum(
            [g if isinstance(g, tf.IndexedSlices) else None for g in grads], step.options.bucket_bytes
        )
        shard = gather_shard_slices(layout, shard, sparse, replica)
    return [shard, total] + riders


def _slice_from_pieces(layout, kept: dict, replica: int) -> tf.Tensor:
    """Replica `replica`'s slice from its pieces `{(variable, start): {element: values}}`; zeros elsewhere."""
    parts = []
    for lo, hi in layout.owned_ranges(replica):
        position = 0
        for p in layout.range_pieces(lo, hi):
            value = kept.get((p.variable, p.start))
            if value is None:
                parts.append(tf.zeros([p.stop - p.start], tf.float32))
            else:
                parts += [value[start] for start in sorted(value)]
            position = p.offset + p.stop - p.start
        if position < hi - lo:
            parts.append(tf.zeros([hi - lo - position], tf.float32))
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

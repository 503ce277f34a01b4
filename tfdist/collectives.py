"""Gradient communication on TensorFlow's collective ops, with tensor fusion.

Gradients are packed into fused buffers ("buckets") of at most `bucket_bytes`
per dtype before they cross devices, so a model with hundreds of small
variables sends a handful of collectives per step instead of one per variable.
Buckets are filled in reverse variable order (the last layers' gradients are
ready first in backprop). Sparse gradients (`tf.IndexedSlices`, from
embeddings) are never densified: each is reduced on its own.

The actual transport is TensorFlow's: `ReplicaContext.all_reduce` and
`StrategyExtended.batch_reduce_to`, which use the strategy's cross-device ops
(collective ring over gRPC across workers, NCCL on GPUs, reduction to one
device on CPU).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import tensorflow as tf

from tfdist._compat import tf as tfc

# Every reduction this module issues is counted at trace time, so tests can
# assert how many collectives one step contains without timing anything.
# `all_reduce` counts per replica (each replica traces its own call);
# `reduce_to` counts once per step (a cross-replica call). `all_reduce_bytes`
# adds up the bytes of the fused buffers each replica hands to its all-reduces
# (in the wire dtype: `allreduce_dtype`).
trace_counter = {"all_reduce": 0, "reduce_to": 0, "all_reduce_bytes": 0}

def traced_collective_count() -> int:
    """Collectives traced so far, of every kind (the counters of `trace_counter` that count calls)."""
    return sum(v for k, v in trace_counter.items() if not k.endswith("_bytes"))


def collective_ops_in(graph, by_device: bool = False) -> collections.Counter:
    """How many collective ops of each type a traced graph holds, its conditional and loop bodies included.

    `graph`: a `tf.Graph`, e.g. one of a host function's `traced_graphs`
    (`tfdist.engine.loop.make_host_function`). Counts op types starting with
    "Collective" (`CollectiveReduceV2`, `CollectiveGatherV2`, ...); with
    `by_device`, per op type and device (`"CollectiveReduceV2 CPU:1"`: the
    device's type and index, the job and task left out).
    """
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]

    def key(node):
        if not by_device:
            return node.op
        device = tf.DeviceSpec.from_string(node.device or "")
        return f"{node.op} {device.device_type}:{device.device_index}"

    return collections.Counter(key(n) for n in nodes if n.op.startswith("Collective"))


_ONE_COLLECTIVE_PER_BUFFER = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=1)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A fused buffer: which gradients it holds, in order, and its dtype."""

    dtype: tf.DType
    indices: tuple[int, ...]
    sizes: tuple[int | None, ...]
    shapes: tuple[tuple[int, ...] | None, ...]

    @property
    def fused(self) -> bool:
        """Whether the bucket is a flat buffer; else one gradient sent as it is."""
        return self.shapes != (None,)

    @property
    def num_elements(self) -> int | None:
        return sum(self.sizes) if self.fused else None


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """How a list of gradients is packed into buckets; fixed per trace.

    Args:
        buckets: the dense buckets, in send order.
        sparse: indices of gradients reduced unfused (`tf.IndexedSlices`).
        count: how many gradients the plan covers.
        shared_rows: `{index: (indices, dense_shape)}` of sparse gradients
            whose rows are the same on every replica (`rows_shared_by_replicas`):
            their values are summed like a dense gradient, and they stay
            `tf.IndexedSlices` with those rows.
    """

    buckets: tuple[Bucket, ...]
    sparse: tuple[int, ...]
    count: int
    shared_rows: dict = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def build(cls, grads: Sequence, bucket_bytes: int) -> BucketPlan:
        """Plans buckets for `grads`; `None` entries are skipped.

        A gradient without a fully known static shape cannot be fused (its
        buffer could not be split again); it gets a bucket of its own and is
        sent as it is.
        """
        open_buckets: dict[tf.DType, list] = {}
        buckets: list[Bucket] = []
        sparse: list[int] = []
        shared_rows: dict = {}

        def close(dtype):
            idx, sizes, shapes = open_buckets.pop(dtype)
            buckets.append(Bucket(dtype, tuple(idx), tuple(sizes), tuple(shapes)))

        # Reverse order: the last layers' gradients are ready first.
        for i in reversed(range(len(grads))):
            g = grads[i]
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                if not rows_shared_by_replicas(g):
                    sparse.append(i)
                    continue
                shared_rows[i] = (g.indices, g.dense_shape)
                g = g.values
            shape = tuple(g.shape.as_list())
            if any(d is None for d in shape):
                # Only fused buffers need a static shape (to split them again).
                # A gradient whose shape the tape lost travels on its own.
                buckets.append(Bucket(g.dtype, (i,), (None,), (None,)))
                continue
            size = 1
            for d in shape:
                size *= d
            nbytes = size * g.dtype.size
            if bucket_bytes > 0 and g.dtype in open_buckets:
                cur = open_buckets[g.dtype]
                if (sum(cur[1]) * g.dtype.size + nbytes) > bucket_bytes:
                    close(g.dtype)
            if g.dtype not in open_buckets:
                open_buckets[g.dtype] = ([], [], [])
            cur = open_buckets[g.dtype]
            cur[0].append(i)
            cur[1].append(size)
            cur[2].append(shape)
            if bucket_bytes == 0:
                close(g.dtype)
        for dtype in list(open_buckets):
            close(dtype)
        return cls(tuple(buckets), tuple(sparse), len(grads), shared_rows)

    @property
    def num_collectives(self) -> int:
        return len(self.buckets) + len(self.sparse)

    def pack(self, grads: Sequence) -> list:
        """Returns the fused buffers (flat tensors) then the sparse gradients."""
        out = []
        grads = [g.values if i in self.shared_rows else g for i, g in enumerate(grads)]
        for b in self.buckets:
            if not b.fused:
                out.append(grads[b.indices[0]])
                continue
            parts = [tf.reshape(grads[i], [-1]) for i in b.indices]
            out.append(parts[0] if len(parts) == 1 else tf.concat(parts, axis=0))
        out.extend(grads[i] for i in self.sparse)
        return out

    def unpack(self, packed: Sequence) -> list:
        """Inverse of `pack`: the list of gradients, `None` where there was none."""
        grads: list = [None] * self.count
        for b, flat in zip(self.buckets, packed):
            if not b.fused:
                grads[b.indices[0]] = flat
                continue
            pieces = tf.split(flat, list(b.sizes)) if len(b.sizes) > 1 else [flat]
            for i, piece, shape in zip(b.indices, pieces, b.shapes):
                grads[i] = tf.reshape(piece, shape)
        for i, g in zip(self.sparse, packed[len(self.buckets):]):
            grads[i] = g
        for i, (indices, dense_shape) in self.shared_rows.items():
            grads[i] = tf.IndexedSlices(grads[i], indices, dense_shape)
        return grads


# Ops whose output does not depend on the step's data: a sparse gradient whose
# row indices are computed from these alone has the same rows on every replica.
_DATA_INDEPENDENT_OPS = frozenset({
    "Const", "Range", "Reshape", "Identity", "Cast", "SelectV2", "Select", "Less", "LessEqual",
    "Greater", "GreaterEqual", "AddV2", "Add", "Sub", "Mul", "FloorMod", "Maximum", "Minimum",
    "ExpandDims", "Squeeze", "StridedSlice", "Pack", "ConcatV2", "Tile", "Fill", "ZerosLike",
})


def rows_shared_by_replicas(g: tf.IndexedSlices, max_ops: int = 64) -> bool:
    """Whether a sparse gradient's rows are fixed, the same on every replica and step.

    An embedding looked up per example (token ids) has rows that follow the
    data: each replica's rows are its own examples', and one device's rows are
    all of them, so replicas' rows are concatenated. An embedding looked up
    once per batch with indices computed from constants (a position embedding,
    `Embedding(maxlen, d)(ops.arange(maxlen))`) has the same rows on every
    replica, and on one device each row once, summed over the batch: Keras
    applies an optimizer's element-wise maths per row *before* summing
    duplicates (Adam's second moment of a row is the sum of its pieces'
    squares), so such rows must be summed across replicas, not concatenated,
    to update as one device does. Decided from the graph at trace time: the
    indices derive from constants through a few index ops (up to `max_ops`),
    and the values have a static shape.
    """
    if not g.values.shape.is_fully_defined() or not tf.is_symbolic_tensor(g.indices):
        return False
    seen, todo = set(), [g.indices.op]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type not in _DATA_INDEPENDENT_OPS or len(seen) > max_ops:
            return False
        todo.extend(t.op for t in op.inputs)
    return True


def all_reduce_sum(values: Sequence, bucket_bytes: int, allreduce_dtype: str = "float32") -> list:
    """Sums `values` over all replicas; call in replica context.

    Dense values are fused into buckets of at most `bucket_bytes`; the result
    has the same structure as `values`, with `None` kept. With
    `allreduce_dtype` "bfloat16" or "float16" (the step option), every
    float32 bucket crosses devices in that dtype (`compress`), half the bytes,
    and is cast back to float32 after the sum; sparse rows travel as they are.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("all_reduce_sum must be called in replica context (inside strategy.run).")
    if ctx.num_replicas_in_sync == 1:
        # One replica: the sum is the value; no packing, no collective.
        return list(values)
    plan = BucketPlan.build(values, bucket_bytes)
    packed = plan.pack(values)
    wire, restore = compress(packed[:len(plan.buckets)], allreduce_dtype, ctx.num_replicas_in_sync)
    packed = wire + packed[len(plan.buckets):]
    trace_counter["all_reduce"] += len(packed)
    trace_counter["all_reduce_bytes"] = trace_counter.get("all_reduce_bytes", 0) + sum(
        b.num_elements * w.dtype.size for b, w in zip(plan.buckets, wire) if b.fused
    )
    # TensorFlow's own batching would concatenate every tensor of one call into
    # a single collective (bytes_per_pack=0); a 1-byte pack limit makes it send
    # each of our buffers as it is, so buckets alone decide the fusion.
    #
    # TensorFlow launches one call's dense values in reverse order (2.16 to
    # 2.21, `CollectiveAllReduce._all_reduce_per_replica_values`: "Reverse the
    # lists so that ... values follows the order in which they are calculated"),
    # which would turn the plan's send order (last layers first, whose
    # gradients backprop produces first) into first layers first: every
    # collective would then wait for the whole backward pass. Handing the
    # buckets over reversed makes them launch in send order, so the exchange of
    # the last layers overlaps the rest of backprop
    # (tests/engine/test_bucketing.py, test_each_buckets_collective_waits_only_for_its_own_and_earlier_sent_gradients).
    n = len(plan.buckets)
    hierarchy = getattr(ctx.strategy, "hierarchical_exchange", None)
    if hierarchy is not None and n:
        # Several CPU replicas per worker (multi_worker, `hierarchical`): each
        # bucket summed within the worker, then across workers, in send order;
        # sparse gradients as TensorFlow exchanges them.
        dense = hierarchy(ctx, packed[:n])
        rest = (
            ctx.all_reduce(tf.distribute.ReduceOp.SUM, packed[n:], options=_ONE_COLLECTIVE_PER_BUFFER)
            if packed[n:] else []
        )
    else:
        reduced = ctx.all_reduce(
            tf.distribute.ReduceOp.SUM, packed[:n][::-1] + packed[n:], options=_ONE_COLLECTIVE_PER_BUFFER
        )
        dense, rest = list(reduced[:n])[::-1], reduced[n:]
    return plan.unpack(restore(list(dense)) + list(rest))


def compress(buffers: Sequence, allreduce_dtype: str, num_replicas: int):
    """Casts float32 `buffers` to the wire dtype; returns them and the inverse for their sums.

    Horovod's fp16 compression: a cast before the collective and one after.
    float16 (largest finite value 65504) is pre-scaled by `1 / num_replicas`
    so that the sum of every replica's buffer cannot overflow where one
    buffer does not, and the sum is scaled back in float32. bfloat16 has
    float32's range and needs no scaling; both keep 8 (bfloat16) or 11
    (float16) significant bits. Buffers of other dtypes, and everything
    under "float32", pass unchanged.

    Args:
        buffers: the packed dense buffers (`BucketPlan.pack`).
        allreduce_dtype: str. "float32", "bfloat16" or "float16".
        num_replicas: int. Replicas in the sum.

    Returns:
        `(wire, restore)`: the buffers to send, and a function from their sums
        to float32 sums.
    """
    dtype = tf.as_dtype(allreduce_dtype)
    cast = [dtype != tf.float32 and b.dtype == tf.float32 for b in buffers]
    if not any(cast):
        return list(buffers), list
    scale = 1.0 / num_replicas if dtype == tf.float16 else 1.0

    def down(b):
        return tf.cast(b * scale if scale != 1.0 else b, dtype)

    def restore(sums):
        out = []
        for s, was_cast in zip(sums, cast):
            if was_cast:
                s = tf.cast(s, tf.float32)
                s = s * float(num_replicas) if scale != 1.0 else s
            out.append(s)
        return out

    return [down(b) if c else b for b, c in zip(buffers, cast)], restore


def reduce_to_device(strategy, packed: Sequence, plan: BucketPlan, destination: str) -> list:
    """Sums packed per-replica buffers onto one device; call in cross-replica context.

    Args:
        strategy: the `tf.distribute.Strategy`.
        packed: per-replica values (from `strategy.run`), one per entry of
            `plan.pack(...)`: the fused buffers, then the sparse gradients.
        plan: the `BucketPlan` the replicas packed with.
        destination: device string that receives the sums.

    Returns:
        The unpacked list of summed gradients, on `destination`.
    """
    pairs = [(value, destination) for value in packed]
    trace_counter["reduce_to"] += len(pairs)
    reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)
    with tf.device(destination):
        return plan.unpack([strategy.experimental_local_results(r)[0] for r in reduced])


def reduce_scatter_sum(grads: Sequence, layout):
    """Sums `grads` over replicas; returns this replica's slice of their flat layout.

    Call in replica context. `layout` is the `tfdist.sharding.FlatLayout` of
    `grads` (one tensor, or `None`, per variable); replica `r` receives its
    slice of the summed, flattened, zero-padded gradient (its chunk of every
    bucket): a float32 vector of `layout.shard_size` elements.

    It runs bucket by bucket, the last first (backprop order: the last
    layers' gradients are ready first): bucket `k` is a contiguous range of
    the flat gradient (`layout.bucket_range(k)`, `N * C` elements, at most the
    step's `bucket_bytes`), built from the gradients' pieces in it alone,
    never the whole flat gradient; each replica keeps its own chunk of the
    sum, copied out so that the bucket is freed. A bucket is built only once
    the previous one is reduced, so at most two are alive at a time.
    TensorFlow 2.21 has a `CollectiveReduceScatterV2` op but no CPU
    implementation of it ("CollectiveRegistry::Lookup did not find collective
    implementation", see `tests/strategies/test_sharded_optimizer.py`), so each
    bucket is summed by one all-reduce: the result is exactly a
    reduce-scatter; the traffic is an all-reduce's.
    """
    from tfdist.sharding import gather_range

    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("reduce_scatter_sum must be called in replica context (inside strategy.run).")
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    n, c = layout.num_shards, layout.chunk_size
    mine: dict = {}
    previous: list = []
    for k in reversed(range(layout.num_buckets)):
        with tf.control_dependencies(previous):
            bucket = gather_range(layout, grads, *layout.bucket_range(k))
        trace_counter["reduce_scatter"] = trace_counter.get("reduce_scatter", 0) + 1
        (reduced,) = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [bucket], options=_ONE_COLLECTIVE_PER_BUFFER)
        # A gather copies the own chunk (a slice could alias the whole bucket's buffer); its
        # index int64, which a GPU keeps in device memory (an int32 one is copied there per op).
        mine[k] = tf.gather(tf.reshape(reduced, [n, c]), tf.constant(replica, tf.int64))
        previous = [mine[k]]
    return mine[0] if len(mine) == 1 else tf.concat([mine[k] for k in range(len(mine))], axis=0)


def copy_out(value: tf.Tensor) -> tf.Tensor:
    """A copy of `value` (rank >= 1) in a buffer of its own, ordered after nothing but its input.

    For a slice that would otherwise keep a larger buffer alive (a replica's
    piece of a summed bucket, a variable's piece of a gathered bucket: a
    slice at an aligned offset shares its source's buffer). Not
    `tf.raw_ops.DeepCopy`: it is stateful, and TensorFlow's automatic control
    dependencies run every stateful op without a resource input in program
    order (`tensorflow/python/framework/auto_control_deps.py`,
    `last_write_to_resource[None]`), across devices: the replicas' copies,
    created in turn by their threads, were chained replica 0, replica 1,
    replica 0, ..., one cross-device control edge per copy (the sharded
    optimizer's stage 1 and 2 step on 2 devices: 23 where mirrored has 6,
    tests/engine/test_placement_audit.py). Between two GPUs each such edge is
    a `_Send`/`_Recv` that waits for the sending stream. A concatenation with
    an empty tensor is stateless and always writes a new buffer (TensorFlow
    2.21, CPU and GPU kernels; Grappler keeps it).
    """
    empty = tf.zeros([0] + value.shape.as_list()[1:], value.dtype)
    return tf.concat([value, empty], axis=0)


def all_gather_shards(shard):
    """Concatenates every replica's equal-sized 1-D `shard` in replica order.

    Call in replica context; every replica receives the whole vector
    (one `CollectiveGatherV2`, which TensorFlow implements on CPU and GPU,
    where the strategy's cross-device ops are collective ops).
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("all_gather_shards must be called in replica context (inside strategy.run).")
    trace_counter["all_gather"] = trace_counter.get("all_gather", 0) + 1
    devices = ctx.strategy.extended.worker_devices
    if not shard.device and len(devices) == 1:
        # One local replica (a multi-worker job on CPU): TensorFlow gathers "to
        # the value's device" and refuses a traced tensor that has none
        # ("destinations can not be empty").
        with tf.device(devices[0]):
            shard = tf.identity(shard)
    # Equal shards: one collective, not TensorFlow's two (shapes, then values).
    return tfc.all_gather_equal_shapes(shard)

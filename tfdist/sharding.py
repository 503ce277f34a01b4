"""The flat layout of sharded parameters: which replica owns which elements.

The sharded-optimizer strategy treats the trainable variables as one flat
float32 vector (variables in order, each flattened row-major), padded with
zeros to a multiple of the replica count, and gives replica `r` the contiguous
slice `[r * S, (r + 1) * S)` with `S = ceil(P / N)`. Work and memory are then
balanced however unevenly the parameters are spread over layers. Everything
here is static (fixed per model), so it is computed once, in Python, and turned
into small constants at trace time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where one variable's elements fall inside one replica's slice.

    Args:
        variable: index of the variable in the layout.
        start: first element of the variable covered (flattened index).
        stop: one past the last element covered.
        offset: position of `start` inside the slice.
    """

    variable: int
    start: int
    stop: int
    offset: int


# A chunk of at least ALIGN_FROM elements is a multiple of ALIGN elements (64 bytes of float32):
# TensorFlow slices a tensor along its first axis without copying when both ends of the slice
# fall on 64-byte boundaries (`StridedSlice`, `IsDim0SliceAligned`), so a replica's chunk of its
# gradient slice, and its pieces of the weights, are views, not copies, in the update.
ALIGN = 16
ALIGN_FROM = 4096


def _aligned(elements: int) -> int:
    return -(-elements // ALIGN) * ALIGN if elements >= ALIGN_FROM else elements


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """How `len(shapes)` variables map onto `num_shards` even slices, bucket by bucket.

    The flat vector is cut into `num_buckets` contiguous buckets of `N * C`
    elements; replica `r` owns chunk `r` (`C` elements) of every bucket, and
    its slice is its chunks in bucket order (`S = num_buckets * C`
    elements). A bucket is then both a contiguous range of the parameters (its
    all-gather writes whole variables) and one chunk per replica (its
    reduce-scatter is even). With one bucket (the default) replica `r` owns
    the contiguous slice `[r * S, (r + 1) * S)`, `S = ceil(P / N)`.

    Args:
        shapes: the variables' static shapes, in order.
        num_shards: the number of replicas `N`, >= 1.
        num_buckets: int, >= 1; default 1. `for_variables` derives it from
            the step's `bucket_bytes`.

    Example:

    ```python
    layout = FlatLayout(((3, 2), (4,)), num_shards=4)
    layout.total, layout.shard_size, layout.padding   # 10, 3, 2
    ```
    """

    shapes: tuple[tuple[int, ...], ...]
    num_shards: int
    num_buckets: int = 1

    @classmethod
    def for_variables(cls, variables: Sequence, num_shards: int, bucket_bytes: int = 0) -> FlatLayout:
        """The layout of `variables`, in buckets of at most `bucket_bytes` float32 bytes (0: one bucket)."""
        shapes = tuple(tuple(int(d) for d in v.shape) for v in variables)
        total = sum(math.prod(s) for s in shapes)
        per_replica = max(1, -(-total // num_shards))
        buckets = 1
        if bucket_bytes > 0:
            largest_chunk = max(1, bucket_bytes // (4 * num_shards))
            if largest_chunk >= ALIGN_FROM:
                largest_chunk -= largest_chunk % ALIGN  # an aligned chunk still fits the bucket
            buckets = -(-per_replica // largest_chunk)
        return cls(shapes, num_shards, buckets)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.sizes[:-1]))

    @property
    def total(self) -> int:
        """P: the number of parameters."""
        return sum(self.sizes)

    @property
    def chunk_size(self) -> int:
        """C: elements of one replica's chunk of a bucket, `ceil(P / (N * buckets))` (at least 1).

        From 4096 elements up, rounded up to a multiple of 16 (64 bytes), so
        that slicing a chunk out of a slice, or a variable's piece out of a
        gathered bucket, shares the buffer instead of copying (`ALIGN`).
        """
        return _aligned(max(1, -(-self.total // (self.num_shards * self.num_buckets))))

    @property
    def shard_size(self) -> int:
        """S: elements per replica, `num_buckets * C`."""
        return self.num_buckets * self.chunk_size

    @property
    def padding(self) -> int:
        """Zeros appended so that the flat vector splits evenly."""
        return self.shard_size * self.num_shards - self.total

    def bucket_range(self, bucket: int) -> tuple[int, int]:
        """Flat elements `[lo, hi)` of bucket `bucket` (`N * C` of them)."""
        width = self.num_shards * self.chunk_size
        return bucket * width, (bucket + 1) * width

    def owned_ranges(self, shard: int) -> list[tuple[int, int]]:
        """Flat elements `[lo, hi)` that replica `shard` owns, in the order of its slice."""
        c = self.chunk_size
        return [(self.bucket_range(k)[0] + shard * c, self.bucket_range(k)[0] + (shard + 1) * c)
                for k in range(self.num_buckets)]

    def pieces(self, shard: int) -> list[Piece]:
        """The variables' parts inside `shard`'s slice, in slice order (offsets into the slice)."""
        out = []
        for k, (lo, hi) in enumerate(self.owned_ranges(shard)):
            out += [dataclasses.replace(p, offset=p.offset + k * self.chunk_size) for p in self.range_pieces(lo, hi)]
        return out

    def range_pieces(self, lo: int, hi: int) -> list[Piece]:
        """The variables' parts inside flat elements `[lo, hi)`; offsets count from `lo`."""
        out = []
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            start, stop = max(lo, offset), min(hi, offset + size)
            if start < stop:
                out.append(Piece(i, start - offset, stop - offset, start - lo))
        return out

    def to_slices_numpy(self, flat: np.ndarray) -> np.ndarray:
        """`[N * S]` flat (padded) vector -> `[N, S]`: row `r` is replica `r`'s slice."""
        k, n, c = self.num_buckets, self.num_shards, self.chunk_size
        return np.asarray(flat).reshape(k, n, c).transpose(1, 0, 2).reshape(n, k * c)

    def from_slices(self, slices):
        """Inverse of `to_slices_numpy`: replicas' slices, concatenated in replica order -> flat vector.

        Takes and returns a numpy array or a TensorFlow tensor alike.
        """
        k, n, c = self.num_buckets, self.num_shards, self.chunk_size
        if k == 1:
            return slices
        if isinstance(slices, np.ndarray):
            return slices.reshape(n, k, c).transpose(1, 0, 2).reshape(-1)
        return tf.reshape(tf.transpose(tf.reshape(slices, [n, k, c]), [1, 0, 2]), [-1])

    # Tensors ----------------------------------------------------------------
    def flatten_numpy(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        flat = np.zeros([self.shard_size * self.num_shards], np.float32)
        for a, offset, size in zip(arrays, self.offsets, self.sizes):
            flat[offset:offset + size] = np.asarray(a, np.float32).reshape(-1)
        return flat

    def unflatten_numpy(self, flat: np.ndarray) -> list[np.ndarray]:
        return [
            np.asarray(flat[offset:offset + size]).reshape(shape)
            for offset, size, shape in zip(self.offsets, self.sizes, self.shapes)
        ]

    def segment_ids(self, shard: int) -> tf.Tensor:
        """int32 `[S]`: the variable index of each element of `shard`'s slice.

        Padding elements get the index `len(shapes)` (one past the last).
        """
        ids, lengths = [], []
        position = 0
        for piece in self.pieces(shard):
            ids.append(piece.variable)
            lengths.append(piece.stop - piece.start)
            position += piece.stop - piece.start
        if position < self.shard_size:
            ids.append(len(self.shapes))
            lengths.append(self.shard_size - position)
        return tf.repeat(tf.constant(ids, tf.int32), tf.constant(lengths, tf.int32))

    def mask(self, shard: int, selected: Sequence[bool]) -> tf.Tensor | None:
        """float32 `[S]`: 1 where the element's variable is selected, else 0.

        Returns `None` when every variable in the slice is selected (no mask
        needed); padding counts as selected (its values stay zero).
        """
        pieces = self.pieces(shard)
        if all(selected[p.variable] for p in pieces):
            return None
        values, lengths = [], []
        position = 0
        for p in pieces:
            values.append(1.0 if selected[p.variable] else 0.0)
            lengths.append(p.stop - p.start)
            position += p.stop - p.start
        if position < self.shard_size:
            values.append(1.0)
            lengths.append(self.shard_size - position)
        return tf.repeat(tf.constant(values, tf.float32), tf.constant(lengths, tf.int32))


def gather_shard(layout: FlatLayout, tensors: Sequence, shard: int) -> tf.Tensor:
    """Replica `shard`'s slice of `tensors` flattened, concatenated and zero-padded.

    Only the pieces inside the slice are read, so a replica materialises `S`
    elements, not `P`. `None` entries count as zeros; sparse gradients
    (`tf.IndexedSlices`) are densified first.
    """
    parts = [gather_range(layout, tensors, lo, hi) for lo, hi in layout.owned_ranges(shard)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def gather_range(layout: FlatLayout, tensors: Sequence, lo: int, hi: int) -> tf.Tensor:
    """Elements `[lo, hi)` of `tensors` flattened, concatenated and zero-padded (float32).

    Only the pieces inside the range are read. `None` entries count as zeros;
    sparse gradients (`tf.IndexedSlices`) are densified first.
    """
    parts = []
    position = 0
    for p in layout.range_pieces(lo, hi):
        t = tensors[p.variable]
        size = p.stop - p.start
        if t is None:
            parts.append(tf.zeros([size], tf.float32))
        else:
            if isinstance(t, tf.IndexedSlices):
                t = tf.convert_to_tensor(t)
            flat = tf.reshape(t, [-1])
            parts.append(tf.cast(flat if size == flat.shape[0] else flat[p.start:p.stop], tf.float32))
        position = p.offset + size
    if position < hi - lo:
        parts.append(tf.zeros([hi - lo - position], tf.float32))
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def rows_in(g: tf.IndexedSlices, offset: int, rows: int) -> tf.IndexedSlices:
    """The rows of sparse `g` in `[offset, offset + rows)`, renumbered from `offset` (a part of a variable)."""
    indices = tf.cast(g.indices, tf.int64)
    keep = (indices >= offset) & (indices < offset + rows)
    shape = tf.concat([tf.constant([rows], tf.int64), tf.cast(g.dense_shape[1:], tf.int64)], 0)
    return tf.IndexedSlices(tf.boolean_mask(g.values, keep), tf.boolean_mask(indices, keep) - offset, shape)


def has_sparse(tensors: Sequence) -> bool:
    """Whether any of `tensors` is a sparse gradient (`tf.IndexedSlices`)."""
    return any(isinstance(t, tf.IndexedSlices) for t in tensors)


def dense_only(tensors: Sequence) -> list:
    """`tensors` with every sparse gradient replaced by `None` (zeros in a slice)."""
    return [None if isinstance(t, tf.IndexedSlices) else t for t in tensors]


def gather_shard_slices(layout: FlatLayout, dense_shard: tf.Tensor, tensors: Sequence, shard: int) -> tf.IndexedSlices:
    """Replica `shard`'s gradient slice with its sparse gradients kept sparse.

    Keras applies an optimizer's element-wise maths to a sparse gradient row
    by row, *before* summing duplicate rows: on one device, Adam's second
    moment of an embedding row looked up twice in a batch takes the sum of the
    two rows' squares, not the square of their sum. Densifying the gradient
    first (as a flat slice would) changes the update. So the slice is handed
    to the optimizer as `tf.IndexedSlices` over the flat `[S]` slice, one
    element per "row": every element of `dense_shard` (the dense gradients'
    part, zeros where a variable's gradient is sparse or absent) once, then
    every element of every occurrence of every sparse row that falls inside
    the slice. Summed, it is the densified slice; element-wise, it is what the
    optimizer saw on one device.

    Args:
        layout: the `FlatLayout`.
        dense_shard: float32 `[S]`: the slice of the dense gradients, with
            zeros in the elements of sparse gradients.
        tensors: the per-variable gradients; only `tf.IndexedSlices` entries
            are read (their `values` are `[n, *shape[1:]]`, `indices` rows of
            dimension 0).
        shard: the slice's replica.
    """
    values = [dense_shard]
    indices = [tf.range(layout.shard_size, dtype=tf.int64)]
    for p in layout.pieces(shard):
        t = tensors[p.variable]
        if not isinstance(t, tf.IndexedSlices):
            continue
        row = math.prod(layout.shapes[p.variable][1:])
        rows = tf.cast(t.indices, tf.int64)
        flat = rows[:, None] * row + tf.range(row, dtype=tf.int64)[None, :]
        inside = tf.logical_and(flat >= p.start, flat < p.stop)
        row_values = tf.reshape(tf.cast(t.values, tf.float32), [-1, row])
        values.append(tf.boolean_mask(row_values, inside))
        indices.append(tf.boolean_mask(flat, inside) - p.start + p.offset)
    return tf.IndexedSlices(
        tf.concat(values, axis=0),
        tf.concat(indices, axis=0),
        tf.constant([layout.shard_size], tf.int64),
    )

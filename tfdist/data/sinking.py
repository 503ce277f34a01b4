"""Data sinking in chunks: a host call's batches reach the devices together.

With `sink_size=k` a host call runs k steps in one `tf.while_loop`
(`tfdist.engine.loop`). Fed by a distributed iterator, each of those steps
still asks the input pipeline for its batch: on 2 logical CPU devices
TensorFlow's multi-device iterator costs about 0.4 ms per step, three times
the digits MLP's whole step (measured, issue 16). When every replica is in this
process, tfdist instead hands the loop a *chunk*: up to k batches stacked by
`tf.data` on the host (`batch` where every batch has one static shape, else
`padded_batch` with each batch's own shape kept beside it), fetched once.
The loop splits the chunk over the replicas once, exactly as `tf.distribute`
splits each batch (`replica_rows`), and each step gathers its batch from its
replica's part (`tfdist.engine.loop.run_chunks`).

A chunk holds at most `MAX_BATCHES_PER_CHUNK` batches and `SINK_CHUNK_BYTES`
of input, and its size divides a host call's steps (several chunks per call
under `sink_size="epoch"`), so no chunk spans two calls and a call consumes
exactly the batches it would have consumed batch by batch: training is the
same, step for step.

Used for Keras's `fit` and `evaluate` under tfdist strategies whose replicas
all live in this process on the host's CPU
(`TfdistStrategy.feeds_every_replica_locally`, `tfdist.keras_integration`),
on input whose elements are dense tensors; other input (ragged or sparse
tensors, datasets distributed with explicit `tf.distribute.InputOptions`) and
replicas on accelerators keep the distributed iterator.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import tensorflow as tf

# The most input bytes one chunk holds (per host call: further chunks follow
# in the same call when k batches are more than this).
SINK_CHUNK_BYTES = 64 * 2**20

# The most batches one chunk holds: the next chunk is assembled on the host
# while this one runs (measured on the digits MLP over 2 logical CPU devices,
# 2048 steps per epoch under sink_size="epoch": one 2048-batch chunk per call
# ran at 0.62x the on-device bound, chunks of 128 at 0.70-0.74x).
MAX_BATCHES_PER_CHUNK = 128

# Batches per chunk when a batch's size cannot be read from the element spec
# and the batch size (a dimension other than the batch is unknown).
UNSIZED_BATCHES_PER_CHUNK = 8


def chunkable(spec) -> bool:
    """Whether a dataset with element spec `spec` can be sunk in chunks: dense tensors with a batch dimension."""
    leaves = tf.nest.flatten(spec)
    return bool(leaves) and all(
        type(s) is tf.TensorSpec and s.shape.rank is not None and s.shape.rank >= 1 for s in leaves
    )


def batch_bytes(spec, batch_size: Optional[int]) -> Optional[int]:
    """Bytes of one batch of element spec `spec`, or None when a dimension is unknown."""
    total = 0
    for s in tf.nest.flatten(spec):
        dims = s.shape.as_list()
        if dims[0] is None:
            dims[0] = batch_size
        if any(d is None for d in dims) or s.dtype == tf.string:
            return None
        total += math.prod(dims) * s.dtype.size
    return total


def batches_per_chunk(spec, batch_size: Optional[int], steps_per_call: int) -> int:
    """Batches in one chunk: `steps_per_call`, fewer when that would exceed `SINK_CHUNK_BYTES`."""
    size = batch_bytes(spec, batch_size)
    if size is None:
        most = UNSIZED_BATCHES_PER_CHUNK
    else:
        most = min(MAX_BATCHES_PER_CHUNK, SINK_CHUNK_BYTES // max(size, 1))
    most = max(1, min(steps_per_call, most))
    # The largest divisor of the call within the limit: a call is a whole
    # number of chunks, so chunks never span two calls and no more than one
    # chunk's batches are ever held (1563 steps under sink_size="epoch" with
    # a 128-batch limit: chunks of 3).
    return max(d for d in range(1, most + 1) if steps_per_call % d == 0)


def fixed_shapes(spec) -> bool:
    """Whether every batch of element spec `spec` has one static shape (its chunks need no padding)."""
    return all(s.shape.is_fully_defined() for s in tf.nest.flatten(spec))


def chunk_dataset(dataset: tf.data.Dataset, chunk: int) -> tf.data.Dataset:
    """`dataset`'s batches in chunks of `chunk` (the last of an epoch may be shorter).

    Where every batch has one static shape (`fixed_shapes`: Keras's NumPy
    input when the rows divide into whole batches, `drop_remainder=True`),
    each element is the batch structure stacked over the chunk's batches
    (`batch`). Otherwise it is a flat tuple: every leaf of the batch structure
    stacked over the chunk's batches (padded to the largest), then every
    leaf's per-batch shape (`int32 [batches, rank]`), one `map` more per
    batch. `chunk` divides the steps of a host call (`batches_per_chunk`), so
    no chunk spans two calls.
    """
    if fixed_shapes(dataset.element_spec):
        return dataset.batch(chunk).prefetch(1)

    def with_shapes(*element):
        leaves = tf.nest.flatten(element)
        return tuple(leaves) + tuple(tf.shape(t, out_type=tf.int32) for t in leaves)

    shaped = dataset.map(with_shapes, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return shaped.padded_batch(chunk).prefetch(1)


def replica_rows(size, replica: int, num_replicas: int):
    """Rows `[lo, hi)` of a batch of `size` that `tf.distribute` gives `replica` of `num_replicas`.

    TensorFlow (verified on 2.16 to 2.21, `experimental_distribute_dataset` on
    one worker) splits a batch of `s` into `ceil(s / N)` rows per replica, in
    replica order, the last replicas taking what is left (possibly nothing):
    17 over 2 is 9 and 8, 5 over 4 is 2, 2, 1, 0
    (tests/engine/test_sinking.py checks this against TensorFlow).
    """
    per = (size + num_replicas - 1) // num_replicas
    lo = tf.minimum(per * replica, size)
    hi = tf.minimum(per * (replica + 1), size)
    return lo, hi


# Set by tfdist strategies on the distributed dataset they return: the dataset it was made from.
SOURCE_ATTR = "tfdist_source_dataset"


def remember_source(distributed, dataset):
    """Returns `distributed` (a `DistributedDataset`), marked as made from `dataset` (read by `source_of`)."""
    setattr(distributed, SOURCE_ATTR, dataset)
    return distributed


def source_of(distributed) -> Optional[tf.data.Dataset]:
    """The `tf.data.Dataset` a tfdist strategy distributed into `distributed`, or None."""
    return getattr(distributed, SOURCE_ATTR, None)


class SunkInput:
    """What Keras's epoch iterator iterates under chunked sinking: an iterator of chunks per epoch.

    Args:
        dataset: the `tf.data.Dataset` of global batches that Keras distributed.
        steps_per_call: int. Steps of one host call (`sink_size`, or an epoch's).
        chunk: int. Batches per chunk (`batches_per_chunk`).
    """

    def __init__(self, dataset: tf.data.Dataset, steps_per_call: int, chunk: int):
        self.spec = dataset.element_spec
        self.steps_per_call = steps_per_call
        self.chunk = chunk
        if steps_per_call % chunk:
            raise ValueError(
                f"A chunk of {chunk} batches does not divide a host call of {steps_per_call} steps: "
                "chunks would span calls. Use sinking.batches_per_chunk to choose it."
            )
        self.chunks = chunk_dataset(dataset, chunk)

    def __iter__(self) -> SunkIterator:
        return SunkIterator(iter(self.chunks), self.spec, self.steps_per_call, self.chunk)


class SunkIterator:
    """One pass over a `SunkInput`: `chunks` (a `tf.data` iterator), the batch structure `spec`,
    the steps of a host call, and whether they are one chunk (`one_chunk_per_call`)."""

    def __init__(self, chunks: Any, spec, steps_per_call: int, chunk: int):
        self.chunks = chunks
        self.spec = spec
        self.steps_per_call = steps_per_call
        self.one_chunk_per_call = chunk >= steps_per_call

    def __iter__(self) -> SunkIterator:
        return self

    def __next__(self):
        raise TypeError(
            "A tfdist SunkIterator feeds a tfdist host function chunks of batches "
            "(model.train_function / test_function under sink_size or steps_per_execution > 1); "
            "it does not yield single batches. Iterate the dataset itself for those."
        )

    def __repr__(self) -> str:
        return f"<tfdist SunkIterator of {self.spec}>"

"""Data sinking in windows: a host call's batches reach each replica's device together.

With `sink_size=k` a host call runs k steps in one `tf.while_loop`
(`tfdist.engine.loop`). Fed by a distributed iterator, each of those steps
still asks the input pipeline for its batch, and each batch crosses to each
replica's device on its own: on 2 logical CPU devices TensorFlow's
multi-device iterator costs about 0.4 ms per step, three times the digits
MLP's whole step (measured, issue 16); on 2 logical GPUs of an H200, sink 32
reached 0.46 of the on-device bound (issue 36). Where one input pipeline in
this process feeds every replica, tfdist instead hands the loop a *window*
per replica: up to k batches stacked by `tf.data` on the host (`batch` where
every batch has one static shape, else `padded_batch` with each batch's own
shape kept beside it, `chunk_dataset`), each batch split over the replicas
exactly as `tf.distribute` splits it (`replica_rows`, `split_chunk`), and
each replica's rows of the k batches staged on its device as one tensor per
input leaf (`replica_windows`, `SunkInput.distributed_windows`): one transfer
per window and replica, the next windows' transfers running while this
window's steps run (the `TransferManager`'s per-replica buffers,
`prefetch_depth` deep, 2 by default: double buffering). Each step then cuts
its batch out of its replica's window on the device with one gather per leaf
(`tfdist.engine.loop.run_chunks`).

A window holds at most `MAX_BATCHES_PER_CHUNK` batches and `SINK_CHUNK_BYTES`
of input, and its size divides a host call's steps (several windows per call
under `sink_size="epoch"`), so no window spans two calls and a call consumes
exactly the batches it would have consumed batch by batch: training is the
same, step for step.

Used for Keras's `fit` and `evaluate` under tfdist strategies whose replicas
all live in this process (`TfdistStrategy.feeds_every_replica_locally`,
`tfdist.keras_integration`), on input whose elements are dense tensors;
other input (ragged or sparse tensors, datasets distributed with explicit
`tf.distribute.InputOptions`) keeps the distributed iterator.
"""

from __future__ import annotations

import math
from typing import Optional

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


def split_chunk(values: list, shapes: list, leaves: list, replicas: int) -> list:
    """Each replica's rows of every batch of a chunk, as `tf.distribute` splits each batch.

    Args:
        values: the chunk's leaves, each `[batches, batch, ...]` (padded where
            batches differ, `chunk_dataset`).
        shapes: per leaf, the batches' own shapes (`int32 [batches, rank]`),
            or None where every batch has the leaf's static shape.
        leaves: the batch's `tf.TensorSpec`s, one per leaf.
        replicas: int, the replicas in sync.

    Returns `[replica][leaf] -> (rows, counts, shapes)`: `rows` is
    `[batches, width, ...]`, the replica's rows of each batch (`replica_rows`)
    padded to one width, the same for every replica; `counts` (`[batches]`)
    how many of them are real, or None where every batch has the leaf's
    static size, split evenly; `shapes` the batches' own shapes
    (`[batches, rank]`) where a dimension after the first is unknown (the
    chunk pads it to the longest), else None. Which of `counts` and `shapes`
    a leaf has depends on its spec alone (`window_layout`).
    """
    parts = [[] for _ in range(replicas)]
    for v, s, leaf in zip(values, shapes, leaves):
        batch = leaf.shape[0]
        inner = None if leaf.shape[1:].is_fully_defined() else s
        if batch is not None and batch % replicas == 0:
            width = batch // replicas
            for r in range(replicas):
                parts[r].append((v[:, r * width:(r + 1) * width], None, inner))
            continue
        sizes = tf.fill(tf.shape(v)[:1], batch) if s is None else s[:, 0]
        longest = tf.shape(v)[1]
        width = (longest + replicas - 1) // replicas
        offsets = tf.range(width)[tf.newaxis, :]
        for r in range(replicas):
            lo, hi = replica_rows(sizes, r, replicas)
            rows = tf.minimum(lo[:, tf.newaxis] + offsets, tf.maximum(longest - 1, 0))
            parts[r].append((tf.gather(v, rows, batch_dims=1), hi - lo, inner))
    return parts


def window_layout(spec, replicas: int) -> list[tuple[bool, bool]]:
    """Per leaf of batch spec `spec`: whether its window part has `counts` and `shapes` (`split_chunk`)."""
    layout = []
    for leaf in tf.nest.flatten(spec):
        batch = leaf.shape[0]
        layout.append((not (batch is not None and batch % replicas == 0), not leaf.shape[1:].is_fully_defined()))
    return layout


def unpack_chunk(chunk, spec) -> tuple[list, list]:
    """A chunk's `(values, shapes)`, one per leaf (`chunk_dataset`; shapes None when `fixed_shapes`)."""
    count = len(tf.nest.flatten(spec))
    if fixed_shapes(spec):
        return tf.nest.flatten(chunk), [None] * count
    chunk = tf.nest.flatten(chunk)
    return list(chunk[:count]), list(chunk[count:])


def replica_windows(chunks: tf.data.Dataset, spec, replicas: int) -> tf.data.Dataset:
    """`chunks` (`chunk_dataset`) split on the host into each replica's window.

    Each element is a tuple of `replicas` windows, one per replica, each a
    flat tuple (`unpack_window`): per leaf its rows, then its counts and its
    shapes where `window_layout` says it has them; where batches differ in
    shape (not `fixed_shapes`), then the batches' global sizes
    (`[batches]`). The split (`split_chunk`) runs in `tf.data`'s threads,
    ahead of the steps.
    """
    leaves = tf.nest.flatten(spec)
    fixed = fixed_shapes(spec)

    def split(*chunk):
        values, shapes = unpack_chunk(chunk if len(chunk) > 1 else chunk[0], spec)
        parts = split_chunk(values, shapes, leaves, replicas)
        windows = [[t for part in replica for t in part if t is not None] for replica in parts]
        if not fixed:
            windows = [w + [shapes[0][:, 0]] for w in windows]
        return tuple(tuple(w) for w in windows)

    return chunks.map(split, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(1)


def unpack_window(window, spec, replicas: int) -> tuple[list, object]:
    """One replica's window (`replica_windows`) as `([(rows, counts, shapes) per leaf], sizes or None)`."""
    flat = list(window)
    parts, i = [], 0
    for has_counts, has_shapes in window_layout(spec, replicas):
        rows = flat[i]
        i += 1
        counts = shapes = None
        if has_counts:
            counts, i = flat[i], i + 1
        if has_shapes:
            shapes, i = flat[i], i + 1
        parts.append((rows, counts, shapes))
    sizes = flat[i] if i < len(flat) else None
    return parts, sizes


class WindowStage:
    """Each replica's window of a host call on its device, the next call's copied while this one's steps run.

    The transfer manager of sinking: a host call takes its windows from
    buffers on the replicas' devices (one resource variable per window
    component and replica, of any shape), filled by the previous call, and
    then copies the next windows into them: one host-to-device transfer per
    window and replica, which overlaps the call's steps (nothing the steps
    read waits for it). A call with nothing staged (the first of a pass over
    the data, or after the last window) fetches its windows itself. The
    buffers hold the one staged window per replica; the window in use is
    the tensor read from them, which the copy of the next one does not
    overwrite (an assignment gives the variable a new buffer while a read
    still holds the old one). When the data ends they are emptied.

    Args:
        element_spec: the `replica_windows` dataset's element spec.
        devices: the replicas' devices, or None to leave windows on the host
            (the `transfer=False` step option): each call then fetches its own.

    Built eagerly (`build`, outside any trace); `restart` before a new pass.
    """

    def __init__(self, element_spec, devices):
        self.element_spec = element_spec
        self.devices = list(devices) if devices is not None else None
        self.ready = None
        self.buffers = None

    def build(self) -> None:
        """Creates the buffers and the `ready` flag (eagerly, once)."""
        if self.devices is None or self.ready is not None:
            return
        with tf.init_scope():
            self.ready = tf.Variable(False, trainable=False, name="window_staged")
            self.buffers = []
            for device, specs in zip(self.devices, self.element_spec):
                with tf.device(device):
                    self.buffers.append([
                        tf.Variable(tf.zeros([0] * s.shape.rank, s.dtype), shape=tf.TensorShape(None),
                                    trainable=False, name="staged_window")
                        for s in specs
                    ])

    def restart(self) -> None:
        """Eagerly: a new pass over the data starts; nothing of the last one stays staged."""
        if self.ready is not None:
            self.ready.assign(False)

    def _on_devices(self, element) -> list:
        """A fetched element's windows, each replica's copied to its device (a transfer per window)."""
        if self.devices is None:
            return [list(window) for window in element]
        copied = []
        for device, window in zip(self.devices, element):
            with tf.device(device):
                copied.append([tf.identity(t) for t in window])
        return copied

    def _shaped(self, flat: list) -> list:
        """`flat` (every replica's components in order) as per-replica lists with their static shapes."""
        out, i = [], 0
        for specs in self.element_spec:
            window = []
            for s in specs:
                t = flat[i]
                t.set_shape(s.shape)
                window.append(t)
                i += 1
            out.append(window)
        return out

    def take(self, iterator) -> list:
        """This call's windows: the staged ones, or fetched now (`OutOfRangeError` when there are none)."""
        if self.devices is None:
            return self._on_devices(iterator.get_next())

        def staged():
            return [v.read_value() for buffers in self.buffers for v in buffers]

        def fetched():
            return [t for window in self._on_devices(iterator.get_next()) for t in window]

        return self._shaped(tf.cond(self.ready, staged, fetched))

    def take_optional(self, iterator):
        """`(has windows, windows)`: as `take`, for calls that may find the data ended (several per call)."""
        if self.devices is None:
            optional = iterator.get_next_as_optional()
            zeros = [tf.zeros([0] * s.shape.rank, s.dtype) for specs in self.element_spec for s in specs]
            flat = tf.cond(optional.has_value(),
                           lambda: [t for window in optional.get_value() for t in window], lambda: zeros)
            return optional.has_value(), self._shaped(flat)

        def staged():
            return [tf.constant(True)] + [v.read_value() for buffers in self.buffers for v in buffers]

        def fetched():
            optional = iterator.get_next_as_optional()

            def value():
                return [tf.constant(True)] + [t for w in self._on_devices(optional.get_value()) for t in w]

            def nothing():
                zeros = []
                for device, specs in zip(self.devices, self.element_spec):
                    with tf.device(device):
                        zeros += [tf.zeros([0] * s.shape.rank, s.dtype) for s in specs]
                return [tf.constant(False)] + zeros

            return tf.cond(optional.has_value(), value, nothing)

        has, *flat = tf.cond(self.ready, staged, fetched)
        return has, self._shaped(flat)

    def stage_next(self, iterator) -> None:
        """Fetches the next windows, if any, and copies each to its replica's device buffers (no step waits)."""
        if self.devices is None:
            return
        optional = iterator.get_next_as_optional()

        def stage():
            copies = self._on_devices(optional.get_value())
            for buffers, window in zip(self.buffers, copies):
                for v, t in zip(buffers, window):
                    v.assign(t, read_value=False)
            return tf.constant(True)

        def empty():
            # The data ended: the buffers let go of the last window (the steps keep what they read).
            for device, buffers, specs in zip(self.devices, self.buffers, self.element_spec):
                with tf.device(device):
                    for v, s in zip(buffers, specs):
                        v.assign(tf.zeros([0] * s.shape.rank, s.dtype), read_value=False)
            return tf.constant(False)

        has = tf.cond(optional.has_value(), stage, empty)
        self.ready.assign(has, read_value=False)


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
    """What Keras's epoch iterator iterates under sinking: per pass, an iterator of windows.

    Args:
        dataset: the `tf.data.Dataset` of global batches that Keras distributed.
        steps_per_call: int. Steps of one host call (`sink_size`, or an epoch's).
        chunk: int. Batches per window (`batches_per_chunk`).
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
        self._windows: dict = {}  # {replicas: the `replica_windows` dataset}

    def windows(self, replicas: int) -> tf.data.Dataset:
        """The chunks split into `replicas` windows each (`replica_windows`), made once."""
        if replicas not in self._windows:
            self._windows[replicas] = replica_windows(self.chunks, self.spec, replicas)
        return self._windows[replicas]

    def __iter__(self) -> SunkIterator:
        return SunkIterator(self, self.spec, self.steps_per_call, self.chunk)


class SunkIterator:
    """One pass over a `SunkInput`: a host iterator of its windows (made at first use), the batch
    structure `spec`, the steps of a host call, and whether they are one window (`one_chunk_per_call`)."""

    def __init__(self, source: SunkInput, spec, steps_per_call: int, chunk: int):
        self.source = source
        self.spec = spec
        self.steps_per_call = steps_per_call
        self.one_chunk_per_call = chunk >= steps_per_call
        self._host = None

    def windows(self, replicas: int):
        """`(iterator, new)`: this pass's `tf.data` iterator of windows, and whether it was just made."""
        if self._host is None:
            self._host = iter(self.source.windows(replicas))
            return self._host, True
        return self._host, False

    def __iter__(self) -> SunkIterator:
        return self

    def __next__(self):
        raise TypeError(
            "A tfdist SunkIterator feeds a tfdist host function windows of batches "
            "(model.train_function / test_function under sink_size or steps_per_execution > 1); "
            "it does not yield single batches. Iterate the dataset itself for those."
        )

    def __repr__(self) -> str:
        return f"<tfdist SunkIterator of {self.spec}>"

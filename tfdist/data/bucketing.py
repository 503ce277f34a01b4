"""Length bucketing with static shapes: `bucket_by_length`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfdist._compat import tf as tfc

TOO_LONG_POLICIES = ("drop", "error")


def _default_length(*element) -> tf.Tensor:
    first = tf.nest.flatten(element)[0]
    return tf.shape(first, out_type=tf.int64)[0]


def _check_boundaries(boundaries: Any) -> tuple[int, ...]:
    fix = "Pass strictly increasing positive integers, e.g. boundaries=[16, 32, 64, 128]."
    if isinstance(boundaries, (str, bytes)) or not hasattr(boundaries, "__len__"):
        raise ValueError(
            f"Argument 'boundaries' must be a list of sequence lengths. Received: "
            f"boundaries={boundaries!r}. {fix}"
        )
    values = list(boundaries)
    if not values or not all(
        isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1 for b in values
    ):
        raise ValueError(
            f"Argument 'boundaries' must hold positive integers. Received: "
            f"boundaries={values!r}. {fix}"
        )
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise ValueError(
                f"Argument 'boundaries' must be strictly increasing; {values[i]} follows "
                f"{values[i - 1]} at index {i}. Received: boundaries={values!r}. {fix}"
            )
    return tuple(int(b) for b in values)


def _check_global_batch(global_batch_size: Any, num_replicas: int) -> int:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)) or global_batch_size < 1:
        raise ValueError(
            "Argument 'global_batch_size' must be a positive integer. "
            f"Received: global_batch_size={global_batch_size!r}"
        )
    if global_batch_size % num_replicas:
        lower = global_batch_size // num_replicas * num_replicas
        upper = lower + num_replicas
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"Argument 'global_batch_size' must divide evenly across the {num_replicas} "
            "replicas, so that every replica in a step gets a batch of the same static "
            f"shape. Received: global_batch_size={global_batch_size}. Use a multiple of "
            f"{num_replicas}, e.g. {hint}."
        )
    return int(global_batch_size)


# tf.data transformations that put a batch axis in front of every component,
# by the method that adds them. Class names are TensorFlow's private ones
# (tensorflow/python/data/ops/*), read by `_batched_by` only.
_BATCHING = {
    "_BatchDataset": "batch",
    "_ParallelBatchDataset": "batch",
    "_PaddedBatchDataset": "padded_batch",
    "_RebatchDataset": "rebatch",
    "_MapAndBatchDataset": "map_and_batch",
    "_DenseToSparseBatchDataset": "dense_to_sparse_batch",
}
# Elements below these are not this dataset's elements (a function makes
# them): nothing can be said, so nothing is claimed.
_OPAQUE = ("_FlatMapDataset", "_InterleaveDataset", "_ParallelInterleaveDataset", "_WindowDataset", "_ScanDataset")


def _ranks(dataset: tf.data.Dataset) -> list | None:
    ranks = [getattr(getattr(s, "shape", None), "rank", None) for s in tf.nest.flatten(dataset.element_spec)]
    return None if None in ranks else sorted(ranks)


def _batched_by(dataset: tf.data.Dataset) -> str | None:
    """The transformation that batched `dataset` (e.g. `"batch"`), or `None` if its elements are single examples.

    Walks the pipeline upwards (`tfdist._compat.tf.dataset_inputs`) until a batching transformation
    (batched, unless the element ranks changed after it) or an `unbatch` or a
    function-made source (not batched, as far as can be told). Element specs
    alone cannot tell a batch axis from a sequence axis: `([None], [None])`
    is a batch of (tokens, label) pairs or one example of (ids, mask).
    """
    top = _ranks(dataset)
    todo, seen = [dataset], 0
    while todo and seen < 1000:
        current = todo.pop()
        seen += 1
        name = type(current).__name__
        if name == "_UnbatchDataset" or name in _OPAQUE:
            continue
        inputs = tfc.dataset_inputs(current)
        if name in _BATCHING or name == "_GroupByWindowDataset":
            # A map after the batch may have changed what an element is; only
            # claim a batch when the element ranks are still the batch's.
            if top is not None and _ranks(current) == top:
                if name in _BATCHING:
                    return _BATCHING[name]
                # group_by_window batches when its reduce_func does: then every
                # component gained one leading axis over its input's.
                if len(inputs) == 1 and _ranks(inputs[0]) is not None and [r + 1 for r in _ranks(inputs[0])] == top:
                    return "group_by_window"
            continue
        todo.extend(inputs)
    return None


def quantile_boundaries(lengths: Sequence[int], num_buckets: int) -> tuple[int, ...]:
    """Boundaries at the `1/num_buckets` quantiles of `lengths`; the last is their maximum.

    Args:
        lengths: sequence lengths from a sample of the data.
        num_buckets: int >= 1. Buckets wanted (fewer are returned when
            quantiles coincide).

    Example:

    ```python
    quantile_boundaries([3, 5, 8, 9, 20], 2)  # (8, 20)
    ```
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0:
        raise ValueError(
            "Cannot choose boundaries from an empty sample of lengths: the dataset "
            "has no elements. Pass boundaries=[...] explicitly or a non-empty dataset."
        )
    qs = np.arange(1, num_buckets + 1) / num_buckets
    edges = np.ceil(np.quantile(lengths, qs, method="higher")).astype(np.int64)
    edges[-1] = lengths.max()
    return tuple(int(b) for b in np.unique(np.maximum(edges, 1)))


def min_padding_boundaries(lengths: Sequence[int], num_buckets: int) -> tuple[int, ...]:
    """The `num_buckets` boundaries that minimise the padded positions of `lengths`.

    Each example is padded to the first boundary at or above its length; the
    boundaries are chosen (by dynamic programming over the distinct lengths)
    so that the total padded length, the compute a model spends, is smallest.
    On long-tailed lengths this pads far less than quantiles, whose last
    bucket spans the whole tail.

    Args:
        lengths: sequence lengths from a sample of the data.
        num_buckets: int >= 1. Buckets wanted (fewer when there are fewer
            distinct lengths).

    Example:

    ```python
    min_padding_boundaries([3, 3, 3, 4, 20], 2)  # (4, 20)
    ```
    """
    values, counts = np.unique(np.asarray(lengths, np.int64), return_counts=True)
    if values.size == 0:
        raise ValueError(
            "Cannot choose boundaries from an empty sample of lengths: the dataset "
            "has no elements. Pass boundaries=[...] explicitly or a non-empty dataset."
        )
    n = values.size
    k = min(num_buckets, n)
    below = np.concatenate([[0], np.cumsum(counts)])
    # cost[b, j]: least padded positions for the j shortest distinct lengths in b buckets.
    cost = np.full((k + 1, n + 1), np.inf)
    cost[0, 0] = 0.0
    start = np.zeros((k + 1, n + 1), np.int64)
    for b in range(1, k + 1):
        for j in range(1, n + 1):
            i = np.arange(j)
            total = cost[b - 1, i] + values[j - 1] * (below[j] - below[i])
            start[b, j] = int(np.argmin(total))
            cost[b, j] = total[start[b, j]]
    b = int(np.argmin(cost[:, n]))
    edges, j = [], n
    while j > 0:
        edges.append(int(values[j - 1]))
        j = int(start[b, j])
        b -= 1
    return tuple(sorted(edges))


def bucket_by_length(
    dataset: tf.data.Dataset,
    length_fn: Callable[..., tf.Tensor] | None = None,
    boundaries: Sequence[int] | None = None,
    global_batch_size: int = 32,
    pad_values: Any = None,
    drop_remainder: bool = True,
    num_replicas: int | None = None,
    num_buckets: int = 4,
    sample_size: int = 1000,
    too_long: str = "drop",
    boundary_method: str = "quantiles",
) -> tf.data.Dataset:
    """Batches variable-length examples by length bucket, padding each batch to its bucket's edge.

    Every example whose length is in `(boundaries[i-1], boundaries[i]]` goes
    to bucket `i`; a batch holds examples of one bucket only and its sequence
    axis (axis 0 of every component of unknown length) is padded to exactly
    `boundaries[i]`. So each bucket has one static shape (one XLA program per
    bucket, not one per length) and little compute goes to padding. Global
    batches hold `global_batch_size` examples, a multiple of the replica count,
    so a strategy splits each into equal per-replica batches of the same
    bucket, as synchronous collectives and XLA need.

    Args:
        dataset: `tf.data.Dataset` of unbatched examples (a tensor, tuple or
            dict per example).
        length_fn: Optional callable taking an example (its components as
            arguments, as `Dataset.map` passes them) and returning its length
            as a scalar integer tensor. Default: the size of axis 0 of the
            example's first component (in `tf.nest` order).
        boundaries: Optional strictly increasing positive integers, the padded
            length of each bucket. Default: chosen from the lengths of the
            first `sample_size` examples by `boundary_method`, the last being
            the longest sampled example.
        global_batch_size: int. Examples per global batch (over all
            replicas); must be a multiple of `num_replicas`. Default 32.
        pad_values: Optional padding value: a scalar, used for every padded
            component, or a structure matching an example. Default 0 (`""`
            for strings).
        drop_remainder: bool. Drop each bucket's last batch when it is short
            (default `True`: every batch full, one shape per bucket). `False`
            keeps it, which adds a shape (an XLA program) per bucket.
        num_replicas: Optional int. Replicas the global batch is split over.
            Default: `num_replicas_in_sync` of the current strategy scope (1
            outside any).
        num_buckets: int. Buckets to aim for when `boundaries` is `None`.
            Default 4.
        sample_size: int. Examples read to choose `boundaries` when `None`.
            Default 1000.
        too_long: `"drop"` (default) or `"error"`. What happens to an example
            longer than the last boundary: dropped and counted in the returned
            dataset's `dropped` variable, or a `tf.errors.InvalidArgumentError`
            naming its length.
        boundary_method: `"quantiles"` (default: the `1/num_buckets`
            quantiles of the sampled lengths) or `"min_padding"` (the
            boundaries that pad the sample least, `min_padding_boundaries`;
            much less padding on long-tailed lengths). Used when `boundaries`
            is `None`.

    Returns:
        A batched `tf.data.Dataset`. It also carries `boundaries` (tuple of
        int) and `dropped` (an int64 `tf.Variable`, the examples dropped so
        far as too long) as attributes; later transformations do not keep them.

    Raises:
        ValueError: bad `boundaries`, `global_batch_size`, `too_long`,
            `num_buckets` or `sample_size`, or a `dataset` that is already
            batched; the message names the value and the fix.

    Example:

    ```python
    tokens = tf.data.Dataset.from_generator(...)  # (int32 [length], label)
    train = tfdist.data.bucket_by_length(
        tokens, boundaries=[16, 32, 64], global_batch_size=64)
    model.fit(train, epochs=3)
    ```
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            "Argument 'dataset' must be a tf.data.Dataset of unbatched examples. "
            f"Received: dataset of type {type(dataset).__name__}"
        )
    batched_by = _batched_by(dataset)
    if batched_by is not None:
        raise ValueError(
            "bucket_by_length needs a dataset of single examples, and this one is already batched "
            f"(by .{batched_by}(...) in its pipeline): axis 0 of each element is the batch, which would "
            "be read as the sequence length and padded with rows of zeros as if they were examples. "
            "Apply bucket_by_length before .batch(...) (it batches to global_batch_size itself), or "
            f"call .unbatch() first. Received: element_spec={dataset.element_spec}"
        )
    if too_long not in TOO_LONG_POLICIES:
        raise ValueError(
            f"Argument 'too_long' must be 'drop' or 'error'. Received: too_long={too_long!r}"
        )
    if num_replicas is None:
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
    global_batch_size = _check_global_batch(global_batch_size, num_replicas)
    if length_fn is None:
        first = tf.nest.flatten(dataset.element_spec)[0]
        if getattr(first, "shape", None) is not None and first.shape.rank == 0:
            raise ValueError(
                "bucket_by_length reads an example's length from axis 0 of its first component in "
                "tf.nest order (a dict's keys sorted), and that component is a scalar here. Pass "
                "length_fn=, e.g. length_fn=lambda example: tf.shape(example['tokens'])[0]. "
                f"Received: element_spec={dataset.element_spec}"
            )
    length_fn = length_fn or _default_length

    def length_of(*element):
        return tf.cast(length_fn(*element), tf.int64)

    if boundaries is None:
        for name, value in (("num_buckets", num_buckets), ("sample_size", sample_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Argument '{name}' must be a positive integer. Received: {name}={value!r}"
                )
        if boundary_method not in BOUNDARY_METHODS:
            raise ValueError(
                "Argument 'boundary_method' must be 'quantiles' or 'min_padding'. "
                f"Received: boundary_method={boundary_method!r}"
            )
        sample = list(dataset.take(sample_size).map(length_of).as_numpy_iterator())
        boundaries = BOUNDARY_METHODS[boundary_method](sample, num_buckets)
    else:
        boundaries = _check_boundaries(boundaries)
    edges = tf.constant(boundaries, tf.int64)
    longest = boundaries[-1]
    dropped = tf.Variable(0, dtype=tf.int64, trainable=False, name="bucket_by_length_dropped")

    if too_long == "drop":

        def fits(*element):
            ok = length_of(*element) <= longest
            with tf.control_dependencies([dropped.assign_add(tf.cast(tf.logical_not(ok), tf.int64))]):
                return tf.identity(ok)

        dataset = dataset.filter(fits)
    else:

        def check(*element):
            length = length_of(*element)
            assertion = tf.debugging.Assert(
                length <= longest,
                [
                    f"bucket_by_length: an example is longer than the last boundary "
                    f"({longest}). Pass longer boundaries, or too_long=drop to skip such "
                    "examples. Its length:",
                    length,
                ],
            )
            with tf.control_dependencies([assertion]):
                return tf.nest.map_structure(tf.identity, element if len(element) > 1 else element[0])

        dataset = dataset.map(check)

    spec = dataset.element_spec

    def padded_shapes(edge):
        def one(component_spec):
            shape = component_spec.shape
            if shape.rank is None:
                raise ValueError(
                    "bucket_by_length needs every component's rank to be known. "
                    f"Received: a component with spec {component_spec}"
                )
            dims = [-1 if d is None else d for d in shape.as_list()]
            if shape.rank >= 1 and shape[0] is None:
                return tf.concat([tf.reshape(edge, [1]), tf.constant(dims[1:], tf.int64)], 0)
            return tf.constant(dims, tf.int64)

        return tf.nest.map_structure(one, spec)

    if pad_values is None:
        padding = None
    elif tf.nest.is_nested(pad_values):
        padding = pad_values
    else:
        padding = tf.nest.map_structure(
            lambda s: tf.constant(pad_values, s.dtype)
            if s.dtype == tf.string
            else tf.cast(pad_values, s.dtype),
            spec,
        )

    def key_of(*element):
        # Index of the first boundary >= length.
        return tf.searchsorted(
            edges, tf.reshape(length_of(*element), [1]), side="left", out_type=tf.int64
        )[0]

    def batch_bucket(key, window):
        return window.padded_batch(
            global_batch_size,
            padded_shapes=padded_shapes(tf.gather(edges, key)),
            padding_values=padding,
            drop_remainder=drop_remainder,
        )

    batched = dataset.group_by_window(key_of, batch_bucket, window_size=global_batch_size)
    batched.boundaries = boundaries
    batched.dropped = dropped
    return batched


BOUNDARY_METHODS = {"quantiles": quantile_boundaries, "min_padding": min_padding_boundaries}

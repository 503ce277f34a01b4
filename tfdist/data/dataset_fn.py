"""A typed dataset function for per-worker and per-replica input: `DatasetFn`."""

from __future__ import annotations

from typing import Callable, Union

import tensorflow as tf


class DatasetFn:
    """A function building a dataset for one input pipeline, given a `tf.distribute.InputContext`.

    Strategies that build input on each worker (parameter server,
    `distribute_datasets_from_function`) call it once per input pipeline with
    the context that says which pipeline it is and how to size batches. A plain
    callable works wherever a `DatasetFn` does: `DatasetFn.wrap` turns it into
    one.

    Args:
        fn: callable `(tf.distribute.InputContext) -> tf.data.Dataset`.

    Example:

    ```python
    def make(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(64))

    fn = tfdist.data.DatasetFn(make)
    dist = strategy.distribute_datasets_from_function(fn)
    ```
    """

    def __init__(self, fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]):
        if not callable(fn):
            raise TypeError(
                "Argument 'fn' must be a callable taking a tf.distribute.InputContext and "
                f"returning a tf.data.Dataset. Received: fn of type {type(fn).__name__}"
            )
        self.fn = fn

    @classmethod
    def wrap(cls, fn: Union[DatasetFn, Callable[[tf.distribute.InputContext], tf.data.Dataset]]) -> DatasetFn:
        """Returns `fn` if it is a `DatasetFn`, else a `DatasetFn` around the callable."""
        return fn if isinstance(fn, DatasetFn) else cls(fn)

    def __call__(self, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        """Builds the dataset of one input pipeline (default context: the only pipeline)."""
        dataset = self.fn(input_context if input_context is not None else tf.distribute.InputContext())
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"The dataset function {getattr(self.fn, '__name__', self.fn)!r} must return a "
                f"tf.data.Dataset. Received: a {type(dataset).__name__}"
            )
        return dataset

    def __repr__(self) -> str:
        return f"DatasetFn({getattr(self.fn, '__name__', self.fn)!r})"

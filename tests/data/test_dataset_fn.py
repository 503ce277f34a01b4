"""DatasetFn: a typed dataset function taking a tf.distribute.InputContext (issue 8)."""

from __future__ import annotations

import pytest
import tensorflow as tf

import tfdist
from tests.strategies.parity import strategy_for


def make(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    ds = tf.data.Dataset.range(16).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.batch(ctx.get_per_replica_batch_size(8))


def test_plain_callable_and_dataset_fn_build_the_same_input():
    wrapped = tfdist.data.DatasetFn.wrap(make)
    assert isinstance(wrapped, tfdist.data.DatasetFn)
    assert tfdist.data.DatasetFn.wrap(wrapped) is wrapped
    ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    assert [b.tolist() for b in wrapped(ctx).as_numpy_iterator()] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert [b.tolist() for b in wrapped().as_numpy_iterator()] == [list(range(8)), list(range(8, 16))]


def test_strategy_distributes_datasets_from_a_dataset_fn():
    strategy = strategy_for("mirrored", 2)
    dist = strategy.distribute_datasets_from_function(tfdist.data.DatasetFn(make))
    first = next(iter(dist))
    # One input pipeline on this worker, per-replica batches of 8 / 2, one per replica in turn.
    assert [v.numpy().tolist() for v in strategy.experimental_local_results(first)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_not_callable_is_a_type_error():
    with pytest.raises(TypeError) as info:
        tfdist.data.DatasetFn(tf.data.Dataset.range(3))
    assert str(info.value).startswith(
        "Argument 'fn' must be a callable taking a tf.distribute.InputContext and returning a tf.data.Dataset. "
        "Received: fn of type "
    )


def test_function_not_returning_a_dataset_is_a_type_error():
    def bad(ctx):
        return [1, 2, 3]

    with pytest.raises(TypeError) as info:
        tfdist.data.DatasetFn(bad)()
    assert str(info.value) == "The dataset function 'bad' must return a tf.data.Dataset. Received: a list"

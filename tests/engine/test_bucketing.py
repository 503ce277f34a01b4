"""Gradient bucketing (tensor fusion) in tfdist.collectives and the step engine."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.engine.common import make_strategy, max_relative_difference, op_counts, tiny_model
from tfdist import collectives
from tfdist.collectives import BucketPlan
from tfdist.engine.step import TrainStep


def test_bucket_plan_fills_reverse_order_per_dtype_within_bucket_bytes():
    grads = [
        tf.zeros([10]),  # 40 B
        tf.zeros([20]),  # 80 B
        tf.zeros([5], tf.float16),
        tf.zeros([30]),  # 120 B
        tf.zeros([3]),  # 12 B
        None,
    ]
    plan = BucketPlan.build(grads, bucket_bytes=128)
    assert [(b.dtype, b.indices) for b in plan.buckets] == [
        (tf.float32, (4,)),
        (tf.float32, (3,)),
        (tf.float16, (2,)),
        (tf.float32, (1, 0)),
    ]
    assert plan.num_collectives == 4
    values = [tf.range(10.0), tf.range(20.0), tf.ones([5], tf.float16), tf.range(30.0), tf.range(3.0), None]
    unpacked = plan.unpack(plan.pack(values))
    assert unpacked[5] is None
    for a, b in zip(values[:5], unpacked[:5]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert BucketPlan.build(grads, bucket_bytes=0).num_collectives == 5


def _traced_step(name, bucket_bytes, x, y):
    strategy = make_strategy(name, bucket_bytes=bucket_bytes)
    with strategy.scope():
        model = tiny_model(hidden=16)
        model.optimizer.build(model.trainable_variables)
    step = TrainStep(model)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32))))
    return op_counts(tf.function(step).get_concrete_function(batch).graph)


# The tiny model's values, last first: weight 4 B, bias 40 B, kernel 640 B,
# bias 64 B (748 B in one 1024-B bucket), kernel 4096 B (a bucket of its own).
@pytest.mark.parametrize("bucket_bytes,buckets", [(1024, 2), (0, 5), (25 << 20, 1)])
@pytest.mark.parametrize("name,collective,per_step", [
    ("mirrored", "CollectiveReduceV2", 4),  # one per bucket per replica
    ("central_storage", "AddN", 1),  # one sum per bucket on the parameter device
])
def test_collectives_per_step_equal_number_of_buckets(name, collective, per_step, bucket_bytes, buckets, digits):
    x, y = digits
    counts = _traced_step(name, bucket_bytes, x[:32], y[:32])
    assert counts[collective] == per_step * buckets


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_bucketed_training_equals_unbucketed(name, digits):
    # The same sums; only a ring all-reduce may split a fused buffer into
    # chunks differently, which reorders float32 additions (last-bit changes).
    x, y = digits
    weights = []
    for bucket_bytes in (0, 1024):
        with make_strategy(name, bucket_bytes=bucket_bytes).scope():
            model = tiny_model()
        model.fit(x[:128], y[:128], batch_size=32, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_gradient_of_unknown_static_shape_is_sent_unfused_in_its_own_bucket():
    plans = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([4])], autograph=False)
    def round_trip(unknown, known):
        plans.append(BucketPlan.build([unknown, known], bucket_bytes=1024))
        return plans[0].unpack(plans[0].pack([unknown, known]))

    a, b = np.arange(6.0, dtype=np.float32).reshape(2, 3), np.arange(4.0, dtype=np.float32)
    out = round_trip(a, b)
    assert [(b.indices, b.fused) for b in plans[0].buckets] == [((0,), False), ((1,), True)]
    np.testing.assert_array_equal(out[0].numpy(), a)
    np.testing.assert_array_equal(out[1].numpy(), b)


def _dense_on_sequences():
    # A Dense kernel applied to a 3-D input: the tape returns its gradient with
    # static shape (None, units) although the kernel's shape is known.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((10, 8)), keras.layers.Dense(16), keras.layers.Dense(3),
        keras.layers.GlobalAveragePooling1D(),
    ])
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("bucket_bytes", [0, 1024, 25 << 20])
@pytest.mark.parametrize("name", ["mirrored", "central_storage", "sharded_optimizer"])
def test_dense_on_3d_input_trains_with_single_device_parity(name, bucket_bytes):
    rng = np.random.RandomState(0)
    x, y = rng.rand(64, 10, 8).astype("float32"), rng.randint(0, 3, 64)
    reference = _dense_on_sequences()
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    with make_strategy(name, replicas=2, bucket_bytes=bucket_bytes).scope():
        model = _dense_on_sequences()
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert max_relative_difference(reference, model) < 1e-5


class AddPositions(keras.layers.Layer):
    """A learned position embedding looked up once per batch, as in the keras-io Transformer."""

    def build(self, shape):
        self.positions = keras.layers.Embedding(shape[1], shape[2])

    def call(self, x):
        return x + self.positions(keras.ops.arange(x.shape[1]))


def _positions_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4, 3)), AddPositions(), keras.layers.Flatten(), keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_rows_from_constant_indices_are_shared_by_replicas_and_token_rows_are_not():
    table = keras.layers.Embedding(10, 3)
    table.build()
    found = {}

    @tf.function
    def gradients(tokens):
        with tf.GradientTape(persistent=True) as tape:
            by_token = tf.reduce_sum(table(tokens))
            by_position = tf.reduce_sum(table(keras.ops.arange(4)))
        found["tokens"] = collectives.rows_shared_by_replicas(tape.gradient(by_token, table.embeddings))
        found["positions"] = collectives.rows_shared_by_replicas(tape.gradient(by_position, table.embeddings))
        return by_token

    gradients(tf.constant([[1, 2, 2]]))
    assert found == {"tokens": False, "positions": True}


@pytest.mark.parametrize("name,options", [
    ("mirrored", {}), ("central_storage", {}), ("sharded_optimizer", {"stage": 2}), ("mirrored", {"sink_size": 2}),
])
def test_position_embedding_under_adam_matches_one_device(name, options):
    # One device sees each position's row once, summed over the batch; each
    # replica has the same rows for its share. Concatenated (as stock
    # tf.distribute.MirroredStrategy does), Adam squares the replicas' pieces
    # apart (0.20 relative on the zoo Transformer); tfdist sums them first.
    rng = np.random.RandomState(0)
    x, y = rng.normal(size=(32, 4, 3)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    reference = _positions_model()
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    with make_strategy(name, replicas=2, **options).scope():
        model = _positions_model()
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert max_relative_difference(reference, model) < 1e-5


def _ancestors(op, control: bool) -> set:
    """Every op `op` waits for: its data inputs' producers, recursively (and control inputs if `control`)."""
    seen, stack = set(), [t.op for t in op.inputs] + (list(op.control_inputs) if control else [])
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        if control:
            stack.extend(current.control_inputs)
    return seen


def test_each_buckets_collective_waits_only_for_its_own_and_earlier_sent_gradients(digits):
    # Overlap (issue 18): buckets are sent last layer first, the order backprop
    # produces gradients, so a bucket's all-reduce can start while earlier
    # layers' gradients are still being computed. TensorFlow chains one
    # device's collectives in launch order (an ordering token) and launches a
    # call's dense values reversed, so without tfdist.collectives handing them
    # over reversed, the first kernel's bucket went first and every collective
    # waited for the whole backward pass. One variable per bucket
    # (bucket_bytes=0); each gradient op is told apart by its shape: a
    # kernel's is the backward MatMul (transpose_a), a bias's a BiasAddGrad.
    x, y = digits
    strategy = make_strategy("mirrored", replicas=2, bucket_bytes=0)
    with strategy.scope():
        model = tiny_model(hidden=16)
        model.optimizer.build(model.trainable_variables)
    step = TrainStep(model)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(32))))
    ops = tf.function(step).get_concrete_function(batch).graph.get_operations()

    def is_gradient(op):
        return (op.type == "MatMul" and op.get_attr("transpose_a")) or op.type == "BiasAddGrad"

    gradients = [op for op in ops if is_gradient(op)]
    assert sorted(tuple(op.outputs[0].shape) for op in gradients) == sorted(
        [(64, 16), (16,), (16, 10), (10,)] * 2
    )
    # Flat bucket size → the gradient shape it carries (the batch weight: none), in send order.
    carries = {1: [], 10: [(10,)], 160: [(16, 10)], 16: [(16,)], 1024: [(64, 16)]}
    for device in ("CPU:0", "CPU:1"):
        collectives = [op for op in ops if op.type == "CollectiveReduceV2" and op.device.endswith(device)]
        mine = [op for op in gradients if op.device.endswith(device)]
        sizes = [c.inputs[0].shape.num_elements() for c in collectives]
        assert sizes == [1, 10, 160, 16, 1024]  # created, chained and launched in this order
        for k, (collective, size) in enumerate(zip(collectives, sizes)):
            data = [tuple(op.outputs[0].shape) for op in mine if op in _ancestors(collective, control=False)]
            waits = [tuple(op.outputs[0].shape) for op in mine if op in _ancestors(collective, control=True)]
            assert data == carries[size], (device, size)  # no global op between gradients and buckets
            sent_so_far = sorted(s for earlier in sizes[: k + 1] for s in carries[earlier])
            assert sorted(waits) == sent_so_far, (device, size)  # nothing backprop makes later

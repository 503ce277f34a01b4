"""A custom training loop written as Keras's and TensorFlow's guides write one.

Shared by the in-process parity tests and the multi-worker job
(`multi_worker_job.py --custom-loop`), which compare it with the same loop on
one device: `train(tf.distribute.get_strategy(), ...)`. Imports nothing from
the tests package, so the job's script can import it from its own directory.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 32
ROWS = 128  # 4 steps per epoch


# Every fix of tfdist's optimizer.apply in a custom loop at once, with
# `clipped_loss_scaled_adam`: an optimizer built in the step, a
# LossScaleOptimizer whose scale grows and halves, global_clipnorm, a position
# embedding (the multi-worker job's case).
EVERY_FIX = {"build_first": False, "position": True, "overflow_row": 72}


def clipped_loss_scaled_adam():
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.05, global_clipnorm=0.5), initial_scale=1024.0, dynamic_growth_steps=2
    )


class PositionEmbedding(keras.layers.Layer):
    """A learned position embedding looked up once per batch (`ops.arange`), as in the keras-io Transformer."""

    def __init__(self, length: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.embedding = keras.layers.Embedding(length, width)

    def call(self, x):
        return x + self.embedding(keras.ops.arange(self.length))


def train(strategy, optimizer_fn, build_first: bool = True, position: bool = False, overflow_row=None,
          epochs: int = 1):
    """Trains a token model (Embedding, optional position embedding, Dense) with a custom loop.

    Args:
        strategy: the strategy (`tf.distribute.get_strategy()`: one device).
        optimizer_fn: returns the optimizer, built in the strategy's scope.
        build_first: call `optimizer.build` before the loop; else it builds
            at its first `apply`, inside the traced step.
        position: add a position embedding (a sparse gradient whose rows are
            the same on every replica).
        overflow_row: a row whose prediction is multiplied by 1e20, making
            its step's gradient infinite (a loss-scaled step is then skipped).
        epochs: passes over the 128 rows, 4 steps each.

    Returns:
        (model, optimizer, loss scale after each step or [] without a
        `LossScaleOptimizer`).
    """
    rng = np.random.RandomState(1)
    tokens = rng.randint(0, 20, (ROWS, 6)).astype("int32")
    targets = (tokens[:, :1] / 10.0 - 1.0).astype("float32")
    boost = np.zeros((ROWS, 1), "float32")
    if overflow_row is not None:
        boost[overflow_row] = 1e20
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(20, 4)(inputs)
        if position:
            hidden = PositionEmbedding(6, 4)(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(hidden)))
        optimizer = optimizer_fn()
        if build_first:
            optimizer.build(model.trainable_variables)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def replica_fn(x, y, b):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_sum(tf.square(model(x, training=True) * (1.0 + b) - y), axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            if scaled:
                loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    step = tf.function(lambda x, y, b: strategy.run(replica_fn, args=(x, y, b)))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    batches = tf.data.Dataset.from_tensor_slices((tokens, targets, boost)).batch(GLOBAL_BATCH).with_options(options)
    scales = []
    for _ in range(epochs):
        for x, y, b in strategy.experimental_distribute_dataset(batches):
            step(x, y, b)
            if scaled:
                scales.append(float(optimizer.dynamic_scale.numpy()))
    return model, optimizer, scales

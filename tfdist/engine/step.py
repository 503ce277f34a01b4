"""One synchronous training step, the same for every synchronous strategy.

A step has three phases, each a small function with explicit inputs:

1. `local_gradients` (replica context): forward and backward pass on the
   replica's share of the global batch. Gradients are weighted by the
   replica's batch size, so that the sum over replicas divided by the global
   batch size is exactly the single-device gradient, even when the global
   batch does not split evenly (the last batch of an epoch).
2. reduction and update: the strategy's gradient path (`tfdist.engine.paths`)
   sums gradients and weights across replicas in fused buffers
   (`tfdist.collectives`) — all-reduce, reduce to the variables' device, or a
   path a strategy registers — calls `finish` and applies the update.
3. `finish`: divide by the global batch size, undo a static loss scale, clip
   (so `global_clipnorm` sees the whole gradient).
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import keras_integration as ki


def _first_batch_dim(x) -> tf.Tensor:
    flat = [t for t in tf.nest.flatten(x) if t is not None]
    return tf.shape(flat[0])[0]


def _scale(g, factor):
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.math.multiply_no_nan(g.values, tf.cast(factor, g.values.dtype)),
            g.indices,
            g.dense_shape,
        )
    return tf.math.multiply_no_nan(g, tf.cast(factor, g.dtype))


def _divide(g, denominator):
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.math.divide_no_nan(g.values, tf.cast(denominator, g.values.dtype)),
            g.indices,
            g.dense_shape,
        )
    return tf.math.divide_no_nan(g, tf.cast(denominator, g.dtype))


class TrainStep:
    """The engine's training step for one compiled model under a tfdist strategy.

    Args:
        model: a Keras model built and compiled in a tfdist strategy's scope.

    Call it in cross-replica context (inside the host-call loop) with one
    distributed batch.
    """

    def __init__(self, model):
        self.model = model
        self.strategy = model.distribute_strategy
        self.options = self.strategy.options
        self.optimizer = model.optimizer

    # Phase 1 ---------------------------------------------------------------
    def local_gradients(self, data) -> list:
        """Replica context: `[weighted grads..., batch size]` for this replica."""
        model, optimizer = self.model, self.optimizer
        x, y, sample_weight = ki.unpack_data(data)
        batch = _first_batch_dim(x)
        with tf.GradientTape() as tape:
            y_pred = ki.call_model(model, x, training=True)
            loss = ki.compute_loss(model, x, y, y_pred, sample_weight, training=True)
            ki.track_loss(model, loss, batch)
            loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        # Keras divided the loss by the replica count; undo that and weight by
        # this replica's batch size instead (exact for uneven splits).
        weight = tf.cast(batch, tf.float32)
        factor = weight * float(self.strategy.num_replicas_in_sync)
        return [_scale(g, factor) for g in grads] + [weight]

    # Phase 3 ---------------------------------------------------------------
    def finish(self, summed: list) -> list:
        """Turns summed weighted gradients into the gradient to apply."""
        grads, total = summed[:-1], summed[-1]
        grads = [_divide(g, total) for g in grads]
        if self.optimizer.loss_scale_factor is not None:
            grads = [_divide(g, self.optimizer.loss_scale_factor) for g in grads]
        return ki.clip_gradients(self.optimizer, grads)

    # Phase 2 and the update: the strategy's gradient path ---------------------
    def __call__(self, data) -> None:
        from tfdist.engine.paths import get_gradient_path

        with self.strategy.scope():
            get_gradient_path(self.strategy.gradient_path)(self, data)

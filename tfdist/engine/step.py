"""One synchronous training step, the same for every synchronous strategy.

A step has four phases, each a small function with explicit inputs:

1. `local_gradients` (replica context): forward and backward pass on the
   replica's share of the global batch (compiled with XLA when asked; any
   collective in the forward pass, such as synchronized BatchNorm's, stays
   outside XLA). Gradients are weighted by the replica's batch size, so that
   the sum over replicas divided by the global batch size is exactly the
   single-device gradient, even when the global batch does not split evenly.
   With accumulation, the replica's accumulated micro-batches are added here.
2. reduction: the strategy's gradient path (`tfdist.engine.paths`) sums
   gradients and weights across replicas in fused buffers
   (`tfdist.collectives`) — all-reduce, reduce to the variables' device, or a
   path a strategy registers.
3. `finish`: the reduced chain of `tfdist.engine.transforms`: divide by the
   global batch size, undo the loss scale, clip (so `global_clipnorm` sees
   the whole gradient).
4. `apply`: the optimizer update, gated by dynamic loss scaling (skipped on
   every replica when any replica saw inf or nan).

With accumulation, every micro-step runs phase 1 and adds to per-replica
accumulators; a conditional in cross-replica context runs phases 2–4 only on
the last micro-step of each window (`__call__`).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine import transforms as T
from tfdist.engine import update


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


def with_variable_shapes(grads: list, variables) -> list:
    """`grads`, each dense gradient with its variable's static shape.

    The tape can lose a gradient's static shape although its variable's is
    known: a `Dense` kernel applied to a 3-D input gets `(None, units)` from
    the reshape in its matmul's gradient. The collectives (fused buffers),
    accumulators and sharded layouts need the static shape, which the
    variable always has.
    """
    out = []
    for g, v in zip(grads, variables):
        if g is not None and not isinstance(g, tf.IndexedSlices) and not g.shape.is_fully_defined():
            g = tf.ensure_shape(g, v.shape)
        out.append(g)
    return out


def accumulation_steps(model) -> int:
    """Micro-batches per optimizer step: the `accumulation_steps` option or Keras's own."""
    option = model.distribute_strategy.options.accumulation_steps
    keras_steps = kc.keras_accumulation_steps(model.optimizer)
    return keras_steps or option


def uses_xla(model) -> bool:
    """`jit_compile=True` as a step option or in `model.compile`."""
    return bool(model.distribute_strategy.options.jit_compile or model.jit_compile is True)


class TrainStep:
    """The engine's training step for one compiled model under a tfdist strategy.

    Args:
        model: a Keras model built and compiled in a tfdist strategy's scope.

    Call it in cross-replica context (inside the host-call loop) with one
    distributed batch. Built eagerly (it creates the accumulators).
    """

    def __init__(self, model):
        self.model = model
        self.strategy = model.distribute_strategy
        self.options = self.strategy.options
        self.optimizer = model.optimizer
        self.jit_compile = uses_xla(model)
        # The optimizer whose update rule runs: a LossScaleOptimizer's inner one.
        self.update_optimizer = kc.inner_optimizer(self.optimizer)
        self.loss_scale = T.dynamic_loss_scale(self.optimizer)
        self.reduced = T.compose(
            T.normalize_by_weight(),
            T.unscale_static(self.update_optimizer),
            self.loss_scale,
            T.clip_by_optimizer(self.update_optimizer),
        )
        # Keras's float8 scales and amax histories: their "gradient" is their
        # next value (`overwrite_with_gradient`); see `overwrite_from_replicas`.
        self.overwritten = [
            i
            for i, v in enumerate(model.trainable_variables)
            if kc.overwrites_with_gradient(self.update_optimizer, v)
        ]
        k = accumulation_steps(model)
        self.accumulation: T.Accumulate | None = None
        with self.strategy.scope():
            if k > 1:
                keras_counter = (
                    kc.iterations_variable(self.update_optimizer)
                    if kc.keras_accumulation_steps(self.optimizer)
                    else None
                )
                self.accumulation = T.Accumulate(k, model.trainable_variables, keras_counter)
            self.reduced.build()
            if self.accumulation is not None:
                self.accumulation.build()

    # Phase 1 ---------------------------------------------------------------
    def _forward_backward(self, x, y, sample_weight):
        model = self.model
        with tf.GradientTape() as tape:
            y_pred = kc.call_model(model, x, training=True)
            loss = kc.compute_loss(model, x, y, y_pred, sample_weight, training=True)
            scaled = self.loss_scale.scale_loss(loss) if self.loss_scale else loss
            if self.update_optimizer.loss_scale_factor is not None:
                scaled = scaled * self.update_optimizer.loss_scale_factor
        grads = tape.gradient(scaled, model.trainable_variables)
        return y_pred, loss, with_variable_shapes(grads, model.trainable_variables)

    def compute_gradients(self, data) -> list:
        """Replica context: `[weighted grads..., batch size]` of this micro-batch."""
        x, y, sample_weight = kc.unpack_data(data)
        batch = _first_batch_dim(x)
        if self.jit_compile:
            with tfc.xla_compiled_ops():
                y_pred, loss, grads = self._forward_backward(x, y, sample_weight)
        else:
            y_pred, loss, grads = self._forward_backward(x, y, sample_weight)
        kc.track_loss(self.model, loss, batch)
        self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        grads = self.overwrite_from_replicas(grads)
        if self.strategy.num_replicas_in_sync == 1 and self.accumulation is None:
            # One replica, one batch: its gradient is the step's; weight 1
            # tells the chain there is nothing to normalise.
            return list(grads) + [tf.constant(1.0)]
        # Keras divided the loss by the replica count; undo that and weight by
        # this replica's batch size instead (exact for uneven splits).
        weight = tf.cast(batch, tf.float32)
        factor = weight * float(self.strategy.num_replicas_in_sync)
        return [_scale(g, factor) for g in grads] + [weight]

    def overwrite_from_replicas(self, grads: list) -> list:
        """Replica context: writes the `overwrite_with_gradient` variables; `grads` without them.

        A float8 `Dense`'s amax history takes the largest magnitude its
        input (or output gradient) had this step: on one device over the
        whole batch, here over each replica's share, so the replicas' values
        are combined with MAX (the scale is computed from the previous
        history, the same on every replica) and written to every copy of the
        variable, as Keras's `apply` overwrites it on one device. They leave
        the summed gradients (None in their place), so bucketing, weighting,
        clipping and the optimizer never see them. Runs on every micro-step
        under accumulation, as in Keras.
        """
        if not self.overwritten:
            return grads
        ctx = tf.distribute.get_replica_context()
        values = [tf.convert_to_tensor(grads[i]) for i in self.overwritten]
        # tf.distribute reduces by SUM or MEAN only: gather all replicas' values
        # in one buffer and take the largest.
        flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in values], axis=0)
        gathered = ctx.all_gather(flat[tf.newaxis], axis=0)
        pieces = tf.split(tf.reduce_max(gathered, axis=0), [v.shape.num_elements() for v in values])
        largest = [tf.reshape(p, v.shape) for p, v in zip(pieces, values)]
        variables = [self.model.trainable_variables[i] for i in self.overwritten]

        def write(strategy, *new):
            for v, value in zip(variables, new):
                first = strategy.experimental_local_results(value)[0]
                strategy.extended.update(
                    kc.tf_variable(v), lambda var, t: var.assign(tf.cast(t, var.dtype)), args=(first,), group=False
                )

        ctx.merge_call(write, args=tuple(largest))
        return [None if i in self.overwritten else g for i, g in enumerate(grads)]

    def local_gradients(self, data) -> list:
        """Replica context: `[weighted grads..., weight]` ready to reduce.

        With accumulation, every micro-step has already added its gradients to
        the replica's accumulators (`__call__`), and this runs on the last
        micro-step of a window: it releases (and resets) the accumulated sum,
        without computing anything on `data` again.
        """
        if self.accumulation is not None:
            return self.accumulation.update()
        return self.compute_gradients(data)

    # Phase 3 ---------------------------------------------------------------
    def finish(self, summed: list) -> list:
        """Turns summed `[weighted grads..., weight]` into the gradient to apply."""
        return self.reduced.update(list(summed))

    # Phase 4 ---------------------------------------------------------------
    def apply(self, grads: list, update_fn: Callable[[list], None] | None = None) -> None:
        """Cross-replica context: applies `grads`, or skips the step on inf/nan under loss scaling.

        Args:
            grads: the finished gradients (per-replica values or tensors).
            update_fn: Optional callable `(grads) -> None` performing the
                update; default: the optimizer's update of the trainable
                variables (`tfdist.engine.update.apply_update`). A gradient path
                that updates differently (e.g. per shard) passes its own and
                still gets loss-scale gating.
        """
        if update_fn is None:

            def update_fn(g):
                update.apply_update(
                    self.update_optimizer, g, self.model.trainable_variables, update.EveryCopy(self.strategy)
                )

        if self.loss_scale is None:
            update_fn(grads)
        else:
            self.loss_scale.gate(grads, update_fn)

    # The whole step --------------------------------------------------------
    def __call__(self, data) -> None:
        from tfdist.engine.paths import get_gradient_path

        path = get_gradient_path(self.strategy.gradient_path)
        with self.strategy.scope():
            if self.accumulation is None:
                path(self, data)
                return

            # The forward and backward pass runs (and is traced, and compiled)
            # once, outside the conditional; only the last micro-step of a
            # window then reduces and updates.
            added = self.strategy.run(
                lambda batch: self.accumulation.add(self.compute_gradients(batch)), args=(data,)
            )
            with tf.control_dependencies(self.strategy.experimental_local_results(added)):
                self.accumulation.run(lambda: path(self, data))

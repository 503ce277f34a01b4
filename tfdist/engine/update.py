"""The optimizer update once the gradients are final: Keras's `Optimizer.apply` order, written once.

Every strategy updates in the same order as Keras's `BaseOptimizer.apply` and
`_backend_apply_gradients` (Keras 3.15), after the step engine has reduced,
normalised, unscaled and clipped the gradients (and gated the step on inf/nan
under loss scaling):

1. `overwrite_with_gradient` variables (Keras's float8 scales and amax
   histories) take their gradient as their value and leave the update;
2. the optimizer's once-per-step state advances (Nadam's `u_product`, which
   Keras advances in `Nadam._backend_update_step`);
3. decoupled weight decay (the optimizer's rate, Muon's per-variable rate,
   `exclude_from_weight_decay`);
4. the optimizer's own `update_step` on each variable;
5. constraints;
6. EMA of the weights, and its periodic overwrite (`use_ema`,
   `ema_overwrite_frequency`);
7. the iteration count.

A `MultiOptimizer` runs this for each sub-optimizer on its variables, then
counts its own iteration, as Keras's `MultiOptimizer.apply` does.

What varies by strategy is only *where each update runs* — a `Placement`:

* `EveryCopy`: through `strategy.extended.update`, in cross-replica context:
  on every replica's copy (mirrored, multi_worker; the gradients are
  per-replica values), or once on the variable's device (central_storage).
  The sharded optimizer uses it on the flat slice variable, whose copy on
  replica `r` holds slice `r`.
* `InPlace`: on the variable where it lives, from the calling context
  (parameter server: a worker writes the variables on the ps tasks, without
  synchronisation).

Example:

```python
update.apply_update(optimizer, grads, model.trainable_variables, update.EveryCopy(strategy))
```
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from tfdist._compat import keras as kc


class Placement:
    """Where one variable's update runs: `run(variable, fn, *args)` calls `fn(v, *args)` there."""

    def run(self, variable, fn: Callable, *args) -> None:
        raise NotImplementedError


class EveryCopy(Placement):
    """Every copy of a distributed variable, via `strategy.extended.update` (cross-replica context).

    Args:
        strategy: the `tf.distribute.Strategy` owning the variables. Per-replica
            arguments are matched to each copy by TensorFlow.
    """

    def __init__(self, strategy):
        self.strategy = strategy

    def run(self, variable, fn: Callable, *args) -> None:
        self.strategy.extended.update(kc.tf_variable(variable), fn, args=args, group=False)


class InPlace(Placement):
    """The variable where it lives, written from the calling context (no synchronisation)."""

    def run(self, variable, fn: Callable, *args) -> None:
        fn(kc.tf_variable(variable), *args)


def apply_update(
    optimizer,
    grads: Sequence,
    variables: Sequence,
    placement: Placement,
    decay_mask: Callable | None = None,
    constrain: bool = True,
    count: bool = True,
) -> None:
    """Applies final gradients to `variables` with `optimizer`, in Keras's order.

    Args:
        optimizer: a built Keras optimizer (not a `LossScaleOptimizer`: the
            engine unscales and gates; pass its inner optimizer).
        grads: one gradient (or `None`) per variable; per-replica values or
            tensors, as `placement` expects.
        variables: the variables, in the order of `grads`.
        placement: where each update runs (`EveryCopy`, `InPlace`).
        decay_mask: Optional callable `() -> mask or None`, called where the
            update runs: weight decay applies to every element of every
            variable, scaled by the mask (the sharded optimizer's flat slice,
            whose elements belong to several model variables). Default: Keras's
            per-variable `exclude_from_weight_decay` rule.
        constrain: whether to apply the variables' constraints here (the
            sharded optimizer applies them to the whole gathered variables).
        count: whether to advance the iteration count here (the sharded
            optimizer advances it after its all-gather).
    """
    if kc.is_multi_optimizer(optimizer):
        for sub_optimizer, indices in kc.multi_optimizer_groups(optimizer, variables):
            apply_update(
                sub_optimizer,
                [grads[i] for i in indices],
                [variables[i] for i in indices],
                placement,
                decay_mask=decay_mask,
                constrain=constrain,
                count=True,
            )
        if count:
            kc.iterations_variable(optimizer).assign_add(1)
        return

    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if pairs:
        updates = []
        for g, v in pairs:
            if kc.overwrites_with_gradient(optimizer, v):
                placement.run(v, _overwrite, g)
            else:
                updates.append((g, v))
        with kc.optimizer_name_scope(optimizer):
            if updates:
                _update(optimizer, updates, placement, decay_mask, constrain)
    if count:
        kc.iterations_variable(optimizer).assign_add(1)


def _overwrite(v, g):
    return v.assign(tf.cast(g, v.dtype))


def _update(optimizer, pairs, placement, decay_mask, constrain) -> None:
    learning_rate = optimizer.learning_rate
    kc.advance_per_step_state(optimizer)

    for _, v in pairs:
        rate = kc.weight_decay_rate(optimizer, v, masked=decay_mask is not None)
        if rate is None:
            continue

        def decay(x, rate=rate):
            lr = tf.cast(learning_rate, x.dtype)
            wd = tf.cast(rate, x.dtype)
            step = x * wd * lr
            mask = decay_mask() if decay_mask is not None else None
            return x.assign_sub(step if mask is None else step * mask)

        placement.run(v, decay)

    for g, v in pairs:
        placement.run(v, lambda x, grad: optimizer.update_step(grad, x, learning_rate), g)

    if constrain:
        for _, v in pairs:
            if v.constraint is not None:
                placement.run(v, lambda x, c=v.constraint: x.assign(c(tf.convert_to_tensor(x))))

    if optimizer.use_ema:
        iterations = optimizer.iterations
        averages = kc.ema_averages(optimizer)
        momentum = tf.cast(tf.not_equal(iterations, 0), tf.float32) * optimizer.ema_momentum
        overwrite = None
        if optimizer.ema_overwrite_frequency:
            overwrite = tf.equal((iterations + 1) % optimizer.ema_overwrite_frequency, 0)
        for var, average in zip(kc.optimizer_trainable_variables(optimizer), averages):
            if average is None:
                continue

            def ema(avg, value):
                m = tf.cast(momentum, avg.dtype)
                return avg.assign(m * avg + (1.0 - m) * tf.convert_to_tensor(value))

            placement.run(average, ema, kc.tf_variable(var))
            if overwrite is not None:

                def maybe_overwrite(x, avg):
                    return x.assign(tf.where(overwrite, tf.convert_to_tensor(avg), tf.convert_to_tensor(x)))

                placement.run(var, maybe_overwrite, kc.tf_variable(average))

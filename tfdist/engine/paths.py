"""Gradient paths: how summed gradients reach the variables, one function each.

A strategy names its path in `gradient_path`; a path is a function
`(step, data) -> None` that runs in cross-replica context, inside the
strategy's scope, and performs phase 2 (reduction) and the update of one
training step (see `tfdist.engine.step`). Strategies with a path of their own
(e.g. the sharded optimizer's reduce-scatter) register it here with
`register_gradient_path` from their own module.

A path gets every step feature by using the step's phases rather than
re-implementing them: `step.local_gradients(batch)` in replica context
(forward/backward, XLA, accumulated micro-batches), `step.finish(summed)` on
the summed `[grads..., weight]` (normalise, unscale, clip), and
`step.apply(grads, update_fn=None)` in cross-replica context (the update,
skipped on inf/nan under loss scaling). Accumulation wraps the whole path: it
only runs on the last micro-step of each window.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tfdist import collectives

GradientPath = Callable[["object", object], None]
_PATHS: dict[str, GradientPath] = {}


def register_gradient_path(name: str, fn: GradientPath) -> GradientPath:
    _PATHS[name] = fn
    return fn


def get_gradient_path(name: str) -> GradientPath:
    if name not in _PATHS:
        raise ValueError(f"Unknown gradient path {name!r}. Registered: {sorted(_PATHS)}")
    return _PATHS[name]


def all_reduce(step, data) -> None:
    """Every replica sums all replicas' gradients, then every copy is updated alike."""

    def replica_fn(batch):
        summed = collectives.all_reduce_sum(step.local_gradients(batch), step.options.bucket_bytes)
        return step.finish(summed)

    grads = step.strategy.run(replica_fn, args=(data,))
    step.apply(grads)


def reduce_to_variables(step, data) -> None:
    """Gradients are summed onto the parameter device; each variable is updated once."""
    plans = []

    def replica_fn(batch):
        values = step.local_gradients(batch)
        plan = collectives.BucketPlan.build(values, step.options.bucket_bytes)
        plans.append(plan)
        return plan.pack(values)

    packed = step.strategy.run(replica_fn, args=(data,))
    destination = step.strategy.parameter_device
    summed = collectives.reduce_to_device(step.strategy, packed, plans[0], destination)
    with tf.device(destination):
        grads = step.finish(summed)
    step.apply(grads)


register_gradient_path("all_reduce", all_reduce)
register_gradient_path("reduce_to_variables", reduce_to_variables)

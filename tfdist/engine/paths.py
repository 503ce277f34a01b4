"""Gradient paths: how summed gradients reach the variables, and where updates run.

A strategy carries its path as an object, `TfdistStrategy.gradient_path`: a
`GradientPath` whose `run(step, data)` runs in cross-replica context, inside
the strategy's scope, and performs phase 2 (reduction) and the update of one
training step (see `tfdist.engine.step`), and whose `placement(strategy)` says
where one variable's update runs (`tfdist.engine.update.Placement`). The
built-in paths are defined here; a strategy with a path of its own (the
sharded optimizer's, the parameter server's) defines its `GradientPath` in its
own module. Nothing is registered, and no path is looked up by name.

A path gets every step feature by using the step's phases rather than
re-implementing them: `step.local_gradients(batch)` in replica context
(forward/backward, XLA, accumulated micro-batches), `step.finish(summed)` on
the summed `[grads..., weight]` (normalise, unscale, clip), and
`step.apply(grads, update_fn=None)` in cross-replica context (the update,
skipped on inf/nan under loss scaling). Accumulation wraps the whole path: it
only runs on the last micro-step of each window.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from tfdist import collectives
from tfdist.engine import update


@dataclasses.dataclass(frozen=True)
class GradientPath:
    """How one strategy's step reduces gradients and where its updates run.

    Args:
        name: str, for messages and `repr` only.
        run: callable `(step, data) -> None`, in cross-replica context:
            reduction and update of one step (phases 2 to 4).
        placement: callable `(strategy) -> update.Placement`: where the
            update of one variable runs (`TrainStep.apply`'s default update).
        local_with_one_replica: bool. With one replica, the reduction is the
            identity and the update may run in the replica's own function, so
            under XLA the whole step compiles as one program
            (`TrainStep.__call__`). Default False.
        variables_on_replicas: bool. Each replica's device holds a copy of
            every variable, so a replica's forward and backward pass compiles
            as one XLA program (which cannot read a variable on another
            device). Default True.
    """

    name: str
    run: Callable[[Any, Any], None]
    placement: Callable[[Any], update.Placement] = update.EveryCopy
    local_with_one_replica: bool = False
    variables_on_replicas: bool = True

    def __call__(self, step, data) -> None:
        self.run(step, data)


def all_reduce(step, data) -> None:
    """Every replica sums all replicas' gradients, then every copy is updated alike."""

    def replica_fn(batch):
        summed = collectives.all_reduce_sum(
            step.local_gradients(batch), step.options.bucket_bytes, step.options.allreduce_dtype
        )
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


ALL_REDUCE = GradientPath("all_reduce", all_reduce, local_with_one_replica=True)
REDUCE_TO_VARIABLES = GradientPath("reduce_to_variables", reduce_to_variables, variables_on_replicas=False)

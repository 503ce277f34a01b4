"""How one replica's forward and backward pass runs: one object per kind, chosen once per step.

A step's pass depends on the strategy's gradient path, the step options, the
optimizer and the model, all known when the step is assembled. `choose`
decides once, in one place, and the step calls the chosen object on every
replica (`TrainStep.compute_gradients`):

* `Plain`: the pass as Keras writes it, under a `tf.GradientTape`;
* `WholeStepXla`: the same, stateless, inside the one XLA program of a whole
  step with one replica (its layers' state written with the update);
* `MarkedXla`: the same ops, each marked for XLA, so TensorFlow compiles
  clusters of them and leaves collectives outside (synchronized BatchNorm,
  Embedding models, central_storage on several devices);
* `CompiledPerReplica`: one XLA program per replica, the layers' state
  updates written after it;
* `GatheredWhole`: variables held in parts (the sharded optimizer's stage 3),
  gathered whole before the pass (compiled, marked or plain);
* `GatheredByLayer`: the same, each top-level layer gathering its own
  variables for its forward and again for its backward (`tfdist.engine.gather`);
* `ReducedByLayer`: each group of layers' gradients handed to the gradient
  path's reducer as its backward pass ends (the sharded optimizer's stages 1
  and 2 on one host).

Each returns `(y_pred, loss, grads, weight)`: `weight` is the replica's
weight its loss chose (`TrainStep._loss_weight`), or None for its rows.
"""

from __future__ import annotations

import contextlib

from tfdist._compat import tf as tfc
from tfdist.engine import gather


class ForwardBackward:
    """One kind of replica pass: `pass_(step, x, y, sample_weight, on_loss, share, reducer)`."""

    # The whole step (forward, backward, finish, update) is one XLA program (one replica).
    compiles_whole_step = False
    # Each group of layers' gradients goes to the gradient path's reducer as its backward ends.
    reduces_by_layer = False

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class Plain(ForwardBackward):
    """The pass as Keras writes it, under one `tf.GradientTape`."""

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        return step.run_tape(x, y, sample_weight, on_loss)


class WholeStepXla(ForwardBackward):
    """The pass inside the one XLA program that is the whole step (one replica, as Keras's `jit_compile`).

    Stateless: the layers' state updates (BatchNorm's moving statistics, whose
    MEAN aggregation would all-reduce, a collective inside the program; seeds)
    are recorded, not written, and left in `step.whole_step_updates` for
    `TrainStep._replica_whole_step` to write with the optimizer's update, in
    cross-replica context (on a GPU TensorFlow runs this program in the
    replica's thread, where a `merge_call` fails: docs/gpu.md).
    """

    compiles_whole_step = True

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        y_pred, loss, grads, updates, weight = step.stateless_forward_backward(x, y, sample_weight, on_loss)
        step.whole_step_updates = updates
        return y_pred, loss, grads, weight


class MarkedXla(ForwardBackward):
    """The pass's ops each marked for XLA: compiled by clusters, collectives left outside."""

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        with tfc.xla_compiled_ops():
            return step.run_tape(x, y, sample_weight, on_loss)


class CompiledPerReplica(ForwardBackward):
    """One XLA program per replica; the layers' state updates recorded inside and written after."""

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        y_pred, loss, grads, updates, weight = step.replica_program()(share, x, y, sample_weight, on_loss)
        # Written here, in replica context, where a mirrored variable's assignment may
        # synchronise (a `merge_call` cannot run inside a nested function).
        step.assign_updates(updates)
        return y_pred, loss, grads, weight


class GatheredWhole(ForwardBackward):
    """Variables held in parts, gathered whole on the replica's device before the pass.

    Args:
        compiled: the pass is one XLA program per replica, the gathered values its inputs.
        marked: the pass's ops are marked for XLA (under `jit_compile` where it cannot be one program).
    """

    def __init__(self, compiled: bool, marked: bool):
        self.compiled = compiled
        self.marked = marked

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        context = tfc.xla_compiled_ops() if self.marked and not self.compiled else contextlib.nullcontext()
        return step.run_gathered(x, y, sample_weight, on_loss, share, compiled=self.compiled,
                                               context=context)

    def __repr__(self) -> str:
        return f"GatheredWhole(compiled={self.compiled}, marked={self.marked})"


class GatheredByLayer(ForwardBackward):
    """Variables held in parts, each top-level layer gathering its own for its forward and its backward.

    Args:
        plan: the `gather.LayerGathers` of the model.
        marked: the pass's ops are marked for XLA.
    """

    def __init__(self, plan: gather.LayerGathers, marked: bool):
        self.plan = plan
        self.marked = marked

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        context = tfc.xla_compiled_ops() if self.marked else contextlib.nullcontext()
        return step.run_gathered_by_layer(x, y, sample_weight, on_loss, self.plan, context)


class ReducedByLayer(ForwardBackward):
    """Each group of layers' weight gradients handed to the gradient path's `reducer` as its backward ends.

    Args:
        plan: the `gather.LayerReductions` of the model.
    """

    reduces_by_layer = True

    def __init__(self, plan: gather.LayerReductions):
        self.plan = plan

    def __call__(self, step, x, y, sample_weight, on_loss, share, reducer=None) -> tuple:
        if reducer is None:
            return step.run_tape(x, y, sample_weight, on_loss)
        return step.run_reducing(x, y, sample_weight, on_loss, self.plan, reducer)


def choose(step, model, custom_gradients: bool, synchronized_layers: bool, embeddings: bool) -> ForwardBackward:
    """The kind of pass `step` runs on every replica, decided once.

    Args:
        step: the `TrainStep` being assembled (its strategy, options,
            optimizer, accumulation, loss scale and variables are set).
        model: the Keras model (None for a step built from parts).
        custom_gradients: the step computes gradients its own way (a subclass's `compute_gradients`).
        synchronized_layers: the model has a synchronized BatchNorm (a collective in its forward pass).
        embeddings: the model has a trainable Embedding (sparse rows, read from the graph).
    """
    path = step.strategy.gradient_path
    replicas = step.strategy.num_replicas_in_sync
    jit = step.jit_compile
    # One replica under XLA: forward, backward, finish and update as one compiled
    # program per step, as Keras's `jit_compile=True` does.
    if (jit and replicas == 1 and step.accumulation is None and path.local_with_one_replica
            and not step.overwritten and not synchronized_layers):
        return WholeStepXla()
    # Several replicas under XLA: each replica's pass one compiled program, where every
    # variable is on the replica's device (a copy, or gathered whole first) and no
    # collective or sparse-row decision sits inside it.
    compiled = jit and (path.variables_on_replicas or path.gathers_parameters) and not (
        synchronized_layers or embeddings)
    if path.gathers_parameters:
        plan = gather.LayerGathers.plan(model, step.variables)
        if plan is not None and not compiled:
            return GatheredByLayer(plan, marked=jit)
        return GatheredWhole(compiled=compiled, marked=jit)
    if (path.reduces_by_layer and not custom_gradients and step.accumulation is None and step.loss_scale is None
            and step.update_optimizer.loss_scale_factor is None and not jit and not step.overwritten
            and step.options.allreduce_dtype == "float32" and replicas > 1):
        # Stages 1 and 2 on one host, in a plain `fit` step.
        plan = gather.LayerReductions.plan(model, step.variables, step.options.bucket_bytes)
        if plan is not None:
            return ReducedByLayer(plan)
    if compiled:
        return CompiledPerReplica()
    if jit:
        return MarkedXla()
    return Plain()

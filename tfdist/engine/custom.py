"""A custom `train_step` through the engine's phases 2–4.

A model that overrides `train_step` runs it as written, per replica, as Keras
does. What the engine adds sits behind the one call every such step makes:
`self.optimizer.apply(gradients, variables)` (or `apply_gradients`). While
the host function is traced, `CustomTrainStep` stands in for the model's
optimizer's `apply`; in replica context it takes the replica's gradients as
phase 1's output and runs the strategy's gradient path on them (phase 2:
bucketed reduction; phase 3: normalise, unscale, clip the *summed* gradient,
as one device would; phase 4: the update through `tfdist.engine.update`,
gated under dynamic loss scaling). So a custom step gets the step options a
built-in step gets:

* `accumulation_steps=k` (or Keras's `Optimizer(gradient_accumulation_steps=k)`):
  each call adds the replica's gradients to its accumulators; the reduction
  and update run on the k-th call of each window only (`update.Accumulate`);
* `jit_compile=True`: the ops the user's `train_step` creates on each
  replica are compiled with XLA (`tfdist._compat.tf.xla_compiled_ops`), the
  reduction and update outside it;
* `LossScaleOptimizer`: scale the loss with `self.optimizer.scale_loss(loss)`
  as Keras's guide says; the reduced gradient is unscaled, and the update
  skipped on every replica when any gradient is not finite;
* `bucket_bytes`, `clipnorm` / `global_clipnorm` on the summed gradient.

Keras's `compute_loss` divides the loss by the replica count; the step
undoes that division and hands each replica's gradients on weighted by its
rows (or by what its loss is a mean or sum over), as
`TrainStep.compute_gradients` does, and the chain divides the sum by the
summed weights: one device's gradient also when a batch splits unevenly.

A `train_step` that applies another optimizer, or the model's optimizer to a
subset of the variables (a GAN's two optimizers), keeps Keras's own `apply`
for those calls; with `accumulation_steps` such a step is refused by name.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import keras
import tensorflow as tf

from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine.step import (
    StepLogs,
    TrainStep,
    _first_batch_dim,
    _scale,
    run_weighing_output_losses,
    with_variable_shapes,
)


class CustomTrainStep(TrainStep):
    """The engine's step around a model's own `train_step`.

    Args:
        model: a Keras model with a custom `train_step`, built and compiled
            in a tfdist strategy's scope.

    Call it like `TrainStep`: in cross-replica context, with one distributed
    batch; it runs `model.train_step` on every replica.
    """

    def __init__(self, model):
        super().__init__(model)
        # Per replica thread: its rows and its loss's reductions, for the weight `_apply` sends with
        # its gradients (the user's `train_step` calls `optimizer.apply`, with no way to pass them).
        self._replica = threading.local()
        # (graph, first op, end op) of each reduction and update, kept out of XLA.
        self._engine_ops: list = []
        self.applied = 0
        # What the user's train_step returns, for Keras's logs (`step.StepLogs`).
        self.logs = StepLogs(self.strategy)

    # Phase 1 is the user's: the "batch" the gradient path hands to
    # `local_gradients` is already `[weighted grads..., weight]`.
    def compute_gradients(self, data) -> list:
        return list(data)

    def __call__(self, data) -> None:
        self.applied = 0
        with self.strategy.scope(), self._standing_in_for_apply():
            if self.jit_compile:
                with tfc.xla_compiled_ops(skip=self._is_engine_op):
                    outputs = run_weighing_output_losses(self.strategy, self.model, self._replica_train_step, data)
            else:
                outputs = run_weighing_output_losses(self.strategy, self.model, self._replica_train_step, data)
            self.logs.record(outputs)
        if self.accumulation is not None and not self.applied:
            raise NotImplementedError(
                f"accumulation_steps={self.accumulation.k} with a custom train_step needs "
                f"{type(self.model).__name__}.train_step to call self.optimizer.apply(gradients, "
                "self.trainable_variables) (or apply_gradients) once per step; it applied no "
                "gradients of all the model's trainable variables through the model's optimizer. "
                "Accumulate in the train_step yourself, or drop accumulation_steps."
            )

    def _replica_train_step(self, data):
        """Replica context: the model's `train_step`, this replica's rows and loss reductions kept for `_apply`."""
        x, _, _ = kc.unpack_data(data)
        self._replica.rows = tf.cast(_first_batch_dim(x), tf.float32)
        with kc.recording_loss_reductions() as reductions:
            self._replica.reductions = reductions
            return self.model.train_step(data)

    def _replica_weight(self):
        """Replica context: this replica's weight for the gradients `_apply` hands on, or None for 1.

        As `TrainStep.compute_gradients` weights a replica: by its rows, or by
        what the loss computed so far in the step is a mean (or sum) over
        (`TrainStep._loss_weight`), so a batch split unevenly over the
        replicas (the epoch's short last batch) gives one device's gradient.
        One replica without accumulation sends weight 1: nothing to weigh.
        """
        if self.strategy.num_replicas_in_sync == 1 and self.accumulation is None:
            return None
        rows = getattr(self._replica, "rows", None)
        if rows is None:
            return None
        chosen = self._loss_weight(list(self._replica.reductions))
        return rows if chosen is None else chosen

    # The stand-in for optimizer.apply ---------------------------------------
    @contextlib.contextmanager
    def _standing_in_for_apply(self):
        optimizer = self.optimizer
        own = vars(optimizer).get("apply")
        original = optimizer.apply
        object.__setattr__(optimizer, "apply", functools.partial(self._apply, original))
        try:
            yield
        finally:
            if own is None:
                object.__delattr__(optimizer, "apply")
            else:
                object.__setattr__(optimizer, "apply", own)

    def _ordered(self, grads, variables):
        """`grads` in `model.trainable_variables` order, or `None` if they are for other variables."""
        if variables is None:
            if not self.optimizer.built:
                return None
            variables = kc.optimizer_trainable_variables(kc.inner_optimizer(self.optimizer))
        variables = list(variables)
        model_variables = self.model.trainable_variables
        if len(variables) != len(model_variables):
            return None
        ordered, missing = kc.reorder_like(grads, variables, model_variables)
        return None if missing else ordered

    @tf.autograph.experimental.do_not_convert
    def _apply(self, original, grads, trainable_variables=None):
        ctx = tf.distribute.get_replica_context()
        grads = list(grads)
        ordered = None if ctx is None or tf.distribute.in_cross_replica_context() else self._ordered(
            grads, trainable_variables
        )
        if ordered is None:
            if self.accumulation is not None:
                raise NotImplementedError(
                    f"accumulation_steps={self.accumulation.k} with a custom train_step applies "
                    "the model's optimizer to all of model.trainable_variables in replica context; "
                    f"{type(self.model).__name__}.train_step called optimizer.apply with "
                    f"{len(list(trainable_variables or []))} variables. Accumulate in the "
                    "train_step yourself, or drop accumulation_steps."
                )
            return original(grads, trainable_variables)
        self.applied += 1
        ordered = [tf.convert_to_tensor(g) if isinstance(g, keras.Variable) else g for g in ordered]
        ordered = with_variable_shapes(ordered, self.model.trainable_variables)
        ordered = self.overwrite_from_replicas(ordered)
        # Undo Keras's 1/N (compute_loss) and send weighted by this replica's
        # rows (or what its loss is a mean over): the chain divides the sum by
        # the summed weights. Weight 1 with one replica.
        replicas = float(self.strategy.num_replicas_in_sync)
        weight = self._replica_weight()
        if weight is None:
            values = [_scale(g, replicas) for g in ordered] + [tf.constant(1.0)]
        else:
            values = [_scale(g, weight * replicas) for g in ordered] + [weight]
        ctx.merge_call(self._reduce_and_update, args=(values,))

    def _reduce_and_update(self, strategy, values) -> None:
        """Cross-replica context: phases 2–4 on the replicas' gradients (`values`)."""
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        path = self.strategy.gradient_path
        if self.accumulation is None:
            path(self, values)
        else:
            added = strategy.extended.call_for_each_replica(self.accumulation.add, args=(values,))
            with tf.control_dependencies(strategy.experimental_local_results(added)):
                self.accumulation.run(lambda: path(self, values))
        self._engine_ops.append((graph, first, len(graph.get_operations())))

    def _is_engine_op(self, graph, index: int) -> bool:
        return any(g is graph and first <= index < end for g, first, end in self._engine_ops)

"""One synchronous training step, the same for every synchronous strategy.

A step has four phases, each a small function with explicit inputs:

1. `local_gradients` (replica context): forward and backward pass on the
   replica's share of the global batch (compiled with XLA when asked; any
   collective in the forward pass, such as synchronized BatchNorm's, stays
   outside XLA). Gradients are weighted by the replica's batch size, so that
   the sum over replicas divided by the global batch size is exactly the
   single-device gradient, even when the global batch does not split evenly.
   With accumulation, the replica's accumulated micro-batches are added here.
2. reduction: the strategy's gradient path (a `GradientPath`, below) sums
   gradients and weights across replicas in fused buffers
   (`tfdist.collectives`) — all-reduce, reduce to the variables' device, or a
   path a strategy registers.
3. `finish`: the reduced chain of `tfdist.engine.update`'s transformations: divide by the
   global batch size, undo the loss scale, clip (so `global_clipnorm` sees
   the whole gradient).
4. `apply`: the optimizer update, gated by dynamic loss scaling (skipped on
   every replica when any replica saw inf or nan).

With accumulation, every micro-step runs phase 1 and adds to per-replica
accumulators; a conditional in cross-replica context runs phases 2–4 only on
the last micro-step of each window (`__call__`).

## Gradient paths

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
import math
import warnings
from typing import Any, Callable

import keras
import tensorflow as tf

from tfdist import collectives
from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.engine import gather, passes, update


def _first_batch_dim(x) -> tf.Tensor:
    flat = [t for t in tf.nest.flatten(x) if t is not None]
    return tf.shape(flat[0])[0]


def global_batch_size(data) -> tf.Tensor:
    """Scalar int32: examples in `data`, a batch or a distributed batch (summed over replicas)."""
    flat = [t for t in tf.nest.flatten(data, expand_composites=False) if t is not None]
    tensor = flat[0]
    if isinstance(tensor, tf.distribute.DistributedValues):
        return tf.add_n([tf.shape(t)[0] for t in tensor.values])
    return tf.shape(tensor)[0]


def local_global_batch(strategy, model, data):
    """Cross-replica context: `global_batch_size(data)`, where `model`'s loss logs weigh replicas by share; else None.

    Only the per-output loss logs of several compiled losses and the logged
    total of summed losses need each replica's share of the global batch
    (`run_weighing_output_losses`, `loss_log_factor`); any other model's step
    computes nothing for them. None too with one replica, and across
    workers: a process sees its own replicas' rows only, not the global
    batch's.
    """
    replicas = strategy.num_replicas_in_sync
    if replicas == 1 or len(strategy.extended.worker_devices) != replicas:
        return None
    if model is None or not (kc.compiled_loss_count(model) > 1 or kc.compiled_losses_sum(model)):
        return None
    return global_batch_size(data)


def replica_share(batch, global_batch) -> tf.Tensor:
    """Replica context: float32, this replica's rows of `batch` over `global_batch` (0 for an empty share)."""
    x, _, _ = kc.unpack_data(batch)
    rows = tf.cast(_first_batch_dim(x), tf.float32)
    return rows / tf.maximum(tf.cast(global_batch, tf.float32), 1.0)


def run_weighing_output_losses(strategy, model, fn: Callable, data, with_share: bool = False):
    """Cross-replica context: `strategy.run(fn, args=(data,))`, each replica's per-output losses logged at its share.

    A multi-output model's `<output>_loss` logs count each batch once on one
    device; each replica's update is weighted by its share of the global batch
    so the shares add up to that (`_compat.keras.output_losses_weighted`).
    With `with_share`, `fn(batch, share)` also gets the share (None with one
    replica, and across workers: `local_global_batch`).
    """
    total = local_global_batch(strategy, model, data)
    if total is None:
        return strategy.run((lambda batch: fn(batch, None)) if with_share else fn, args=(data,))

    def replica_fn(batch):
        share = replica_share(batch, total)
        with kc.output_losses_weighted(share):
            return fn(batch, share) if with_share else fn(batch)

    return strategy.run(replica_fn, args=(data,))


def loss_log_factor(model, share):
    """Replica context: the factor on this replica's logged loss, or None to log it as Keras does.

    The `loss` log is a mean weighted by rows: on one device each batch adds
    its loss times its rows. A replica adds its own loss times its rows, which
    sums to that for a mean over rows; a sum (every compiled loss of
    reduction "sum" or "none") reaches the log as N times the replica's sum
    (Keras unscales it), so a batch split 3/2 logged 3/5 and 2/5 of N times
    each share's sum instead of the batch's sum. 1/(N · share) makes each
    replica add its sum times the global batch's rows.
    """
    if share is None or not kc.compiled_losses_sum(model):
        return None
    replicas = float(tf.distribute.get_replica_context().num_replicas_in_sync)
    return tf.math.divide_no_nan(1.0, share * replicas)


def test_step(model, data, share=None):
    """Replica context: Keras's `test_step` (TensorFlow backend), its loss logged as `TrainStep` logs it.

    `share` (this replica's rows over the global batch's, or None) sets the
    factor on the logged loss (`loss_log_factor`).
    """
    x, y, sample_weight = kc.unpack_data(data)
    y_pred = kc.call_model(model, x, training=False)
    loss = kc.compute_loss(model, x, y, y_pred, sample_weight, training=False)
    kc.track_loss(model, loss, _first_batch_dim(x), loss_log_factor(model, share))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _scale(g, factor):
    if g is None:
        return None
    if isinstance(g, tuple):  # one gradient per part (`TrainStep.run_gathered_by_layer`)
        return tuple(_scale(p, factor) for p in g)
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
        if tf.is_tensor(g) and not isinstance(g, tf.IndexedSlices) and not g.shape.is_fully_defined():
            g = tf.ensure_shape(g, v.shape)
        out.append(g)
    return out


@tf.autograph.experimental.do_not_convert
def regroup(variable, part_grads: list):
    """One gradient for a Keras variable from the gradients of its parts (shards)."""
    if len(part_grads) == 1:
        return part_grads[0]
    if any(g is None for g in part_grads):
        return None
    if not any(isinstance(g, tf.IndexedSlices) for g in part_grads):
        return tf.concat(part_grads, axis=0)
    values, indices, offset = [], [], 0
    for part, g in zip(kc.variable_parts(variable), part_grads):
        g = g if isinstance(g, tf.IndexedSlices) else tf.IndexedSlices(g, tf.range(tf.shape(g)[0]))
        values.append(g.values)
        indices.append(tf.cast(g.indices, tf.int64) + offset)
        offset += int(part.shape[0])
    return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), tf.constant([int(d) for d in variable.shape], tf.int64))



# ---------------------------------------------------------------------------
# Metrics across processes: one collective per read, or none.
# ---------------------------------------------------------------------------
def reads_metrics_across_processes(strategy) -> bool:
    """Whether reading a metric in cross-replica context sums replicas in other processes.

    Keras's metric variables are `on_read` and summed when read: under
    several local devices by an `AddN`, across workers by one all-reduce per
    variable (a Mean alone has two), each a round trip between the workers.
    """
    return len(strategy.extended.worker_devices) < strategy.num_replicas_in_sync


def metric_variables(model) -> list | None:
    """The model's metric variables in a fixed order, or None if they cannot travel as one buffer.

    They travel together when every one is float32, summed on read (Keras's
    default aggregation) and of a known shape; the summed buffer then holds
    exactly what Keras's cross-replica read of each would return.
    """
    variables = [v for metric in model.metrics for v in metric.variables]
    if not variables:
        return None
    for v in variables:
        if v.aggregation != "sum" or v.dtype != "float32" or any(d is None for d in v.shape):
            return None
    return variables


def local_metric_state(variables) -> tf.Tensor:
    """Replica context: this replica's values of `variables` in one flat float32 vector."""
    return tf.concat([tf.reshape(tf.convert_to_tensor(kc.tf_variable(v)), [-1]) for v in variables], axis=0)


def summed_riders(strategy, riders: list):
    """Cross-replica context: the replicas' summed metric state a gradient path returns, or None.

    `riders` is what each replica's function returned of its all-reduce's
    riders (`TrainStep.metric_riders`): the sums, the same on every replica.
    """
    return strategy.experimental_local_results(riders[0])[0] if riders else None


def metrics_result_from_state(model, variables, flat) -> dict:
    """`model.get_metrics_result()` computed from `flat`, the replicas' summed `variables` (no collective)."""
    sizes = [math.prod(v.shape) for v in variables]
    values = [tf.reshape(piece, v.shape) for piece, v in zip(tf.split(flat, sizes), variables)]
    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
        return model.get_metrics_result()


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
    distributed batch. Built eagerly (it creates the accumulators). A step
    whose forward pass is not a Keras model's (the Estimator runner's
    `model_fn`) is built from its parts with `from_parts` and overrides
    `compute_gradients`.
    """

    def __init__(self, model):
        self.model = model
        self.assemble(
            model.distribute_strategy,
            model.optimizer,
            model.trainable_variables,
            jit_compile=uses_xla(model),
            synchronized_layers=any(getattr(layer, "synchronized", False) for layer in kc.all_layers(model)),
            embeddings=any(
                isinstance(layer, keras.layers.Embedding) and layer.trainable for layer in kc.all_layers(model)
            ),
        )

    @classmethod
    def from_parts(cls, strategy, optimizer, variables, jit_compile: bool = False, **kwargs):
        """A step over `variables` with `optimizer` under `strategy`, with no Keras model.

        Args:
            strategy: the tfdist strategy whose gradient path and options the step uses.
            optimizer: a Keras optimizer (built on `variables`).
            variables: the trainable variables, in gradient order.
            jit_compile: bool, whether the forward and backward pass is compiled with XLA
                (also when the strategy's `jit_compile` option says so). Default False.
            **kwargs: passed to the subclass's `__init__`-time attributes (set on the step).
        """
        step = cls.__new__(cls)
        step.model = None
        for key, value in kwargs.items():
            setattr(step, key, value)
        step.assemble(strategy, optimizer, list(variables), jit_compile=jit_compile or strategy.options.jit_compile)
        return step

    def assemble(
        self,
        strategy,
        optimizer,
        variables: list,
        jit_compile: bool,
        synchronized_layers: bool = False,
        embeddings: bool = False,
    ):
        """Sets up the step's parts (transform chain, accumulators, XLA plan); called once, eagerly."""
        self.strategy = strategy
        self.options = strategy.options
        self.optimizer = optimizer
        self.variables = variables
        # Trainable variables with a weight regularizer (Keras adds its loss in `compute_loss`).
        self.regularized = [v for v in variables if getattr(v, "regularizer", None) is not None]
        self.jit_compile = bool(jit_compile)
        # The optimizer whose update rule runs: a LossScaleOptimizer's inner one.
        self.update_optimizer = kc.inner_optimizer(self.optimizer)
        # Keras's `apply` steps after the reduction (unscale, clip), after normalising by the global batch.
        transforms = update.optimizer_transforms(self.optimizer)
        self.loss_scale = transforms[1]
        self.reduced = update.compose(update.normalize_by_weight(), *transforms)
        # The variables differentiated: each Keras variable's TensorFlow
        # variables — the shards of a partitioned one (parameter server), whose
        # whole `ShardedVariable` Keras's tape rejects — regrouped after.
        self.gradient_sources = None
        if any(kc.is_sharded(v) for v in variables):
            self.gradient_sources = [kc.variable_parts(v) for v in variables]
        # Keras's float8 scales and amax histories: their "gradient" is their
        # next value (`overwrite_with_gradient`); see `overwrite_from_replicas`.
        self.overwritten = [
            i for i, v in enumerate(variables) if kc.overwrites_with_gradient(self.update_optimizer, v)
        ]
        k = kc.keras_accumulation_steps(optimizer) or strategy.options.accumulation_steps
        self.accumulation: update.Accumulate | None = None
        with self.strategy.scope():
            if k > 1:
                keras_counter = (
                    kc.iterations_variable(self.update_optimizer)
                    if kc.keras_accumulation_steps(self.optimizer)
                    else None
                )
                self.accumulation = update.Accumulate(
                    k, variables, keras_counter, saved=update.AccumulationState.of(self.optimizer)
                )
            self.reduced.build()
            if self.accumulation is not None:
                self.accumulation.build()
        # Set by the host loop (`tfdist.engine.loop`) where metrics are read
        # after every step across processes: the replicas' metric state then
        # travels in the gradients' all-reduce (`metric_riders`).
        self.metrics_ride = False
        self.ride_variables: list | None = None
        # The global batch of the step being traced (`__call__`), for each
        # replica's share of the loss logs; None with one replica or across
        # workers (`local_global_batch`).
        self.global_batch = None
        # Each replica's compiled forward and backward pass (`passes.CompiledPerReplica`,
        # `passes.GatheredWhole(compiled=True)`): one `tf.function` per replica.
        self._compiled_forward_backward: dict[int, Callable] = {}
        # How each replica's forward and backward pass runs, decided once (`tfdist.engine.passes`).
        self.forward_backward = passes.choose(
            self,
            getattr(self, "model", None),
            custom_gradients=type(self).compute_gradients is not TrainStep.compute_gradients,
            synchronized_layers=synchronized_layers,
            embeddings=embeddings,
        )
        self._compiled_step = None
        if self.forward_backward.compiles_whole_step:
            self._compiled_step = tf.function(
                self._replica_whole_step, jit_compile=True, autograph=False, reduce_retracing=True
            )

    @property
    def layer_reductions(self) -> gather.LayerReductions | None:
        """The layer groups whose gradients are reduced as their backward ends (`passes.ReducedByLayer`), or None."""
        return self.forward_backward.plan if self.forward_backward.reduces_by_layer else None

    # Phase 1 ---------------------------------------------------------------
    def run_tape(self, x, y, sample_weight, weight_factor=None, sources=None):
        """`(y_pred, loss, grads, weight)` of one micro-batch; `weight_factor` (a scalar) multiplies the loss.

        The replica's batch weighting rides on the loss, so the backward pass
        carries it and no pass over the gradients is needed for it. With
        `sources` (the variables' values, read in a `StatelessScope` that maps
        each variable to its value), gradients are taken with respect to them.
        `weight` is what the loss chose to weigh the replica by
        (`_loss_weight`), or None for its rows.
        """
        model = self.model
        with tf.GradientTape() as tape:
            if sources is not None:
                tape.watch(sources)
            self._read_regularized_here()
            y_pred = kc.call_model(model, x, training=True)
            with kc.recording_loss_reductions() as reductions:
                loss = kc.compute_loss(model, x, y, y_pred, sample_weight, training=True)
            weight = self._loss_weight(reductions)
            scaled = self.loss_scale.scale_loss(loss) if self.loss_scale else loss
            if self.update_optimizer.loss_scale_factor is not None:
                scaled = scaled * self.update_optimizer.loss_scale_factor
            if weight_factor is not None:
                if weight is not None:
                    weight_factor = weight * float(self.strategy.num_replicas_in_sync)
                scaled = scaled * tf.cast(weight_factor, scaled.dtype)
        return y_pred, loss, self.gradients(tape, scaled, sources), weight

    def _loss_weight(self, reductions: list):
        """This replica's weight for the loss Keras computed, or None for its batch's rows.

        The engine weights each replica's loss and divides the replicas' sum by
        the summed weights. Rows are exact for means over the rows (Keras's
        default reduction) and for what does not depend on the batch (weight
        regularizers). Two losses are not means over rows (`_compat.keras.
        recording_loss_reductions`): a sum (reduction `"sum"` or `"none"`;
        Keras leaves it undivided, so each replica sends its own with weight
        1/N, and the sum is one device's) and a mean over the unmasked entries
        of a padding mask (weighted by the replica's count of them, so the
        result is the mean over the whole batch's unmasked entries, as on one
        device, however unevenly the padding falls on the replicas), or over
        sample weights (`"mean_with_sample_weight"`: weighted by the
        replica's total sample weight). Where a
        model's losses mix such reductions (a sum and a mean, or masks on two
        outputs) no one weight is exact: rows, as `tf.distribute`, with a
        warning.
        """
        kinds = {kind for kind, _ in reductions}
        if not kinds or kinds == {"rows"}:
            return None
        if kinds == {"sum"}:
            return tf.constant(1.0 / self.strategy.num_replicas_in_sync)
        if len(reductions) == 1:
            return reductions[0][1]
        if not getattr(self, "_warned_mixed_reductions", False):
            self._warned_mixed_reductions = True
            described = {"rows": "a mean over rows", "sum": "a sum", "tokens": "a mean over a padding mask's entries",
                         "weights": "a mean over sample weights"}
            found = ", ".join(described[kind] for kind, _ in reductions)
            warnings.warn(
                f"The losses of model '{self.model.name}' mix reductions that need different weights "
                f"across replicas ({found}); tfdist weights each replica by its rows, which is exact "
                "only where every replica's share holds the same number of rows and of unmasked "
                "entries. Give every output a mean loss over rows, or the model one summed or masked "
                "loss, for gradients equal to one device's.",
                stacklevel=2,
            )
        return None

    def _read_regularized_here(self) -> None:
        """In a `keras.StatelessScope` that does not map them: maps the regularized variables to values read here.

        Keras computes a weight regularizer's loss from the scope's value of
        the variable (`Layer._get_regularization_losses`), and gets None
        (`AttributeError: 'NoneType' object has no attribute 'dtype'`) where
        the scope maps only what the pass assigns (the compiled forward and
        backward pass, `stateless_forward_backward` without `gathered`).
        Read under the step's tape, the value carries the regularizer's
        gradient to the variable, as the variable itself does outside a scope.
        `stateless_forward_backward` does not write these values back.
        """
        scope = kc.stateless_scope()
        if scope is None:
            return
        for v in self.regularized:
            if scope.get_current_value(v) is None:
                kc.record_stateless_update(scope, id(v), tf.convert_to_tensor(kc.stored_variable(v)))

    def gradients(self, tape, target, sources=None) -> list:
        """`target`'s gradient for each of the step's variables, each with its variable's static shape.

        A partitioned variable (parameter server) is differentiated shard by
        shard (`gradient_sources`: Keras's tape rejects a whole
        `ShardedVariable`) and its gradient regrouped. With `sources`, one
        tensor per variable (its value, read whole), the gradient is taken
        with respect to it.
        """
        variables = self.variables
        if sources is not None:
            grads = tape.gradient(target, sources)
        elif self.gradient_sources is None:
            # The stored variables: in a stateless scope a Keras variable's
            # handle is what the scope maps it to (`_read_regularized_here`).
            grads = tape.gradient(target, [kc.stored_variable(v) for v in variables])
        else:
            parts = tape.gradient(target, [p for ps in self.gradient_sources for p in ps])
            grads, i = [], 0
            for v, ps in zip(variables, self.gradient_sources):
                grads.append(regroup(v, parts[i : i + len(ps)]))
                i += len(ps)
        return with_variable_shapes(grads, variables)

    def stateless_forward_backward(
        self, x, y, sample_weight, weight_factor=None, gathered=None, also=None, sources=None
    ):
        """`run_tape` with no variable written: also returns the layers' updates (before the weight).

        Runs in a `keras.StatelessScope`: assignments made by the forward pass
        are recorded, not executed, and come back as `{index in
        _stateful_variables(): new value}`; losses added by layers are collected by
        the scope and read by `compute_loss` as usual. With `gathered` (one
        value per trainable variable), the layers read those values and the
        gradients are taken with respect to them; `also` maps the variables of
        `_frozen_parts()` to the values given, read but not differentiated;
        `sources` (default `gathered`) are what the gradients are taken
        with respect to: a variable's entry may be the list of its parts'
        values (gathered layer by layer, `tfdist.engine.gather`).
        """
        mapping = None if gathered is None else list(zip(self.variables, gathered))
        if also:
            mapping += list(zip(self._frozen_parts(), also))
        mapped = {id(v) for v, _ in mapping} if mapping else set()
        # A regularized variable's value read for its regularizer is not an update.
        mapped |= {id(v) for v in self.regularized}
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            y_pred, loss, grads, weight = self.run_tape(
                x, y, sample_weight, weight_factor, sources=gathered if sources is None else sources
            )
        updates = {}
        for i, v in enumerate(self._stateful_variables()):
            if id(v) in mapped:
                continue
            value = scope.get_current_value(v)
            if value is not None:
                updates[i] = value
        return y_pred, loss, grads, updates, weight

    def run_gathered(self, x, y, sample_weight, weight_factor, share, compiled: bool, context):
        """Replica context: the forward and backward pass on every trainable variable read whole here.

        Each variable held in shards (`ShardedVariable`) is gathered on this
        replica's device (its parts concatenated: TensorFlow copies each part
        over) and the layers read that value (a `keras.StatelessScope`
        mapping); gradients are taken with respect to the gathered values, so
        they keep their variable's whole shape, and an Embedding's sparse rows
        their indices. The layers' own updates (BatchNorm statistics, seeds)
        are written after, in replica context. `compiled`: the pass is one
        XLA program per replica, as under mirrored; else it runs in `context`.
        """
        # Variables held in parts that the step does not train (a layer frozen
        # after it was built) are read whole too, not differentiated.
        also = [tf.convert_to_tensor(kc.tf_variable(v)) for v in self._frozen_parts()]
        gathered = [tf.convert_to_tensor(kc.tf_variable(v)) for v in self.variables]
        if compiled:
            # The gathered values are the compiled function's inputs.
            y_pred, loss, grads, updates, weight = self.replica_program()(
                share, x, y, sample_weight, weight_factor, gathered, also
            )
        else:
            with context:
                y_pred, loss, grads, updates, weight = self.stateless_forward_backward(
                    x, y, sample_weight, weight_factor, gathered=gathered, also=also
                )
        self.assign_updates(updates)
        return y_pred, loss, with_variable_shapes(grads, self.variables), weight

    def run_gathered_by_layer(self, x, y, sample_weight, weight_factor, gathers, context):
        """`run_gathered` with the units' variables gathered layer by layer.

        Each unit's variables are read as their parts' values; the unit's
        layer gathers them for its own forward and again for its backward
        (`tfdist.engine.gather`), and their gradients come back one per part,
        a tuple per variable (`sharded_parameters_path` sums each part's
        onto its device). A read outside the unit's call (a weight
        regularizer, a loss added in the model's `call`, a layer tied to
        another's kernel) gets the parts concatenated there, an op that runs
        only if something reads it; that value is differentiated too, and its
        gradient added to the parts'. Under accumulation the parts' gradients
        are joined into one per variable (the accumulators are whole).
        """
        also = [tf.convert_to_tensor(kc.tf_variable(v)) for v in self._frozen_parts()]
        by_unit = gathers.gathered_by_units
        parts = {i: [tf.convert_to_tensor(p) for p in kc.variable_parts(self.variables[i])] for i in by_unit}
        gathered, sources = [], []
        for i, v in enumerate(self.variables):
            if i in parts:
                gathered.append(gather.whole(v, parts[i]))
                sources.append((parts[i], gathered[-1]))
            else:
                gathered.append(tf.convert_to_tensor(kc.tf_variable(v)))
                sources.append(gathered[-1])
        with context, kc.calls_replaced(gathers.calls(parts, gathered)):
            y_pred, loss, grads, updates, weight = self.stateless_forward_backward(
                x, y, sample_weight, weight_factor, gathered=gathered, also=also, sources=sources
            )
        self.assign_updates(updates)
        grads = [gather.with_outside_reads(g, parts[i]) if i in parts else g for i, g in enumerate(grads)]
        grads = [
            (tuple(g) if self.accumulation is None else regroup(self.variables[i], list(g))) if i in parts else g
            for i, g in enumerate(grads)
        ]
        return y_pred, loss, grads, weight

    def _frozen_parts(self) -> list:
        """The model's variables held in parts that the step does not train (in model order)."""
        trained = {id(v) for v in self.variables}
        return [v for v in self.model.variables if id(v) not in trained and kc.is_sharded(v)]

    def replica_program(self) -> Callable:
        """This replica's compiled forward and backward pass (one `tf.function` per replica).

        Its call takes the replica's share of the global batch first and
        returns `stateless_forward_backward`'s outputs.

        One function per replica: MirroredStrategy traces each replica in its
        own thread, and a function shared by the threads would be traced
        concurrently.
        """
        replica = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
        if replica not in self._compiled_forward_backward:
            rows = {}  # whether the traced pass weighs by rows (`_loss_weight` None)

            def weighed(share, *args):
                with kc.output_losses_weighted(share):
                    *outputs, weight = self.stateless_forward_backward(*args)
                rows["traced"] = weight is None
                return (*outputs, tf.constant(0.0) if weight is None else weight)

            compiled = tf.function(weighed, jit_compile=True, autograph=False, reduce_retracing=True)

            def call(share, *args):
                # The weight the pass chose leaves the program as an output.
                *outputs, weight = compiled(share, *args)
                return (*outputs, None if rows["traced"] else weight)

            self._compiled_forward_backward[replica] = call
        return self._compiled_forward_backward[replica]

    def _stateful_variables(self) -> list:
        """What a forward pass may assign: the model's variables, then its metrics' not among them.

        The metrics' include the per-output loss trackers Keras's compiled
        loss updates inside `compute_loss` (a multi-output model's
        `<output>_loss` in the history).
        """
        model_variables = list(self.model.variables)
        known = {id(v) for v in model_variables}
        return model_variables + [v for v in self.model.metrics_variables if id(v) not in known]

    def assign_updates(self, updates: dict) -> None:
        """Writes what a stateless pass recorded (`{index in _stateful_variables(): value}`)."""
        if not updates:
            return
        variables = self._stateful_variables()
        for i, value in updates.items():
            variables[i].assign(value)

    def run_reducing(self, x, y, sample_weight, weight_factor, plan, reducer):
        """The pass with each group of layers' weight gradients handed to `reducer` as its backward ends.

        The layers read the variables' values in a `keras.StatelessScope` and
        each top-level layer enters through the `plan`
        (`tfdist.engine.gather.LayerReductions`); what no group took is handed
        over at the end. The gradients returned are None where they were
        handed over (a sparse one comes back as usual).
        """
        reads = [tf.convert_to_tensor(kc.tf_variable(v)) for v in self.variables]
        reduction = plan.pass_(reads, reducer)
        with kc.calls_replaced(reduction.calls):
            y_pred, loss, grads, updates, weight = self.stateless_forward_backward(
                x, y, sample_weight, weight_factor, gathered=reads
            )
        reduction.flush()
        # A dense gradient the tape still returns comes from a read outside
        # the layers' calls (a weight regularizer, a loss added in the model's
        # `call`, a layer tied to another's kernel): reduced too, after the
        # pass, and added to the same slice (`reducer` sums into it).
        outside = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        if outside:
            reducer(outside, [grads[i] for i in outside])
            grads = [None if i in outside else g for i, g in enumerate(grads)]
        self.assign_updates(updates)
        return y_pred, loss, grads, weight

    def compute_gradients(self, data, reducer=None) -> list:
        """Replica context: `[weighted grads..., batch size]` of this micro-batch.

        The pass is the step's `forward_backward` (`tfdist.engine.passes`).
        With `reducer` (where it reduces by layer), each group of layers'
        weight gradients goes to `reducer(indices, gradients)` as its backward
        pass ends, and comes back None (`run_reducing`).
        """
        x, y, sample_weight = kc.unpack_data(data)
        batch = _first_batch_dim(x)
        weighted = not (self.strategy.num_replicas_in_sync == 1 and self.accumulation is None)
        weight = factor = None
        # Each replica's per-output loss logs count at its share of the global
        # batch (`run_weighing_output_losses`); the XLA pass takes it as an input.
        share = None if self.global_batch is None else replica_share(data, self.global_batch)
        if weighted:
            # Keras divided the loss by the replica count; undo that and weight
            # by this replica's batch size instead (exact for uneven splits),
            # or by what the pass's loss is a mean over (`_loss_weight`).
            weight = tf.cast(batch, tf.float32)
            factor = weight * float(self.strategy.num_replicas_in_sync)
        # On the loss, unless a loss scale is dynamic (the factor would reach
        # float16 activations) or a float8 layer reads its output gradient's
        # magnitude (`overwrite_with_gradient`): then on each gradient.
        on_loss = factor if (self.loss_scale is None and not self.overwritten) else None
        with kc.output_losses_weighted(share):
            y_pred, loss, grads, chosen = self.forward_backward(self, x, y, sample_weight, on_loss, share, reducer)
        if weighted and chosen is not None:
            weight = chosen
            factor = weight * float(self.strategy.num_replicas_in_sync)
        kc.track_loss(self.model, loss, batch, loss_log_factor(self.model, share))
        self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        grads = self.overwrite_from_replicas(grads)
        if not weighted:
            # One replica, one batch: its gradient is the step's; weight 1
            # tells the chain there is nothing to normalise.
            return list(grads) + [tf.constant(1.0)]
        if on_loss is None:
            grads = [_scale(g, factor) for g in grads]
        return list(grads) + [weight]

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
        variables = [self.variables[i] for i in self.overwritten]

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

    def metric_riders(self) -> list:
        """Replica context: `[this replica's metric state]` to sum with the gradients, or `[]`.

        Where the host loop reads the metrics after each step across processes
        (`metrics_ride`), their state joins the gradients' first bucket (the
        metrics are updated after the forward pass, before backprop ends), so
        the read costs no collective of its own. Not with a compressed
        exchange (the sums would be rounded to the wire dtype) nor under
        accumulation (most micro-steps reduce nothing).
        """
        self.ride_variables = None
        if not self.metrics_ride or self.accumulation is not None or self.options.allreduce_dtype != "float32":
            return []
        self.ride_variables = metric_variables(self.model)
        return [] if self.ride_variables is None else [local_metric_state(self.ride_variables)]

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
                    self.update_optimizer,
                    g,
                    self.variables,
                    self.strategy.gradient_path.placement(self.strategy),
                )

        update.gated(self.loss_scale, grads, update_fn)

    # The whole step --------------------------------------------------------
    def _replica_whole_step(self, data) -> None:
        """Replica context, one replica: all four phases (compiled by XLA as one program).

        No `merge_call`: where every replica is a GPU, TensorFlow calls a
        jit-compiled function in the replica's thread rather than lifting it
        into the host function (`mirrored_run.call_for_each_replica`), and a
        `merge_call` inside fails there. The update runs in cross-replica
        context entered in this thread (`_compat.tf.cross_replica_in_this_thread`),
        as TensorFlow's base replica context merges for one replica: it
        writes the one copy of each variable.
        """
        self.whole_step_updates = {}
        grads = self.finish(self.compute_gradients(data))
        with tfc.cross_replica_in_this_thread(self.strategy):
            self.assign_updates(self.whole_step_updates)
            self.apply(list(grads))

    def __call__(self, data):
        """Runs one step; returns the replicas' summed metric state if it rode along, else None."""
        path = self.strategy.gradient_path
        self.global_batch = local_global_batch(self.strategy, self.model, data)
        with self.strategy.scope():
            if self._compiled_step is not None:
                self.strategy.run(self._compiled_step, args=(data,))
                return
            if self.accumulation is None:
                # The replicas' summed metric state where it rode with the gradients.
                return path(self, data)

            # The forward and backward pass runs (and is traced, and compiled)
            # once, outside the conditional; only the last micro-step of a
            # window then reduces and updates.
            added = self.strategy.run(
                lambda batch: self.accumulation.add(self.compute_gradients(batch)), args=(data,)
            )
            with tf.control_dependencies(self.strategy.experimental_local_results(added)):
                self.accumulation.run(lambda: path(self, data))


# ---------------------------------------------------------------------------
# Gradient paths: phase 2 and the update, per strategy.
# ---------------------------------------------------------------------------
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
        gathers_parameters: bool. Variables are held in shards across the
            replicas' devices; each replica gathers them layer by layer, or
            whole before its forward pass (`TrainStep.run_gathered`).
            Default False.
        reduces_by_layer: bool. The path can take each group of layers'
            gradients as that group's backward pass ends
            (`TrainStep.layer_reductions`, `compute_gradients(reducer=...)`).
            Default False.
    """

    name: str
    run: Callable[[Any, Any], None]
    placement: Callable[[Any], update.Placement] = update.EveryCopy
    local_with_one_replica: bool = False
    variables_on_replicas: bool = True
    gathers_parameters: bool = False
    reduces_by_layer: bool = False

    def __call__(self, step, data):
        return self.run(step, data)


def all_reduce(step, data, update_fn: Callable[[list], None] | None = None):
    """Every replica sums all replicas' gradients, then every copy is updated alike.

    Returns the replicas' summed metric state where it rode in the same
    all-reduce (`TrainStep.metric_riders`), else None. `update_fn` (default:
    the step's update of every copy) is `TrainStep.apply`'s: the sharded
    optimizer's whole variables pass their owners' update.
    """

    def replica_fn(batch):
        values = step.local_gradients(batch)
        riders = step.metric_riders()
        summed = collectives.all_reduce_sum(
            values + riders, step.options.bucket_bytes, step.options.allreduce_dtype
        )
        return step.finish(summed[: len(values)]), summed[len(values):]

    grads, riders = step.strategy.run(replica_fn, args=(data,))
    step.apply(grads, update_fn=update_fn)
    return summed_riders(step.strategy, riders)


def reduce_to_variables(step, data) -> None:
    """Gradients are summed onto the parameter device; each variable is updated once.

    With one replica there is nothing to sum: its gradients go to the
    parameter device as they are (no bucket packing, no reduction).
    """
    strategy = step.strategy
    destination = strategy.parameter_device
    if strategy.num_replicas_in_sync == 1:
        summed = list(strategy.experimental_local_results(strategy.run(step.local_gradients, args=(data,)))[0])
    else:
        plans = []

        def replica_fn(batch):
            values = step.local_gradients(batch)
            plan = collectives.BucketPlan.build(values, step.options.bucket_bytes)
            plans.append(plan)
            return plan.pack(values)

        packed = strategy.run(replica_fn, args=(data,))
        summed = collectives.reduce_to_device(strategy, packed, plans[0], destination)
    with tf.device(destination):
        grads = step.finish(summed)
    step.apply(grads)


ALL_REDUCE = GradientPath("all_reduce", all_reduce, local_with_one_replica=True)
REDUCE_TO_VARIABLES = GradientPath("reduce_to_variables", reduce_to_variables, variables_on_replicas=False)


class StepLogs:
    """The logs a model's own `train_step` or `test_step` returns, kept for Keras's `fit`/`evaluate`.

    Keras's train function returns the step's logs (their mean over the
    replicas), and `fit` shows them where their keys
    differ from the model's metrics (a GAN's `{"d_loss": ..., "g_loss": ...}`
    computed in its `train_step`). A host call may run several steps in an
    on-device loop, so each step writes its reduced logs into variables
    (created at the first trace, one per key) and the call returns them after
    its last step, as Keras returns the last step's logs.
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self._variables: dict = {}
        self.traced = None  # the variables the step being traced writes, or None

    def record(self, outputs) -> None:
        """Cross-replica context: writes the replicas' step outputs into the log variables."""
        self.traced = None
        if not isinstance(outputs, dict) or not outputs:
            return
        reduced = {k: self._mean_over_replicas(v) for k, v in _flat_logs(outputs).items()}
        key = tuple(sorted((k, v.dtype.name) for k, v in reduced.items()))
        variables = self._variables.get(key)
        if variables is None:
            with tf.init_scope():
                variables = {
                    k: tf.Variable(tf.zeros([], v.dtype), shape=tf.TensorShape(None), trainable=False,
                                   name=f"step_log_{i}")
                    for i, (k, v) in enumerate(sorted(reduced.items()))
                }
            self._variables[key] = variables
        self.traced = variables
        for k, v in reduced.items():
            variables[k].assign(v)

    def _mean_over_replicas(self, value) -> tf.Tensor:
        # Keras's "auto" reduction of a step's logs (the mean over the replicas,
        # across workers too; `keras.src.backend.tensorflow.trainer.reduce_per_replica`).
        if isinstance(value, tf.distribute.DistributedValues):
            return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
        return tf.convert_to_tensor(value)

    def result_or(self, metrics: dict) -> dict:
        """The step's logs (read after its last write), or `metrics` where the step returned none or their keys."""
        if self.traced is None or set(self.traced) == set(metrics):
            return metrics
        return {k: v.read_value() for k, v in self.traced.items()}


def _flat_logs(logs: dict) -> dict:
    """`logs` with nested dicts merged in, as Keras's `pythonify_logs` flattens them.

    The keras-io step returns `{m.name: m.result() for m in self.metrics}`,
    where the compiled metrics' result is itself a dict (`{"mae": ...}`).
    """
    flat = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(_flat_logs(value))
        else:
            flat[key] = value
    return flat

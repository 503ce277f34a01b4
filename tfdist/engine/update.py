"""The optimizer update: Keras's `Optimizer.apply` order, written once, for every path and strategy.

`fit`'s step, a custom `train_step`'s `optimizer.apply`, a custom training
loop, the parameter server and the sharded optimizer (its slices, its whole
variables, stage 3's parts) all update through this module, in the order of
Keras's `BaseOptimizer.apply` and `_backend_apply_gradients` (Keras 3.15):

1. `optimizer_transforms` on the summed gradients: the static loss scale
   undone, a `LossScaleOptimizer`'s dynamic scale undone, clipping (`fit`'s
   step chains them after normalising by the global batch; a custom loop's
   gradients go through `apply_gradients`); then, behind the dynamic loss
   scale's gate (`gated`), `apply_update`:
2. `overwrite_with_gradient` variables (Keras's float8 scales and amax
   histories) take their gradient as their value and leave the update;
3. decoupled weight decay (the optimizer's rate, Muon's per-variable rate,
   `exclude_from_weight_decay`);
4. the optimizer's own `_backend_update_step`: its once-per-step state
   (Nadam's `u_product`), then its own `update_step` on each variable, each
   where the placement runs it (`kc.run_update_step`) — no update formula of
   Keras is copied here, so a user's subclass or own optimizer is exact;
5. constraints;
6. EMA of the weights, and its periodic overwrite (`use_ema`,
   `ema_overwrite_frequency`); under Keras's `gradient_accumulation_steps`
   the average also moves on the micro-steps that only accumulate, as in
   Keras: those moves are made at the window's update, before 2;
7. the iteration count.

A `MultiOptimizer` runs 2-7 for each sub-optimizer on its variables, then
counts its own iteration, as Keras's `MultiOptimizer.apply` does.

What varies by strategy is only *where each update runs* — a `Placement`,
always on real variables:

* `EveryCopy`: through `strategy.extended.update`, in cross-replica context:
  on every replica's copy (mirrored, multi_worker; the gradients are
  per-replica values), or once on the variable's device (central_storage).
* `InPlace`: on the variable where it lives, from the calling context;
  `LockedInPlace` (parameter server: a worker writes the variables on the ps
  tasks, concurrently with other workers) holds a lock on the variable's
  device for each variable's update.
* the sharded optimizer's (`tfdist.strategies.sharded`): each replica's
  chunk of the flat parameters, each owner's whole variables, stage 3's
  parts.

Example:

```python
update.apply_gradients(optimizer, summed, lambda grads: update.apply_update(
    optimizer, grads, model.trainable_variables, update.EveryCopy(strategy)))
```

## The gradient chain

Before the update, the step's gradients pass through a chain of small
transformations, also defined here:

Each feature of the step — normalising by the global batch, loss scaling,
clipping, accumulation — is one small transformation with its own state and
its own test, and `TrainStep` chains them instead of branching per feature:

```python
reduced = compose(normalize_by_weight(), unscale_static(optimizer), dynamic_loss_scale(lso),
                  clip_by_optimizer(optimizer))
grads = reduced.update(summed)
```

A transformation has `build()` (creates its state, eagerly, in the
strategy's scope; called once) and `update(values) -> values` (traced into the
step; pure apart from reading its state). Two transformations also hook
other points of the step, and say so: `DynamicLossScale` scales the loss before
the backward pass and gates the update (skip on inf/nan), `Accumulate` runs
before reduction, in replica context, and decides which micro-steps
communicate.

Gradient lists flowing through the reduced chain are ordinary lists with
`None` where a variable has no gradient. The local values entering it are
`[grads..., weight]` (see `tfdist.engine.step`).

A transformation that multiplies every gradient by one scalar (normalising by
the batch, undoing a loss scale, clipping by the global norm) says so with
`scalar(values, pending)`; `Chain` multiplies such runs of scalars together
and makes one pass over the gradients for all of them, instead of one each.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfdist._compat import keras as kc


def _map(fn, grads):
    out = []
    for g in grads:
        if g is None:
            out.append(None)
        elif isinstance(g, tf.IndexedSlices):
            out.append(tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape))
        else:
            out.append(fn(g))
    return out


class GradientTransformation:
    """One step of the gradient pipeline: `build()` once, `update(values)` per step."""

    def build(self) -> None:
        """Creates the transformation's state; default: it has none."""

    def update(self, values: list) -> list:
        raise NotImplementedError

    def scalar(self, values: list, pending):
        """`(values, factor)` when this transformation multiplies every gradient by `factor`.

        `values` may drop entries that are not gradients (the batch weight);
        `pending` is the scalar already owed to `values` (a float32 tensor, or
        None for 1): a transformation that reads the gradients (a global norm)
        accounts for it. `factor` None means 1. Returns None when the
        transformation is not a scalar multiplication (`update` then runs).
        """
        return None


def _times(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a * b


def _multiply(grads: list, factor) -> list:
    if factor is None:
        return list(grads)
    return _map(lambda g: g * tf.cast(factor, g.dtype), grads)


class Chain(GradientTransformation):
    """Applies transformations in order; built and updated as one.

    Consecutive scalar transformations (`GradientTransformation.scalar`) are
    folded into one multiplication of each gradient.
    """

    def __init__(self, transforms: Sequence[GradientTransformation]):
        self.transforms = [t for t in transforms if t is not None]

    def build(self) -> None:
        for t in self.transforms:
            t.build()

    def update(self, values: list) -> list:
        pending = None
        for t in self.transforms:
            folded = t.scalar(values, pending)
            if folded is not None:
                values, factor = folded
                pending = _times(pending, factor)
                continue
            values = t.update(_multiply(values, pending))
            pending = None
        return _multiply(values, pending)


def compose(*transforms: GradientTransformation | None) -> Chain:
    """Chains transformations (`None` entries are skipped), as optax's `chain`.

    Example:

    ```python
    chain = compose(normalize_by_weight(), clip_by_optimizer(optimizer))
    grads = chain.update(summed)
    ```
    """
    return Chain(transforms)


class NormalizeByWeight(GradientTransformation):
    """`[summed weighted grads..., total weight]` → the mean gradient.

    Each replica weighted its gradient by its batch size, so dividing the sum
    by the summed batch sizes gives exactly the single-device mean gradient,
    uneven splits and accumulated micro-batches included.
    """

    def update(self, values: list) -> list:
        grads, total = values[:-1], values[-1]
        if tf.get_static_value(total) == 1.0:
            # One replica's own gradient, sent unweighted (TrainStep.compute_gradients).
            return list(grads)
        return _map(lambda g: tf.math.divide_no_nan(g, tf.cast(total, g.dtype)), grads)

    def scalar(self, values: list, pending):
        grads, total = values[:-1], values[-1]
        if tf.get_static_value(total) == 1.0:
            return list(grads), None
        return list(grads), tf.math.divide_no_nan(1.0, tf.cast(total, tf.float32))


def normalize_by_weight() -> NormalizeByWeight:
    return NormalizeByWeight()


class UnscaleStatic(GradientTransformation):
    """Divides by the optimizer's static `loss_scale_factor` (Keras multiplied the loss by it)."""

    def __init__(self, factor: float):
        self.factor = factor

    def update(self, grads: list) -> list:
        return _map(lambda g: g / tf.cast(self.factor, g.dtype), grads)

    def scalar(self, values: list, pending):
        return values, tf.constant(1.0 / self.factor, tf.float32)


def unscale_static(optimizer) -> UnscaleStatic | None:
    factor = getattr(optimizer, "loss_scale_factor", None)
    return UnscaleStatic(factor) if factor is not None else None


class ClipByOptimizer(GradientTransformation):
    """The optimizer's `clipnorm` / `clipvalue` / `global_clipnorm`, on the reduced gradient.

    It runs after reduction, so `global_clipnorm` takes the norm of the whole
    gradient of the global batch, as on one device (Keras clips each
    replica's share before the all-reduce).
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def update(self, grads: list) -> list:
        return kc.clip_gradients(self.optimizer, grads)

    def scalar(self, values: list, pending):
        # global_clipnorm alone scales every gradient by one factor, computed
        # as Keras's `clip_by_global_norm` does (NaN when the norm is not
        # finite), from the norm of the gradients with `pending` applied.
        optimizer = self.optimizer
        if getattr(optimizer, "clipnorm", None) or getattr(optimizer, "clipvalue", None):
            return None
        if not kc.clips_like_keras(optimizer):
            return None
        clip = float(optimizer.global_clipnorm)
        present = [g for g in values if g is not None]
        if not present:
            return values, None
        # As Keras's `global_norm`: its `ops.square` squares a sparse
        # gradient's rows as they are, a row looked up twice twice (not the
        # square of their sum).
        norm = tf.sqrt(tf.reduce_sum(tf.stack([
            tf.reduce_sum(tf.square(g.values if isinstance(g, tf.IndexedSlices) else g)) for g in present
        ])))
        # Keras's `v * scale` turns a sparse gradient dense (rows looked up
        # twice summed): the optimizer then updates every row, as for a dense
        # gradient (Adam's moments of the rows not looked up decay). So here.
        values = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in values]
        norm = tf.cast(norm, tf.float32)
        if pending is not None:
            norm = norm * tf.abs(pending)
        return values, global_norm_factor(norm, clip)


def global_norm_factor(norm, clipnorm):
    """The factor Keras's `clip_by_global_norm` multiplies every gradient by, for the gradients' global `norm`.

    `min(1, clipnorm / norm)`, written as Keras writes it, and NaN when the
    norm is not finite (Keras's own propagates it). The engine's chain and
    the sharded optimizer's slices (whose squared norms are summed across
    replicas first) both use it.
    """
    clip = float(clipnorm)
    return clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)


def clip_by_optimizer(optimizer) -> ClipByOptimizer | None:
    if not any(getattr(optimizer, a, None) for a in ("clipnorm", "clipvalue", "global_clipnorm")):
        return None
    return ClipByOptimizer(optimizer)


class DynamicLossScale(GradientTransformation):
    """Dynamic loss scaling of a `keras.optimizers.LossScaleOptimizer`, across replicas.

    Three hooks, all on the optimizer's own state (`dynamic_scale`,
    `step_counter`), so checkpoints and `optimizer.dynamic_scale` read as in
    Keras:

    * `scale_loss(loss)`: before the backward pass, on every replica.
    * `update(grads)`: after reduction, divides by the scale.
    * `gate(grads, apply_fn)`: in cross-replica context, applies the update
      only if every gradient is finite, then grows the scale every
      `dynamic_growth_steps` finite steps; otherwise skips the update and
      halves the scale. The gradients are already summed over replicas, so an
      inf or nan on any one replica is in every replica's sum: all replicas
      take the same decision.
    """

    def __init__(self, loss_scale_optimizer):
        self.lso = loss_scale_optimizer

    def scale_loss(self, loss):
        return loss * tf.cast(self.lso.dynamic_scale, loss.dtype)

    def update(self, grads: list) -> list:
        scale = self.lso.dynamic_scale
        return _map(lambda g: g / tf.cast(scale, g.dtype), grads)

    def scalar(self, values: list, pending):
        return values, 1.0 / tf.cast(self.lso.dynamic_scale, tf.float32)

    def all_finite(self, grads: list):
        """Cross-replica context: True when every replica's every gradient is finite.

        Each replica's values are checked on its own device and only the
        booleans meet, so the check also holds when replicas hold different
        slices of the gradient (a sharded update), not only identical sums.
        """
        strategy = tf.distribute.get_strategy()
        checks = []
        for g in grads:
            if g is None:
                continue
            parts = (
                strategy.experimental_local_results(g)
                if isinstance(g, tf.distribute.DistributedValues)
                else [g]
            )
            for part in parts:
                values = part.values if isinstance(part, tf.IndexedSlices) else part
                with tf.device(values.device):
                    checks.append(tf.reduce_all(tf.math.is_finite(values)))
        return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)

    def gate(self, grads: list, apply_fn: Callable[[list], None]) -> None:
        lso = self.lso
        growth = lso.dynamic_growth_steps

        def finite():
            apply_fn(grads)
            grow = tf.equal(lso.step_counter, growth - 1)
            with tf.control_dependencies([grow]):
                lso.step_counter.assign(tf.where(grow, tf.zeros_like(lso.step_counter), lso.step_counter + 1))
                lso.dynamic_scale.assign(
                    tf.where(grow, lso.dynamic_scale * 2.0, lso.dynamic_scale)
                )
            return tf.constant(True)

        def not_finite():
            lso.step_counter.assign(tf.zeros_like(lso.step_counter))
            lso.dynamic_scale.assign(lso.dynamic_scale * 0.5)
            return tf.constant(False)

        tf.cond(self.all_finite(grads), finite, not_finite)


def dynamic_loss_scale(optimizer) -> DynamicLossScale | None:
    return DynamicLossScale(optimizer) if kc.is_loss_scale_optimizer(optimizer) else None


class Accumulate(GradientTransformation):
    """Gradient accumulation over `k` micro-batches, with no communication until the last.

    State: one float32 accumulator per gradient and one for the batch weight,
    each a per-replica (`ON_READ`) variable, so a replica adds to its own
    copy; and a micro-step counter. Every micro-step runs the forward and
    backward pass and `add`s its gradients on every replica; on the last one
    of a window the strategy's gradient path runs too, and `update` (in place
    of the local gradients) releases the accumulated sum and zeroes the
    accumulators; on the other `k - 1` nothing crosses devices. The choice is
    a `tf.cond` in cross-replica context (`run`), because a collective cannot
    sit in a conditional branch inside a replica function under
    MirroredStrategy.

    Args:
        k: int. Micro-batches per optimizer step, >= 2.
        variables: the trainable variables (for the accumulators' shapes).
        keras_iterations: Optional `tf.Variable`. When accumulation comes from
            Keras's `Optimizer(gradient_accumulation_steps=k)`, its iteration
            counter is the micro-step counter, as in Keras (the update happens
            when `(iterations + 1) % k == 0`, and `optimizer.iterations`
            reads as optimizer steps); otherwise tfdist keeps its own counter
            and `optimizer.iterations` counts optimizer steps.
    """

    def __init__(self, k: int, variables: Sequence, keras_iterations=None, saved: AccumulationState | None = None):
        self.k = k
        self.variables = list(variables)
        self.keras_iterations = keras_iterations
        self.saved = saved
        self.accumulators: list = []
        self.weight = None
        self.counter = None
        # Collectives traced into each branch, for tests (see tfdist.collectives.trace_counter).
        self.traced_collectives = {"accumulate": None, "communicate": None}

    def build(self) -> None:
        with_counter = self.keras_iterations is None
        window = self.saved.window_for(self.variables, with_counter) if self.saved is not None else None
        if window is None:
            window = window_variables(self.variables, with_counter)
            if self.saved is not None:
                self.saved.track(*window)
        self.accumulators, self.weight, self.counter = window

    # Replica context ------------------------------------------------------
    def add(self, values: list):
        """Adds this micro-batch's `[grads..., weight]` to the replica's accumulators."""
        grads, weight = values[:-1], values[-1]
        updates = [
            acc.assign_add(tf.cast(tf.convert_to_tensor(g), tf.float32))
            for acc, g in zip(self.accumulators, grads)
            if g is not None
        ]
        updates.append(self.weight.assign_add(weight))
        return tf.group(updates)

    def update(self, values: list | None = None) -> list:
        """Releases the accumulated `[grads..., weight]` and zeroes the accumulators.

        Every micro-step, the last included, was added with `add` first, so
        `values` (the chain's input) is not needed and is ignored.
        """
        del values
        out = [acc.read_value() for acc in self.accumulators]
        total = self.weight.read_value()
        with tf.control_dependencies(out + [total]):
            resets = [acc.assign(tf.zeros_like(acc)) for acc in self.accumulators]
            resets.append(self.weight.assign(0.0))
        with tf.control_dependencies(resets):
            out = [tf.identity(t) for t in out]
            total = tf.identity(total)
        return out + [total]

    # Cross-replica context -----------------------------------------------
    def is_last_micro_step(self):
        if self.keras_iterations is not None:
            return tf.equal((self.keras_iterations + 1) % self.k, 0)
        return tf.equal(self.counter, self.k - 1)

    def run(self, communicate_fn: Callable[[], None]) -> None:
        """Runs `communicate_fn` on the last micro-step of each window; advances the counter.

        Call after `add` ran for this micro-step on every replica.
        """
        from tfdist import collectives

        def branch(kind, fn, advance):
            def run_branch():
                before = collectives.traced_collective_count()
                fn()
                self.traced_collectives[kind] = collectives.traced_collective_count() - before
                advance()
                return tf.constant(True)

            return run_branch

        def advance_accumulating():
            if self.keras_iterations is not None:
                self.keras_iterations.assign_add(1)
            else:
                self.counter.assign_add(1)

        def advance_communicating():
            # Keras's counter was advanced by the optimizer update itself.
            if self.keras_iterations is None:
                self.counter.assign(0)

        tf.cond(
            self.is_last_micro_step(),
            branch("communicate", communicate_fn, advance_communicating),
            branch("accumulate", lambda: None, advance_accumulating),
        )


def window_variables(variables: Sequence, with_counter: bool) -> tuple:
    """An accumulation window's variables: `(sums, weight, micro_step or None)`.

    Each sum (float32, shaped as its variable) and the weight are per-replica
    (`ON_READ`, aggregated by `SUM`), so a replica adds to its own copy; the
    micro-step counter (tfdist's own, not Keras's) is one for all.
    """
    on_read = dict(
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )
    sums = [tf.Variable(tf.zeros(v.shape, tf.float32), name="tfdist_grad_accumulator", **on_read) for v in variables]
    weight = tf.Variable(0.0, name="tfdist_weight_accumulator", **on_read)
    counter = None
    if with_counter:
        counter = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="tfdist_micro_step",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
    return sums, weight, counter


class AccumulationState(kc.saved_beside_optimizer_class()):
    """An accumulation window in checkpoints: its running sums, their weight and its micro-step.

    Attached to the model's optimizer at `compile` (`attach`), with the
    window's variables where the model is built, so that Keras's saving
    (`save`, `save_weights`, ModelCheckpoint, BackupAndRestore) writes the
    window under the optimizer's path and `tf.train.Checkpoint` as the
    optimizer's dependency, and a restore before `fit` finds them; the step's
    `Accumulate` then uses these variables. A run resumed from a checkpoint
    written mid-window ends that window as one that never stopped.

    Written: each sum over the replicas (its cross-replica value; across
    workers a collective, so every worker saves, as TensorFlow requires), the
    summed weight and tfdist's micro-step (Keras's, under Keras's
    `gradient_accumulation_steps`, is the optimizer's `iterations`, which
    Keras saves). Restored in cross-replica context, each replica's copy of a
    sum gets the sum divided by the replica count (TensorFlow's rule for
    `ON_READ` `SUM` variables), so the replicas' sum at the window's end is
    the saved one. At a window boundary nothing is written (no collective);
    a file without the entries (saved at a boundary, or without tfdist)
    closes the window. A model without tfdist ignores them.
    """

    ATTRIBUTE = "_tfdist_accumulation"

    def __init__(self, optimizer):
        super().__init__(name="tfdist_accumulation")
        # A weak reference: not a checkpoint dependency (the optimizer holds this state).
        self._optimizer = weakref.ref(optimizer)
        # Entries loaded before the window's variables existed (an unbuilt model).
        self._loaded: dict | None = None

    @classmethod
    def attach(cls, optimizer, variables: Sequence | None) -> None:
        """Gives `optimizer` a window, with its variables where `variables` (the trainable ones) are known."""
        state = cls.of(optimizer)
        if state is None:
            state = cls(optimizer)
            kc.attach_to_optimizer(optimizer, cls.ATTRIBUTE, state)
        if variables is not None and state.window() is None:
            state.track(*window_variables(variables, not kc.keras_accumulation_steps(optimizer)))

    @classmethod
    def of(cls, optimizer) -> AccumulationState | None:
        return kc.beside_optimizer(optimizer, cls.ATTRIBUTE)

    def window(self) -> tuple | None:
        sums = getattr(self, "sums", None)
        return None if sums is None else (list(sums), self.weight, getattr(self, "micro_step", None))

    def window_for(self, variables: Sequence, with_counter: bool) -> tuple | None:
        """The tracked window, where it fits `variables` (shapes) and the counter's owner; else None."""
        window = self.window()
        if window is None:
            return None
        sums, _, counter = window
        if [tuple(s.shape) for s in sums] != [tuple(v.shape) for v in variables] or (counter is not None) != with_counter:
            return None
        return window

    def track(self, sums: list, weight, micro_step) -> None:
        """Makes these the window written and restored; applies entries loaded before they existed.

        Set as `tf.Module` attributes: a `tf.train.Checkpoint` restored before
        they existed restores them now (deferred restoration).
        """
        self.sums = list(sums)
        self.weight = weight
        if micro_step is not None:
            self.micro_step = micro_step
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self._restore(loaded)

    def _pending(self) -> int:
        """Micro-steps in the open window (0 at a boundary), read without a collective."""
        _, _, counter = self.window()
        if counter is not None:
            return int(tf.convert_to_tensor(counter))
        optimizer = self._optimizer()
        k = kc.keras_accumulation_steps(optimizer)
        return int(tf.convert_to_tensor(kc.iterations_variable(kc.inner_optimizer(optimizer)))) % k

    def save_own_variables(self, store) -> None:
        window = self.window()
        if window is None:
            arrays = dict(self._loaded or {})
        elif self._pending() == 0:
            arrays = {}
        else:
            sums, weight, counter = window
            arrays = {str(i): np.asarray(tf.convert_to_tensor(s)) for i, s in enumerate(sums)}
            arrays["weight"] = np.asarray(tf.convert_to_tensor(weight))
            if counter is not None:
                arrays["micro_step"] = np.asarray(tf.convert_to_tensor(counter))
        for key, value in arrays.items():
            store[key] = value

    def load_own_variables(self, store) -> None:
        optimizer = self._optimizer()
        if optimizer is not None and not optimizer.built:
            # Keras skips an unbuilt optimizer's state, with a warning (a
            # fine-tuning flow: `load_weights` between `compile` and `fit`);
            # its window goes with it.
            return
        arrays = {key: np.array(store[key]) for key in store.keys()}
        if self.window() is None:
            self._loaded = arrays
        else:
            self._restore(arrays)

    def _restore(self, arrays: dict) -> None:
        """Sets the window from saved entries (empty: a closed window).

        Entries that do not fit (another set of trainable variables) are
        skipped with a warning, as Keras skips an optimizer state of another
        size, and the window is left as it was.
        """
        sums, weight, counter = self.window()
        expected = [tuple(s.shape) for s in sums]
        if arrays:
            saved = [tuple(np.shape(arrays[key])) for key in sorted((k for k in arrays if k.isdigit()), key=int)]
            if saved != expected or "weight" not in arrays:
                warnings.warn(
                    f"Skipping the checkpoint's gradient-accumulation window: it holds sums of shapes "
                    f"{saved}, but this model accumulates gradients of shapes {expected} (its trainable "
                    "variables differ from the saved model's). The window in progress was left as it "
                    "was.",
                    stacklevel=2,
                )
                return
        with tf.init_scope():
            for i, s in enumerate(sums):
                s.assign(arrays[str(i)] if arrays else tf.zeros(s.shape, s.dtype))
            weight.assign(float(arrays["weight"]) if arrays else 0.0)
            if counter is not None:
                counter.assign(int(arrays.get("micro_step", 0)))


# ---------------------------------------------------------------------------
# Keras's `apply`, once: summed gradients -> unscale -> clip -> gated update.
# Plain Python around TensorFlow calls, never converted by autograph (whose
# conversion of these nested calls failed in long test runs: "tf__optimizer_
# transforms() takes 1 positional argument but 3 were given").
# ---------------------------------------------------------------------------
@tf.autograph.experimental.do_not_convert
def optimizer_transforms(optimizer) -> list:
    """Keras's `Optimizer.apply` steps between the summed gradients and the update, in Keras's order.

    The optimizer's static `loss_scale_factor` undone, a `LossScaleOptimizer`'s
    dynamic scale undone, then the optimizer's clipping; `None` where the
    optimizer has no such step. The engine's step chains them after
    normalising by the global batch (`TrainStep`); a custom loop's summed
    gradients go through them alone (`apply_gradients`).

    Args:
        optimizer: the model's optimizer (a `LossScaleOptimizer` or not).
    """
    inner = kc.inner_optimizer(optimizer)
    return [unscale_static(inner), dynamic_loss_scale(optimizer), clip_by_optimizer(inner)]


@tf.autograph.experimental.do_not_convert
def gated(loss_scale, grads: list, update_fn: Callable[[list], None]) -> None:
    """Cross-replica context: `update_fn(grads)`, skipped on inf/nan where a dynamic `loss_scale` gates it."""
    if loss_scale is None:
        update_fn(grads)
    else:
        loss_scale.gate(grads, update_fn)


@tf.autograph.experimental.do_not_convert
def apply_gradients(optimizer, grads: Sequence, update_fn: Callable[[list], None]) -> None:
    """Keras's `Optimizer.apply` on gradients already summed over the replicas: unscale, clip, then the update.

    The one order every path follows: `optimizer_transforms` (static and
    dynamic loss scale undone, clipping), then `update_fn` — behind the
    loss-scale gate, in cross-replica context; or, where `update_fn` reaches
    cross-replica context itself (a `merge_call` from a replica), directly.

    Args:
        optimizer: the model's optimizer.
        grads: the summed gradients (or a sharded optimizer's summed slice).
        update_fn: callable `(finished grads) -> None`, usually a placement's
            `apply_update`.

    Example:

    ```python
    update.apply_gradients(optimizer, summed, lambda g: update.apply_update(
        kc.inner_optimizer(optimizer), g, variables, update.EveryCopy(strategy)))
    ```
    """
    transforms = optimizer_transforms(optimizer)
    finished = compose(*transforms).update(list(grads))
    gated(transforms[1], finished, update_fn)


# ---------------------------------------------------------------------------
# The update template.
# ---------------------------------------------------------------------------
class Placement:
    """Where one variable's update runs: `run(variable, fn, *args)` calls `fn(v, *args)` there.

    `run` is for element-wise work (the optimizer's update, weight decay,
    EMA), which a placement may split into parts of the variable;
    `run_whole` for work that needs the whole variable (constraints).
    """

    def run(self, variable, fn: Callable, *args) -> None:
        raise NotImplementedError

    def run_whole(self, variable, fn: Callable, *args) -> None:
        self.run(variable, fn, *args)

    def update_step(self, optimizer, variable, grad, learning_rate) -> None:
        """The optimizer's own `update_step` of one variable, where `run` places it."""
        self.run(variable, lambda x, g: optimizer.update_step(g, x, learning_rate), grad)


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


class LockedInPlace(InPlace):
    """`InPlace`, each variable's `update_step` run under a lock held on the variable's device.

    Workers of a parameter-server job update the same ps variables
    concurrently, without synchronisation. An optimizer's `update_step` is
    several ops (Keras's Adam: add to m, add to v, then read both and subtract
    from the variable) with nothing ordering one worker's against another's,
    so one can read another's new m with v still without the matching square:
    where v was 0 (a ReLU unit or an embedding row this worker's batch left
    untouched) its step is `lr * m / epsilon`, about 1e4 times too large, and
    training diverged (the digits MLP's test loss 3.6 instead of 0.13-0.18 in
    a CI run, the zoo's recommender in 2 of 27 runs). Here the optimizer's own
    `update_step` of one variable runs inside a `tf.CriticalSection` whose
    mutex lives on the variable's (first shard's) device, shared by every
    worker by name: one worker's reads and writes of the variable and its
    slots never interleave with another's, whatever the optimizer (Keras's
    `use_locking`, for any `update_step`). Updates of different variables
    still run concurrently.
    """

    def update_step(self, optimizer, variable, grad, learning_rate) -> None:
        target = kc.tf_variable(variable)
        device = kc.raw_variable_parts(variable)[0].device
        with tf.device(device):
            # One mutex per variable on its ps task, found by every worker's
            # step by this name (the chief traces every worker's function).
            section = tf.CriticalSection(shared_name=f"tfdist_update_{id(target)}")

        def locked():
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            optimizer.update_step(grad, target, learning_rate)
            # The lock is released once every op of the update has run.
            with tf.control_dependencies(graph.get_operations()[first:]):
                return tf.constant(True)

        section.execute(locked, exclusive_resource_access=False)


@tf.autograph.experimental.do_not_convert
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
        placement: where each update runs (`EveryCopy`, `InPlace`, ...).
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
    window = kc.keras_accumulation_steps(optimizer)
    if optimizer.use_ema and window:
        _average_waiting_micro_steps(optimizer, placement, window)
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

    # The optimizer's own `_backend_update_step` (Nadam's once-per-step state
    # first), each variable's `update_step` where the placement runs it.
    kc.run_update_step(
        optimizer, [g for g, _ in pairs], [v for _, v in pairs], learning_rate,
        lambda v, g, lr: placement.update_step(optimizer, v, g, lr),
    )

    if constrain:
        for _, v in pairs:
            if v.constraint is not None:
                placement.run_whole(v, lambda x, c=v.constraint: x.assign(c(tf.convert_to_tensor(x))))

    if optimizer.use_ema:
        iterations = optimizer.iterations
        overwrite = None
        if optimizer.ema_overwrite_frequency:
            overwrite = tf.equal((iterations + 1) % optimizer.ema_overwrite_frequency, 0)
        _move_averages(optimizer, placement, _ema_momentum(optimizer), overwrite)


def _ema_momentum(optimizer):
    """Keras's EMA momentum at this step: 0 at the first (the average starts as the weights)."""
    return tf.cast(tf.not_equal(optimizer.iterations, 0), tf.float32) * optimizer.ema_momentum


def _average_waiting_micro_steps(optimizer, placement, k: int) -> None:
    """Keras's EMA moves of the `k - 1` micro-steps of a window that only accumulate, as one.

    Under Keras's `Optimizer(gradient_accumulation_steps=k)` the average moves
    on every micro-step (Keras 3.15 `_backend_apply_gradients`), by one
    momentum `m` per window (its `iterations` count windows), towards weights
    that change only at the window's update: `k - 1` moves by `m` are one
    move by `m ** (k - 1)`, made before the update. (Keras's
    `ema_overwrite_frequency` would also overwrite the weights on those
    micro-steps, under the window's later micro-batches: refused at compile,
    `tfdist.engine.loop.validate_compiled_model`.)
    """
    _move_averages(optimizer, placement, _ema_momentum(optimizer) ** (k - 1), overwrite=None)


def _move_averages(optimizer, placement, momentum, overwrite) -> None:
    """Every EMA average moves towards its weights by `momentum`; then, where `overwrite`, the weights take it."""
    averages = kc.ema_averages(optimizer)
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

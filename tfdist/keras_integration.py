"""The one place where tfdist meets Keras internals.

Keras owns the loop (epochs, callbacks, progress bar, history); tfdist owns the
step. This module installs tfdist's train and test functions on models whose
strategy is a tfdist strategy, and leaves every other model exactly as Keras
made it: each patched method first checks the model's strategy and otherwise
calls the original.

Every use of a private Keras API is in this file, behind a named function, and
checked against the range of Keras versions it was verified on
(`VERIFIED_KERAS`). Outside that range tfdist warns once at import and carries
on; the test suite pins the verified range.

Upstream issues worked around here:

* keras-team/keras#20585 and tensorflow/tensorflow#72388: Keras 3 `fit` fails
  under MultiWorkerMirroredStrategy with "Attempt to convert a value
  (PerReplica...)" — tfdist's train function reduces every per-replica value
  itself (`tfdist.engine.loop`), so Keras never sees one.
* Keras 3 `compile(steps_per_execution>1)` under MirroredStrategy fails with
  "You must feed a value for placeholder tensor 'while/cond/Placeholder'": the
  loop in `tfdist.engine.loop` carries no per-step outputs through the
  `tf.while_loop` and reads the metrics once after it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import keras
import tensorflow as tf

# Keras versions on which the private APIs below were verified.
VERIFIED_KERAS = ((3, 5), (3, 15))

_installed = False
_originals: dict[str, Any] = {}


def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def _trainer_class():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


def _is_tfdist_model(model) -> bool:
    from tfdist.strategies.base import is_tfdist_strategy

    return is_tfdist_strategy(getattr(model, "_distribute_strategy", None))


# ---------------------------------------------------------------------------
# Model-side private API: losses, metrics, custom steps.
# ---------------------------------------------------------------------------


def call_model(model, x, training: bool):
    """Calls the model as Keras's own train/test steps do."""
    if model._call_has_training_arg:
        return model(x, training=training)
    return model(x)


def compute_loss(model, x, y, y_pred, sample_weight, training: bool):
    """The model's total loss for one replica, as Keras's `train_step` computes it.

    Keras scales it by 1/num_replicas for distribution (see
    `keras.src.losses.loss.scale_loss_for_distribution`).
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def track_loss(model, loss, batch_size):
    """Updates the model's `loss` metric as Keras's `train_step` does."""
    from keras.src.losses import loss as loss_module

    value = loss_module.unscale_loss_for_distribution(loss)
    # A replica with an empty batch (the last, short global batch) adds nothing.
    value = tf.where(batch_size > 0, value, tf.zeros_like(value))
    model._loss_tracker.update_state(value, sample_weight=batch_size)


def has_custom_train_step(model) -> bool:
    return type(model).train_step is not _trainer_class().train_step


def has_custom_test_step(model) -> bool:
    return type(model).test_step is not _trainer_class().test_step


def unpack_data(data):
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.unpack_x_y_sample_weight(data)


# ---------------------------------------------------------------------------
# Optimizer-side private API: applying already-reduced gradients.
# ---------------------------------------------------------------------------


def is_loss_scale_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def clip_gradients(optimizer, grads: Sequence):
    """Applies the optimizer's `clipnorm`/`clipvalue`/`global_clipnorm` to `grads`.

    Called on gradients that are already summed over replicas, so a global norm
    is the norm of the whole gradient, as on a single device.
    """
    return optimizer._clip_gradients(list(grads))


def _tf_variable(v):
    return v.value if isinstance(v, keras.Variable) else v


def _apply_weight_decay(optimizer, strategy, variables, learning_rate) -> None:
    """Keras's decoupled weight decay, on every replica's copy of each variable."""
    if optimizer.weight_decay is None:
        return
    for variable in variables:
        if not optimizer._use_weight_decay(variable):
            continue

        def decay(v):
            lr = tf.cast(learning_rate, v.dtype)
            wd = tf.cast(optimizer.weight_decay, v.dtype)
            return v.assign_sub(v * wd * lr)

        strategy.extended.update(_tf_variable(variable), decay, group=False)


def apply_update(optimizer, grads: Sequence, variables: Sequence) -> None:
    """Applies reduced gradients with the optimizer, in cross-replica context.

    This is Keras's `Optimizer.apply` without the parts tfdist's step engine
    has already done (reduction across replicas, unscaling, clipping,
    accumulation): weight decay, the optimizer's `update_step` on every
    replica's copy of each variable, EMA, constraints and the iteration count.

    Args:
        optimizer: a built `keras.optimizers.Optimizer`.
        grads: per-variable gradients: per-replica values from `strategy.run`
            (all-reduce path) or tensors on the variables' device (reduce-to-
            variables path).
        variables: the trainable variables, in the order of `grads`.
    """
    from keras.src import backend as keras_backend
    from keras.src import ops

    variables = list(variables)
    grads = list(grads)
    with keras_backend.name_scope(optimizer.name, caller=optimizer):
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not pairs:
            return
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        strategy = tf.distribute.get_strategy()
        learning_rate = optimizer.learning_rate
        _apply_weight_decay(optimizer, strategy, variables, learning_rate)
        # The body Keras's TF optimizer runs through merge_call; we are already
        # in cross-replica context, with gradients reduced.
        optimizer._distributed_tf_update_step(
            strategy, [(g, _tf_variable(v)) for g, v in zip(grads, variables)], learning_rate
        )
        if optimizer.use_ema:
            optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
            if optimizer.ema_overwrite_frequency:
                should_overwrite = (
                    optimizer.iterations + 1
                ) % optimizer.ema_overwrite_frequency == 0
                ops.cond(
                    should_overwrite,
                    lambda: optimizer._overwrite_model_variables_with_average_value(
                        optimizer._trainable_variables
                    ),
                    lambda: None,
                )
        for variable in variables:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
    optimizer._iterations.assign_add(1)


# ---------------------------------------------------------------------------
# Installation: the patched Trainer methods.
# ---------------------------------------------------------------------------


def _check_compile_scope(model) -> None:
    """Raises if a tfdist model is compiled outside its scope, or vice versa."""
    from tfdist.strategies.base import is_tfdist_strategy

    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    built_under = getattr(model, "_distribute_strategy", None)
    if is_tfdist_strategy(current) and built_under is not current:
        where = (
            "outside any strategy scope"
            if built_under is None
            else f"under a different strategy ({built_under!r})"
        )
        raise ValueError(
            f"The model {model.name!r} was built {where} and is being compiled "
            f"inside the scope of {current!r}. Its variables were not created by "
            "this strategy, so they are not replicated and cannot be trained by it. "
            "Build the model inside the same scope you compile it in:\n"
            "    with strategy.scope():\n"
            "        model = build_model()\n"
            "        model.compile(...)\n"
            "The model was left as it was (not compiled)."
        )
    if is_tfdist_strategy(built_under) and current is not built_under:
        raise ValueError(
            f"The model {model.name!r} was built inside the scope of {built_under!r} "
            "but is being compiled outside it, so its optimizer would not be "
            "distributed. Call `model.compile(...)` inside `with strategy.scope():`. "
            "The model was left as it was (not compiled)."
        )


def _patched_compile(original):
    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        _check_compile_scope(self)
        result = original(self, *args, **kwargs)
        if _is_tfdist_model(self):
            from tfdist.engine import validate_compiled_model

            validate_compiled_model(self)
        return result

    return compile


def _patched_make(original, kind: str):
    @functools.wraps(original)
    def make(self, force=False):
        if not _is_tfdist_model(self):
            return original(self, force=force)
        attr = f"{kind}_function"
        if getattr(self, attr) is not None and not force:
            return getattr(self, attr)
        from tfdist import engine

        builder = engine.make_train_function if kind == "train" else engine.make_test_function
        setattr(self, attr, builder(self))
        return getattr(self, attr)

    return make


def _patched_symbolic_build(original):
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Upstream Keras (3.5 to 3.15) averages the first distributed batch over
        # replicas with `strategy.reduce("MEAN")` only to learn its shapes; when
        # the global batch does not split evenly (30 over 4 replicas: 8, 8, 8, 6)
        # that fails with "Inputs to operation AddN ... must have the same size".
        # One replica's share has the shapes the build needs.
        if iterator is None or not _is_tfdist_model(self):
            return original(self, iterator=iterator, data_batch=data_batch)
        strategy = self.distribute_strategy
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v,
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    return _maybe_symbolic_build


def install() -> None:
    """Installs tfdist's hooks into Keras once; safe to call again."""
    global _installed
    if _installed:
        return
    version = keras_version()
    if not (VERIFIED_KERAS[0] <= version <= VERIFIED_KERAS[1]):
        warnings.warn(
            f"tfdist was verified with Keras {VERIFIED_KERAS[0][0]}.{VERIFIED_KERAS[0][1]} to "
            f"{VERIFIED_KERAS[1][0]}.{VERIFIED_KERAS[1][1]}; found Keras {keras.__version__}. "
            "Training under tfdist strategies may fail; models outside them are unaffected.",
            stacklevel=2,
        )
    trainer = _trainer_class()
    from keras.src.trainers.trainer import Trainer

    _originals["compile"] = trainer.__dict__.get("compile", Trainer.compile)
    _originals["make_train_function"] = trainer.make_train_function
    _originals["make_test_function"] = trainer.make_test_function
    _originals["_maybe_symbolic_build"] = trainer._maybe_symbolic_build
    trainer._maybe_symbolic_build = _patched_symbolic_build(_originals["_maybe_symbolic_build"])
    trainer.compile = _patched_compile(_originals["compile"])
    trainer.make_train_function = _patched_make(_originals["make_train_function"], "train")
    trainer.make_test_function = _patched_make(_originals["make_test_function"], "test")
    _installed = True


def uninstall() -> None:
    """Restores Keras's own methods (used by tests of the hooks themselves)."""
    global _installed
    if not _installed:
        return
    trainer = _trainer_class()
    from keras.src.trainers.trainer import Trainer

    if _originals["compile"] is Trainer.compile:
        del trainer.compile
    else:
        trainer.compile = _originals["compile"]
    trainer.make_train_function = _originals["make_train_function"]
    trainer.make_test_function = _originals["make_test_function"]
    trainer._maybe_symbolic_build = _originals["_maybe_symbolic_build"]
    _installed = False


# ---------------------------------------------------------------------------
# TensorFlow private API.
# ---------------------------------------------------------------------------


def keep_on_read_variables_per_replica(strategy, compute_devices) -> None:
    """Makes `strategy` create ON_READ variables as one copy per compute device.

    Upstream (keras-team/keras#21054): Keras 3 implements `Variable.assign_add`
    as `assign(self + value)`. CentralStorageStrategy wraps every variable,
    metric state included, in an `AggregatingVariable` on the parameter device
    that SUMs the values assigned by all replicas, so each metric update
    becomes `N * old + sum(updates)` and metrics under CentralStorageStrategy
    grow without bound (accuracy 0.137 where single-device gives 0.122 on the
    bundled digits). MirroredStrategy keeps such state per replica
    (`SyncOnReadVariable`), which is also what metrics want here: local
    updates, summed when read. Verified on TensorFlow 2.16 to 2.21.
    """
    from tensorflow.python.distribute import distribute_utils

    extended = strategy.extended
    original = extended._create_variable

    def create_variable(next_creator, **kwargs):
        if kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ:
            return original(next_creator, **kwargs)
        kwargs.pop("colocate_with", None)

        def per_device_creator(**kw):
            values = []
            for i, device in enumerate(compute_devices):
                with tf.device(device):
                    if i > 0:
                        kw["name"] = "%s/replica_%d/" % (values[0].name.split(":")[0], i)
                    values.append(next_creator(**kw))
            return values

        return distribute_utils.create_mirrored_variable(
            strategy,
            per_device_creator,
            distribute_utils.VARIABLE_CLASS_MAPPING,
            distribute_utils.VARIABLE_POLICY_MAPPING,
            **kwargs,
        )

    extended._create_variable = create_variable


_next_collective_key_base = [0]


def isolate_collective_keys(strategy) -> None:
    """Gives `strategy` collective group keys no other strategy in the process uses.

    Upstream (tensorflow/tensorflow#61314, #62790): every MirroredStrategy and
    MultiWorkerMirroredStrategy starts its collective group keys at 1, so a
    second strategy over a different device set in the same process (a
    notebook, a test suite, a hyper-parameter loop) joins the first one's group
    and fails with "Device ... is joining a group with size 4, but that group
    has size 2". Call before the strategy's `__init__`; processes of one
    multi-worker job create their strategies in the same order, so their keys
    still agree. Verified on TensorFlow 2.16 to 2.21.
    """
    _next_collective_key_base[0] += 100_000
    strategy._collective_key_base = _next_collective_key_base[0]

"""The step engine: one training step per replica, composed, for every strategy."""

from __future__ import annotations

from tfdist._compat import keras as kc
from tfdist.engine.custom import CustomTrainStep
from tfdist.engine.loop import make_host_function
from tfdist.engine.step import TrainStep


def model_features(model) -> list[str]:
    """The features a compiled model uses that a strategy may not run, in checking order.

    The vocabulary of `TfdistStrategy.unsupported(feature, model)`.
    """
    optimizer = model.optimizer
    options = model.distribute_strategy.options
    used = []
    if options.accumulation_steps > 1:
        used.append("accumulation_steps")
    if options.jit_compile or model.jit_compile is True:
        used.append("jit_compile")
    if any(getattr(layer, "synchronized", False) for layer in kc.all_layers(model)):
        used.append("synchronized_batchnorm")
    used.append("step_options")
    if kc.has_custom_train_step(model):
        used.append("custom_train_step")
    if kc.is_loss_scale_optimizer(optimizer):
        used.append("loss_scale_optimizer")
    if kc.keras_accumulation_steps(optimizer):
        used.append("keras_accumulation")
    if getattr(kc.inner_optimizer(optimizer), "use_ema", False):
        used.append("ema")
    used.append("optimizer")
    return used


def validate_compiled_model(model) -> None:
    """Raises `NotImplementedError` for a compile configuration the strategy does not run.

    Asks the strategy about each feature the model uses
    (`TfdistStrategy.unsupported`); the first refusal is raised with the
    strategy's message, which names the combination and the fix.
    """
    optimizer = model.optimizer
    if optimizer is None:
        return
    strategy = model.distribute_strategy
    options = strategy.options
    keras_steps = kc.keras_accumulation_steps(optimizer)
    if keras_steps and options.accumulation_steps > 1:
        raise NotImplementedError(
            "Gradient accumulation is set twice: Optimizer(gradient_accumulation_steps="
            f"{keras_steps}) and the strategy option accumulation_steps="
            f"{options.accumulation_steps}. Set one of them."
        )
    for feature in model_features(model):
        reason = strategy.unsupported(feature, model)
        if reason is not None:
            raise NotImplementedError(reason)


def make_train_function(model):
    """The function Keras's `fit` calls per host call, for a tfdist model."""
    validate_compiled_model(model)
    if kc.has_custom_train_step(model):
        # The user's own train_step runs per replica, as in Keras; its
        # optimizer.apply runs the engine's reduction and update.
        step_fn = CustomTrainStep(model)
    else:
        step_fn = TrainStep(model)
    return make_host_function(model, step_fn, model.steps_per_execution)


def make_test_function(model):
    """The function Keras's `evaluate` calls per host call, for a tfdist model."""
    strategy = model.distribute_strategy

    def step_fn(data):
        strategy.run(model.test_step, args=(data,))

    return make_host_function(model, step_fn, model.steps_per_execution)


__all__ = ["CustomTrainStep", "model_features", "validate_compiled_model", "TrainStep", "make_host_function", "make_test_function", "make_train_function"]

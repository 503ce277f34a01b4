"""The step engine: one training step per replica, composed, for every strategy."""

from __future__ import annotations

from tfdist._compat import keras as kc
from tfdist.engine.custom import CustomTrainStep
from tfdist.engine.loop import make_host_function
from tfdist.engine.step import TrainStep


def validate_compiled_model(model) -> None:
    """Raises `NotImplementedError` for a compile configuration the engine does not run.

    Loss scaling (`LossScaleOptimizer`), Keras's gradient accumulation, XLA
    and the step options run in the engine; what remains unsupported is named
    here with the combination.
    """
    optimizer = model.optimizer
    if optimizer is None:
        return
    strategy = model.distribute_strategy
    options = strategy.options
    keras_steps = kc.keras_accumulation_steps(optimizer)
    if strategy.gradient_path == "parameter_server":
        _validate_parameter_server(model, options)
    if keras_steps and options.accumulation_steps > 1:
        raise NotImplementedError(
            "Gradient accumulation is set twice: Optimizer(gradient_accumulation_steps="
            f"{keras_steps}) and the strategy option accumulation_steps="
            f"{options.accumulation_steps}. Set one of them."
        )


def _validate_parameter_server(model, options) -> None:
    # Workers step asynchronously, each on its own batch: there is no global
    # batch to accumulate over, to synchronise statistics over, or to compile
    # collectives around. (LossScaleOptimizer and Keras's accumulation are
    # refused by tfdist.engine.parameter_server itself.)
    unsupported = []
    if options.accumulation_steps > 1:
        unsupported.append(f"accumulation_steps={options.accumulation_steps}")
    if options.jit_compile or model.jit_compile is True:
        unsupported.append("jit_compile=True")
    if any(getattr(layer, "synchronized", False) for layer in kc.all_layers(model)):
        unsupported.append("BatchNormalization(synchronized=True)")
    if unsupported:
        raise NotImplementedError(
            f"{unsupported[0]} under strategy 'parameter_server' is not supported: workers "
            "update the variables asynchronously, one batch at a time, with no global batch. "
            "Use a synchronous strategy (mirrored, multi_worker, ...) for this feature."
        )


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


__all__ = ["CustomTrainStep", "TrainStep", "make_host_function", "make_test_function", "make_train_function"]

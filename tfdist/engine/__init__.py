"""The step engine: one training step per replica, composed, for every strategy."""

from __future__ import annotations

from tfdist import keras_integration as ki
from tfdist.engine.loop import make_host_function
from tfdist.engine.step import TrainStep


def validate_compiled_model(model) -> None:
    """Raises `NotImplementedError` for a compile configuration the engine does not run."""
    optimizer = model.optimizer
    if optimizer is None:
        return
    if ki.is_loss_scale_optimizer(optimizer):
        raise NotImplementedError(
            "LossScaleOptimizer (mixed_float16 loss scaling) under tfdist strategies "
            "is not supported yet. Train in float32 or mixed_bfloat16."
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise NotImplementedError(
            "Optimizer(gradient_accumulation_steps=...) under tfdist strategies is not "
            "supported yet. Use a larger global batch instead."
        )


def make_train_function(model):
    """The function Keras's `fit` calls per host call, for a tfdist model."""
    validate_compiled_model(model)
    if ki.has_custom_train_step(model):
        # The user's own train_step runs per replica, as in Keras; its optimizer
        # reduces gradients itself. Engine options do not apply to it.
        strategy = model.distribute_strategy

        def step_fn(data):
            strategy.run(model.train_step, args=(data,))
    else:
        step_fn = TrainStep(model)
    return make_host_function(model, step_fn, model.steps_per_execution)


def make_test_function(model):
    """The function Keras's `evaluate` calls per host call, for a tfdist model."""
    strategy = model.distribute_strategy

    def step_fn(data):
        strategy.run(model.test_step, args=(data,))

    return make_host_function(model, step_fn, model.steps_per_execution)


__all__ = ["TrainStep", "make_host_function", "make_test_function", "make_train_function"]

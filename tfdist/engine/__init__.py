"""The step engine: one training step per replica, composed, for every strategy.

From `model.fit` to the variable update a step passes through four modules:
`tfdist.keras_integration` (Keras's `make_train_function` returns the engine's
function) → `loop` (the host call: validation, `steps_per_execution` steps
in one `tf.while_loop`) → `step` (`TrainStep`'s phases and the strategy's
`GradientPath`) → `update` (the gradient chain and Keras's update order,
written once).
"""

from __future__ import annotations

from tfdist.engine.custom import CustomTrainStep
from tfdist.engine.loop import (
    make_host_function,
    make_test_function,
    make_train_function,
    model_features,
    validate_compiled_model,
)
from tfdist.engine.step import TrainStep

__all__ = ["CustomTrainStep", "model_features", "validate_compiled_model", "TrainStep", "make_host_function", "make_test_function", "make_train_function"]

"""Compile-time refusals of the step engine: unsupported combinations name themselves."""

from __future__ import annotations

import keras
import pytest

from tests.engine.common import make_strategy


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


@pytest.mark.parametrize(
    "options,feature",
    [({"accumulation_steps": 2}, "accumulation_steps"), ({"jit_compile": True}, "jit_compile")],
)
def test_custom_train_step_with_an_engine_feature_raises(options, feature):
    with make_strategy("mirrored", **options).scope():
        model = OwnStep([keras.Input((4,)), keras.layers.Dense(2)])
        with pytest.raises(NotImplementedError) as info:
            model.compile(optimizer="sgd", loss="mse")
    assert str(info.value) == (
        f"A custom train_step combined with {feature} is not supported under tfdist "
        "strategies: OwnStep.train_step runs as written, per replica, and the engine's step "
        "features do not reach into it. Drop the custom train_step or the feature."
    )

"""Strategies declare what they run: `unsupported(feature, model)` is what validation consults (issue 14)."""

from __future__ import annotations

import keras
import pytest

import tfdist
from tests.conftest import DEVICES
from tfdist.engine import model_features
from tfdist.strategies.mirrored import MirroredStrategy


class NoXlaMirrored(MirroredStrategy):
    """A strategy that declares one feature unsupported and nothing else."""

    def unsupported(self, feature, model=None):
        if feature == "jit_compile":
            return f"jit_compile is not run by {type(self).__name__} (model {model.name!r})."
        return None


def _compile_under(strategy, **compile_kwargs):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="tiny")
        model.compile(optimizer="adam", loss="mse", **compile_kwargs)
    return model


def test_validation_raises_the_strategys_own_declared_reason():
    strategy = NoXlaMirrored(DEVICES[2])
    model = _compile_under(strategy)  # no XLA: nothing declared unsupported
    assert "jit_compile" not in model_features(model)
    with pytest.raises(NotImplementedError) as info:
        _compile_under(NoXlaMirrored(DEVICES[2]), jit_compile=True)
    assert str(info.value) == "jit_compile is not run by NoXlaMirrored (model 'tiny')."


def test_synchronous_strategies_run_every_feature_and_the_others_name_theirs():
    mirrored = tfdist.get_strategy("mirrored", devices=DEVICES[2])
    sharded = tfdist.get_strategy("sharded_optimizer", devices=DEVICES[2])
    features = ["accumulation_steps", "jit_compile", "synchronized_batchnorm", "step_options",
                "custom_train_step", "loss_scale_optimizer", "keras_accumulation", "ema", "estimator"]
    assert [mirrored.unsupported(f) for f in features] == [None] * len(features)
    assert not mirrored.asynchronous and not sharded.asynchronous
    assert sharded.unsupported("estimator").startswith(
        "Strategy 'sharded_optimizer' is not supported by tfdist.estimator yet"
    )
    assert sharded.unsupported("loss_scale_optimizer").startswith("LossScaleOptimizer (mixed_float16")
    assert sharded.unsupported("custom_train_step") is None


def test_the_parameter_server_answers_questions_about_itself_alone():
    # The Estimator runner asks with no model; it runs parameter-server jobs.
    from tfdist.engine.parameter_server import unsupported_feature

    assert unsupported_feature("estimator", None) is None
    assert unsupported_feature("jit_compile", None) is None


def test_model_features_lists_what_the_compiled_model_uses():
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[2], accumulation_steps=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(use_ema=True), loss="mse", jit_compile=True)
    assert model_features(model) == ["accumulation_steps", "jit_compile", "step_options", "ema", "optimizer"]

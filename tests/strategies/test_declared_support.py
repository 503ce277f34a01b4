"""Strategies declare what they run: `unsupported(feature, model)` is what validation consults (issue 14)."""

from __future__ import annotations

import keras
import pytest

import tfdist
import tfdist.engine.update  # noqa: F401
from tests.conftest import DEVICES
from tfdist.engine import loop, model_features
from tfdist.engine import step as paths
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
    assert sharded.unsupported("loss_scale_optimizer") is None  # mixed_float16: the inner optimizer is sharded
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


class CountingPlacement(tfdist.engine.update.EveryCopy):
    """Every copy, as mirrored does, counting the variables placed (at trace time)."""

    placed: list = []

    def run(self, variable, fn, *args):
        CountingPlacement.placed.append(variable.path)
        super().run(variable, fn, *args)


class TracedPathMirrored(MirroredStrategy):
    """Mirrored with a gradient path object of its own: the engine runs what the strategy carries."""

    paths_run: list = []

    def _run_path(step, data):  # noqa: N805  (a plain function stored on the path)
        TracedPathMirrored.paths_run.append(step.strategy.num_replicas_in_sync)
        paths.all_reduce(step, data)

    gradient_path = paths.GradientPath("traced_all_reduce", _run_path, CountingPlacement)


def test_the_engine_runs_the_gradient_path_and_placement_the_strategy_carries():
    import numpy as np

    TracedPathMirrored.paths_run.clear()
    CountingPlacement.placed.clear()
    strategy = TracedPathMirrored(DEVICES[2])
    model = _compile_under(strategy)
    x = np.ones((32, 4), "float32")
    model.fit(x, x[:, :2], batch_size=16, epochs=2, verbose=0)
    # Traced once (one host function, two replicas); each of the 2 variables placed once.
    assert TracedPathMirrored.paths_run == [2]
    assert sorted(CountingPlacement.placed) == sorted(v.path for v in model.trainable_variables)
    assert len(CountingPlacement.placed) == 2
    assert model.optimizer.iterations.numpy() == 4


def test_strategies_carry_their_path_placement_and_host_loop_as_objects():
    from tfdist.engine import parameter_server as ps_engine
    from tfdist.strategies.central_storage import CentralStorageStrategy
    from tfdist.strategies.parameter_server import ParameterServerStrategy
    from tfdist.strategies.sharded_optimizer import ShardedOptimizerStrategy

    assert MirroredStrategy.gradient_path is paths.ALL_REDUCE
    assert CentralStorageStrategy.gradient_path is paths.REDUCE_TO_VARIABLES
    assert ShardedOptimizerStrategy.gradient_path.name == "sharded_optimizer"
    assert ParameterServerStrategy.gradient_path is ps_engine.PARAMETER_SERVER
    assert isinstance(ParameterServerStrategy.gradient_path.placement(None), tfdist.engine.update.InPlace)
    assert MirroredStrategy.host_loop is loop.KERAS_FIT and loop.KERAS_FIT.method("fit") is None
    assert ParameterServerStrategy.host_loop.method("fit") is ps_engine.fit
    assert ParameterServerStrategy.host_loop.method("predict") is ps_engine.predict


def test_a_compressed_exchange_is_refused_where_no_all_reduce_carries_it():
    central = tfdist.get_strategy("central_storage", compute_devices=DEVICES[2], allreduce_dtype="bfloat16")
    assert central.unsupported("step_options") == (
        "allreduce_dtype='bfloat16' is not used by the 'central_storage' strategy: its gradients are summed "
        "onto the parameter device by a reduce, not an all-reduce, and cross devices in float32. Use "
        "'mirrored' or 'multi_worker' for a compressed exchange, or leave allreduce_dtype='float32'."
    )
    stage2 = tfdist.get_strategy("sharded_optimizer", devices=DEVICES[2], stage=2, allreduce_dtype="float16")
    assert stage2.unsupported("step_options") == (
        "allreduce_dtype='float16' is not used by the 'sharded_optimizer' strategy at stage=2: its "
        "reduce-scatter exchanges float32. Use stage=1 (whose all-reduce it compresses), or leave "
        "allreduce_dtype='float32'."
    )
    stage1 = tfdist.get_strategy("sharded_optimizer", devices=DEVICES[2], stage=1, allreduce_dtype="float16")
    assert stage1.unsupported("step_options") is None
    with pytest.raises(NotImplementedError, match="not used by the 'central_storage' strategy"):
        _compile_under(central)

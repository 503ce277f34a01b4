"""Mixed precision: the `precision` option and dynamic loss scaling across replicas."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.engine.common import make_strategy, tiny_model
from tests.strategies import custom_loop


def test_precision_option_sets_the_policy_of_layers_built_in_scope_only():
    with make_strategy("mirrored", precision="mixed_bfloat16").scope():
        inside = tiny_model()
    outside = tiny_model()
    assert [layer.dtype_policy.name for layer in inside.layers] == ["mixed_bfloat16"] * 3
    assert inside.layers[0].compute_dtype == "bfloat16"
    assert {w.dtype for w in inside.weights} == {"float32"}  # master copies stay float32
    assert [layer.dtype_policy.name for layer in outside.layers] == ["float32"] * 3


def test_precision_option_rejects_unknown_values():
    with pytest.raises(tfdist.OptionError) as info:
        make_strategy("mirrored", precision="float16")
    assert str(info.value) == (
        "option 'precision' must be one of 'float32', 'mixed_float16', 'mixed_bfloat16'. "
        "Received: precision='float16'"
    )


def _replica_values(variable):
    """Every copy of a variable: one per replica (mirrored) or the one (central storage)."""
    values = getattr(variable.value, "values", None)
    return [v.numpy() for v in values] if values else [variable.numpy()]


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_inf_on_one_replica_skips_the_step_on_every_replica_and_halves_the_scale(name, digits):
    x, y = digits
    x, y = x[:32].copy(), y[:32]
    bad = x.copy()
    bad[9] = 1e30  # replica 1's share (samples 8-15); inf once cast to float16
    strategy = make_strategy(name, precision="mixed_float16")
    with strategy.scope():
        model = tiny_model()
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    initial = model.get_weights()

    model.fit(bad, y, batch_size=32, shuffle=False, verbose=0)
    assert float(np.asarray(optimizer.dynamic_scale)) == 2.0**14
    assert int(np.asarray(optimizer.iterations)) == 0
    for variable, start in zip(model.trainable_variables, initial):
        for copy in _replica_values(variable):
            np.testing.assert_array_equal(copy, start)

    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert float(np.asarray(optimizer.dynamic_scale)) == 2.0**14
    assert int(np.asarray(optimizer.step_counter)) == 1
    assert int(np.asarray(optimizer.iterations)) == 1
    assert not np.array_equal(model.get_weights()[0], initial[0])


def test_loss_scale_grows_after_dynamic_growth_steps_finite_steps(digits):
    x, y = digits
    with make_strategy("mirrored", precision="mixed_float16").scope():
        model = tiny_model(
            lambda: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=8.0, dynamic_growth_steps=2
            )
        )
    model.fit(x[:96], y[:96], batch_size=32, shuffle=False, verbose=0)  # 3 finite steps
    assert float(np.asarray(model.optimizer.dynamic_scale)) == 16.0
    assert int(np.asarray(model.optimizer.step_counter)) == 1


@pytest.mark.parametrize("built", [True, False], ids=["built", "built_in_step"])
@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_custom_loop_with_a_loss_scale_optimizer_trains_as_on_one_device(name, built):
    # Keras's LossScaleOptimizer.apply gates the update with a cond whose branch
    # runs call_for_each_replica: in a compiled custom loop under MirroredStrategy
    # that failed once the scale changed ("You must feed a value for placeholder
    # tensor"), under CentralStorageStrategy at the first step. The loop grows the
    # scale every 2 finite steps, and row 72 (replica 0's share of the third
    # batch) overflows the gradient to inf, so that step is skipped on every
    # replica and the scale halved.
    def optimizer_fn():
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=1024.0, dynamic_growth_steps=2
        )

    def train(strategy):
        return custom_loop.train(strategy, optimizer_fn, build_first=built, overflow_row=72, epochs=2)

    reference, ref_optimizer, one_device_scales = train(tf.distribute.get_strategy())
    # Grown after 2 finite steps, halved at the overflow, on one device:
    assert one_device_scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0]
    assert int(ref_optimizer.iterations.numpy()) == 6  # two of the 8 steps skipped

    model, optimizer, scales = train(make_strategy(name, replicas=2))
    assert scales == one_device_scales
    assert _replica_values(optimizer.dynamic_scale) == [np.float32(1024.0)] * (2 if name == "mirrored" else 1)
    assert int(optimizer.iterations.numpy()) == 6
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)

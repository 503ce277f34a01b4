"""Compressed exchange: the `allreduce_dtype` step option in tfdist.collectives.all_reduce_sum."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import DEVICES
from tests.engine.common import max_relative_difference, tiny_model
from tfdist import collectives
from tfdist.engine.step import TrainStep
from tfdist.options import OptionError

# Stated parity cost (docs/multi_worker.md, "Compressed exchange"): after 3
# epochs of digits (84 steps, 2 replicas, batch 64, SGD 0.1) the weights are
# within this max relative difference of float32 exchange. Measured: 0.0038
# (bfloat16) and 0.0052 (float16) for this model; 1.5e-4 to 7.9e-3 across seeds
# and widths.
PARITY_TOLERANCE = 1e-2


def _mirrored(allreduce_dtype: str):
    return tfdist.get_strategy("mirrored", devices=DEVICES[2], allreduce_dtype=allreduce_dtype)


def _collective_input_dtypes(graph) -> list:
    """Input dtypes of every CollectiveReduceV2 in `graph` and the functions it calls."""
    found = [op.inputs[0].dtype.name for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    for fn in graph._functions.values():
        inner = getattr(fn, "graph", None)
        if inner is not None:
            found += _collective_input_dtypes(inner)
    return found


def test_allreduce_dtype_defaults_to_float32_and_rejects_other_dtypes(monkeypatch):
    monkeypatch.delenv("TFDIST_ALLREDUCE_DTYPE", raising=False)
    assert tfdist.get_strategy("mirrored", devices=DEVICES[1]).options.allreduce_dtype == "float32"
    with pytest.raises(OptionError) as e:
        tfdist.get_strategy("mirrored", devices=DEVICES[1], allreduce_dtype="int8")
    assert str(e.value) == (
        "option 'allreduce_dtype' must be one of 'float32', 'bfloat16', 'float16'. "
        "Received: allreduce_dtype='int8'"
    )


def test_allreduce_dtype_from_toml_preset_and_environment(tmp_path, monkeypatch):
    preset = tmp_path / "compressed.toml"
    preset.write_text('strategy = "mirrored"\nallreduce_dtype = "bfloat16"\ndevices = ["/cpu:0", "/cpu:1"]\n')
    assert tfdist.from_config(str(preset)).options.allreduce_dtype == "bfloat16"
    monkeypatch.setenv("TFDIST_ALLREDUCE_DTYPE", "float16")
    assert tfdist.get_strategy("mirrored", devices=DEVICES[1]).options.allreduce_dtype == "float16"
    monkeypatch.setenv("TFDIST_ALLREDUCE_DTYPE", "fp8")
    with pytest.raises(OptionError) as e:
        tfdist.get_strategy("mirrored", devices=DEVICES[1])
    assert str(e.value) == (
        "environment variable TFDIST_ALLREDUCE_DTYPE: option 'allreduce_dtype' must be one of "
        "'float32', 'bfloat16', 'float16'. Received: allreduce_dtype='fp8'"
    )


@pytest.mark.parametrize("allreduce_dtype,wire_bytes_per_element", [
    ("float32", 4), ("bfloat16", 2), ("float16", 2),
])
def test_collectives_carry_the_compressed_dtype_and_half_the_bytes(allreduce_dtype, wire_bytes_per_element, digits):
    x, y = digits
    strategy = _mirrored(allreduce_dtype)
    with strategy.scope():
        model = tiny_model(hidden=16)
        model.optimizer.build(model.trainable_variables)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(32))))
    before = collectives.trace_counter["all_reduce_bytes"]
    graph = tf.function(TrainStep(model)).get_concrete_function(batch).graph
    # One 25-MiB bucket per replica: 64*16 + 16 + 16*10 + 10 gradients and the batch weight.
    assert _collective_input_dtypes(graph) == [allreduce_dtype] * 2
    elements = 64 * 16 + 16 + 16 * 10 + 10 + 1
    assert collectives.trace_counter["all_reduce_bytes"] - before == 2 * elements * wire_bytes_per_element


def test_compressed_training_is_within_stated_tolerance_of_float32(digits):
    x, y = digits
    models = {}
    for allreduce_dtype in ("float32", "bfloat16", "float16"):
        with _mirrored(allreduce_dtype).scope():
            models[allreduce_dtype] = tiny_model(hidden=32)
        models[allreduce_dtype].fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    for allreduce_dtype in ("bfloat16", "float16"):
        difference = max_relative_difference(models["float32"], models[allreduce_dtype])
        # Above 1e-5: the exchange really was rounded (float32 runs agree to ~1e-7).
        assert 1e-5 < difference < PARITY_TOLERANCE, (allreduce_dtype, difference)


@pytest.mark.parametrize("allreduce_dtype", ["float16", "bfloat16"])
def test_float16_exchange_is_prescaled_so_a_sum_past_65504_stays_finite(allreduce_dtype):
    strategy = _mirrored(allreduce_dtype)

    @tf.function
    def step():
        return strategy.run(lambda: collectives.all_reduce_sum([tf.fill([4], 61440.0)], 0, allreduce_dtype))

    with strategy.scope():
        (summed,) = strategy.experimental_local_results(step())[0]
    # 2 * 61440 overflows float16 (max 65504) unless each replica sends 61440 / 2 (exact in both dtypes).
    np.testing.assert_array_equal(summed.numpy(), [122880.0] * 4)
    assert summed.dtype == tf.float32

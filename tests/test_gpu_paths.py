"""TensorFlow's GPU-only strategy branches, forced on CPU: every strategy and step option trains as without them.

TensorFlow decides some strategy paths by device type (docs/gpu.md). Where
every replica is a GPU, `mirrored_run.call_for_each_replica` calls a
jit-compiled function passed to `strategy.run` in each replica thread instead
of lifting it into the caller's graph, and `MirroredExtended._use_merge_call`
is False inside XLA (replica-context all-reduces and variable writes skip
`merge_call`). `tfdist._compat.tf.devices_read_as_gpu` makes TensorFlow's
`_is_gpu_device` predicates say GPU for the CPU devices, so the suite runs
those branches. Each cell trains a model with BatchNorm (state written by the
forward pass; with one replica, Dropout too) with several step options at once,
with and without the forced branch, and asserts the same weights; a
combination a strategy refuses is asserted by its exact message.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest

import tfdist
from tests.conftest import DEVICES
from tfdist._compat import tf as tfc

SAMPLES = 64  # two global batches of 32: one host call at sink_size=2, one update at accumulation_steps=2


def _strategy(row: str, replicas: int, **options):
    name, _, stage = row.partition(" stage=")
    if stage:
        options["stage"] = int(stage)
    if name == "central_storage":
        return tfdist.get_strategy(name, compute_devices=DEVICES[replicas], **options)
    return tfdist.get_strategy(name, devices=DEVICES[replicas], **options)


def _model(dropout: bool = True, **compile_kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(16, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Activation("relu"),
            *([keras.layers.Dropout(0.25)] if dropout else []),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    return model


def _fit(row, replicas, how, forced, options, data) -> tuple[keras.Model, dict]:
    x, y = data
    strategy = _strategy(row, replicas, **options, **({"jit_compile": True} if how == "option" else {}))
    with strategy.scope():
        # Dropout's seed state is written by the pass like BatchNorm's statistics: one
        # replica's whole-step program is where that differs (two replicas write both alike).
        model = _model(dropout=replicas == 1, **({"jit_compile": True} if how == "compile" else {}))
    with tfc.devices_read_as_gpu() if forced else contextlib.nullcontext():
        history = model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    return model, history.history


ROWS = ["mirrored", "central_storage", "sharded_optimizer stage=1", "sharded_optimizer stage=2",
        "sharded_optimizer stage=3"]

# (row, replicas, how jit_compile is asked for, step options). One replica without
# accumulation is the whole step as one XLA program (mirrored; sharded stages 1 and 2,
# which train as mirrored with one replica); central_storage and stage 3 compile the
# forward and backward pass alone (their variables are not on the replica's device), as
# accumulation does; two replicas compile each replica's pass.
CELLS = [
    ("mirrored", 1, "option", {"precision": "mixed_bfloat16", "sink_size": 2}),
    ("mirrored", 1, "compile", {"precision": "mixed_float16"}),  # the loss-scale gate in the program
    ("central_storage", 1, "compile", {"precision": "mixed_bfloat16", "sink_size": 2, "accumulation_steps": 2}),
    ("sharded_optimizer stage=1", 1, "option", {"sink_size": 2}),
    ("sharded_optimizer stage=2", 1, "compile", {"precision": "mixed_bfloat16"}),
    ("sharded_optimizer stage=3", 1, "option", {"precision": "mixed_bfloat16", "sink_size": 2, "accumulation_steps": 2}),
] + [
    (row, 2, how, {"precision": "mixed_bfloat16", "sink_size": 2, "accumulation_steps": 2})
    for row, how in zip(ROWS, ["option", "compile", "compile", "option", "compile"])
]


@pytest.mark.parametrize("row,replicas,how,options", CELLS, ids=lambda v: str(v).replace(" ", ""))
def test_forced_gpu_branch_trains_the_same_weights(row, replicas, how, options, digits):
    # Before the fix, every one-replica whole-step cell raised "`merge_call` called while
    # defining a new graph or a tf.function" under the forced branch, as on an H200.
    data = digits[0][:SAMPLES], digits[1][:SAMPLES]
    reference, reference_logs = _fit(row, replicas, how, False, options, data)
    model, logs = _fit(row, replicas, how, True, options, data)
    assert tfdist.engine.step.uses_xla(model)
    reference, weights = reference.get_weights(), model.get_weights()
    assert len(weights) == len(reference)
    # The same program on the same device: equal to the bit but for XLA's fusion order.
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, weights))
    assert difference <= 1e-6, f"max |difference| {difference}"
    np.testing.assert_allclose(logs["loss"], reference_logs["loss"], rtol=1e-6)
    np.testing.assert_allclose(logs["accuracy"], reference_logs["accuracy"], rtol=1e-6)


# Combinations the strategies refuse: asserted with their messages, under the forced branch.
REFUSED = {
    ("central_storage", "allreduce_dtype"): (
        "allreduce_dtype='bfloat16' is not used by the 'central_storage' strategy: its gradients are "
        "summed onto the parameter device by a reduce, not an all-reduce, and cross devices in float32. "
        "Use 'mirrored' or 'multi_worker' for a compressed exchange, or leave allreduce_dtype='float32'."
    ),
    ("sharded_optimizer stage=2", "allreduce_dtype"): (
        "allreduce_dtype='bfloat16' is not used by the 'sharded_optimizer' strategy at stage=2: its "
        "reduce-scatter exchanges float32. Use stage=1 (whose all-reduce it compresses), or leave "
        "allreduce_dtype='float32'."
    ),
    ("sharded_optimizer stage=3", "allreduce_dtype"): (
        "allreduce_dtype='bfloat16' is not used by the 'sharded_optimizer' strategy at stage=3: each "
        "shard's gradient is summed onto the shard's device in float32, with no all-reduce to compress. "
        "Use stage=1, or leave allreduce_dtype='float32'."
    ),
}


@pytest.mark.parametrize("row", [r for r, _ in REFUSED])
def test_forced_gpu_branch_refuses_what_the_strategy_refuses(row):
    with tfc.devices_read_as_gpu():
        strategy = _strategy(row, 2, jit_compile=True, allreduce_dtype="bfloat16")
        with strategy.scope():
            with pytest.raises(NotImplementedError) as info:
                _model()
    assert str(info.value) == REFUSED[row, "allreduce_dtype"]

"""One replica runs no collective and no bucket packing, and no weighting pass (issue 16)."""

from __future__ import annotations

import collections

import keras
import numpy as np

from tests.engine.common import make_strategy, max_relative_difference
from tests.engine.test_xla import _fit_and_collect_executed_ops


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
    model.compile(keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_one_replica_step_has_no_collective_and_no_gradient_passes_beyond_keras():
    rng = np.random.RandomState(0)
    x, y = rng.normal(size=(64, 16)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")
    reference = _model()
    reference_ops = collections.Counter(n.op for n in _fit_and_collect_executed_ops(reference, x, y))
    with make_strategy("mirrored", replicas=1).scope():
        model = _model()
    ops = collections.Counter(n.op for n in _fit_and_collect_executed_ops(model, x, y))
    assert max_relative_difference(reference, model) < 1e-6
    assert sum(c for op, c in ops.items() if op.startswith(("Collective", "Nccl"))) == 0
    # No bucket packing (concat/split of the gradients) and no per-gradient
    # weighting (MulNoNan, one per gradient with 2 replicas) beyond plain Keras's step.
    for op in ("ConcatV2", "Split", "SplitV", "MulNoNan"):
        assert ops[op] <= reference_ops[op], (op, ops[op], reference_ops[op])

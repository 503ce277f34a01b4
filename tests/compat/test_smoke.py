"""The parity smoke: every local strategy and every step option against one device.

Run by `make test` on the newest declared TensorFlow and Keras (the suite's own
environment) and by `make test-compat` in a virtualenv at the oldest declared
versions (`tests/compat/build_oldest.sh`), so both ends of the range
`setup.py` declares train as one device does.

One model (the digits MLP, 64 → 16 → 10, Adam: its slots and update are the
optimizer API Keras changed most across releases), 4 steps of a global batch
of 32 on 2 replicas, compared after `fit` with single-device Keras on the
same batches: weights within the cell's tolerance and the optimizer's
iteration count exact. multi_worker trains as 2 processes with real
TensorFlow servers on 127.0.0.1 (`tfdist.launch.run_job`).
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np
import pytest

import tfdist
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.conftest import DEVICES, max_relative_difference

SAMPLES = 128  # 4 steps of a global batch of 32
BATCH = 32
STEPS = SAMPLES // BATCH
FLOAT32 = 1e-5  # float32 sums in another order
XLA = 1e-4  # XLA-fused float32 kernels vs TensorFlow's
BFLOAT16 = 3e-2  # bfloat16 compute (7-bit mantissa) on 16-sample shares vs the 32-sample batch


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _one_device(x, y, policy=None) -> tuple[list, dict, dict]:
    """Weights, the epoch's logs and `evaluate`'s, trained on one device."""
    previous = keras.config.dtype_policy()
    if policy is not None:
        keras.config.set_dtype_policy(policy)
    try:
        model = _model()
    finally:
        keras.config.set_dtype_policy(previous)
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    logs = {k: v[-1] for k, v in history.history.items()}
    return model.get_weights(), logs, model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)


@pytest.fixture(scope="module")
def data(digits):
    x, y = digits
    return x[:SAMPLES], y[:SAMPLES]


@pytest.fixture(scope="module")
def references(data):
    x, y = data
    return {None: _one_device(x, y), "mixed_bfloat16": _one_device(x, y, "mixed_bfloat16")}


# cell id: (strategy name, strategy arguments, one-device dtype policy, tolerance)
CELLS = {
    "mirrored": ("mirrored", {}, None, FLOAT32),
    "central_storage": ("central_storage", {}, None, FLOAT32),
    "sharded_optimizer stage=1": ("sharded_optimizer", {"stage": 1}, None, FLOAT32),
    "sharded_optimizer stage=2": ("sharded_optimizer", {"stage": 2}, None, FLOAT32),
    "sharded_optimizer stage=3": ("sharded_optimizer", {"stage": 3}, None, FLOAT32),
    "mirrored jit_compile=True": ("mirrored", {"jit_compile": True}, None, XLA),
    "mirrored sink_size=2": ("mirrored", {"sink_size": 2}, None, FLOAT32),
    "mirrored accumulation_steps=2": ("mirrored", {"accumulation_steps": 2}, None, FLOAT32),
    "mirrored precision=mixed_bfloat16": ("mirrored", {"precision": "mixed_bfloat16"}, "mixed_bfloat16", BFLOAT16),
}


def _strategy(name: str, **options):
    devices = DEVICES[2]
    if name == "central_storage":
        return tfdist.get_strategy(name, compute_devices=devices, **options)
    return tfdist.get_strategy(name, devices=devices, **options)


@pytest.mark.parametrize("cell", list(CELLS))
def test_local_strategy_and_step_option_train_as_one_device(cell, data, references):
    name, options, policy, tolerance = CELLS[cell]
    x, y = data
    strategy = _strategy(name, **options)
    with strategy.scope():
        model = _model()
    # Accumulation: each step's global batch is split into micro-batches, as one device's batch of 32.
    micro = BATCH // options.get("accumulation_steps", 1)
    history = model.fit(x, y, batch_size=micro, shuffle=False, verbose=0)
    weights, logs, evaluated = references[policy]
    assert int(np.asarray(model.optimizer.iterations)) == STEPS
    assert max_relative_difference(weights, model.get_weights()) <= tolerance
    # The logs too: Keras's metric variables changed how they synchronise across releases.
    assert {k: v[-1] for k, v in history.history.items()} == pytest.approx(logs, rel=tolerance, abs=tolerance)
    got = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert got == pytest.approx(evaluated, rel=tolerance, abs=tolerance)


_WORKER = """
import json, os, sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
import tfdist
sys.path.insert(0, sys.argv[2])
from tests.compat.test_smoke import SAMPLES, BATCH, _model

strategy = tfdist.get_strategy("multi_worker", collective_timeout=120.0)
x, y = tfdist.datasets.load_digits()
with strategy.scope():
    model = _model()
history = model.fit(x[:SAMPLES], y[:SAMPLES], batch_size=BATCH, shuffle=False, verbose=0)
task = strategy.cluster_config.task_id
np.savez(os.path.join(sys.argv[1], f"worker{task}.npz"), *model.get_weights())
with open(os.path.join(sys.argv[1], f"worker{task}.json"), "w") as f:
    json.dump({"replicas": strategy.num_replicas_in_sync, "iterations": int(model.optimizer.iterations.numpy()),
               "logs": {k: float(v[-1]) for k, v in history.history.items()}}, f)
"""


@pytest.mark.cluster
@pytest.mark.usefixtures("no_leftover_processes")
def test_multi_worker_two_processes_train_as_one_device(tmp_path, references):
    from tfdist.launch import run_job

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    status = run_job([sys.executable, str(script), str(tmp_path), root], workers=2, env=env, timeout=240)
    assert status == 0
    for task in (0, 1):
        with open(tmp_path / f"worker{task}.json") as f:
            result = json.load(f)
        assert result["logs"] == pytest.approx(references[None][1], rel=FLOAT32, abs=FLOAT32)
        assert (result["replicas"], result["iterations"]) == (2, STEPS)
        saved = np.load(tmp_path / f"worker{task}.npz")
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        assert max_relative_difference(references[None][0], weights) <= FLOAT32


def test_custom_train_step_evaluate_predict_and_save_under_mirrored(tmp_path):
    # A hand-written train_step (tape, compute_loss, optimizer.apply), evaluate, predict_on_batch,
    # int() of the iteration count and an atomic save: the integration's other hooks, at both ends.
    from tests.models.zoo import ZOO

    entry = ZOO["custom_step"]
    x, y = entry.data()
    reference = entry.make(seed=0, dropout=0.0)
    reference.fit(x, y, batch_size=entry.batch_size, shuffle=False, verbose=0)
    strategy = _strategy("mirrored")
    with strategy.scope():
        model = entry.make(seed=0, dropout=0.0)
    model.fit(x, y, batch_size=entry.batch_size, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == len(x) // entry.batch_size
    assert max_relative_difference(reference.get_weights(), model.get_weights()) <= entry.tolerance
    expected = reference.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)
    got = model.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)
    assert got == pytest.approx(expected, rel=1e-5)
    assert model.predict_on_batch(x[:5]).shape == (5, 1)
    path = str(tmp_path / "model.keras")
    model.save(path)
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]  # written to a temporary file, renamed
    reloaded = keras.models.load_model(path)
    assert max_relative_difference(model.get_weights(), reloaded.get_weights()) == 0.0

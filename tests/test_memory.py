"""tfdist.memory_report: bytes per device by kind, from the variables a model holds."""

from __future__ import annotations

import keras

import tfdist
from tests.conftest import DEVICES, build_model

# Dense(64 -> 32) and Dense(32 -> 10): kernels and biases.
PARAMETERS = 64 * 32 + 32 + 32 * 10 + 10
SCALARS = 8 + 4  # optimizer iteration (int64) and learning rate (float32)


def built(strategy=None, optimizer_fn=lambda: keras.optimizers.SGD(0.1, momentum=0.9)):
    def make():
        model = build_model(optimizer=optimizer_fn())
        model.optimizer.build(model.trainable_variables)
        return model

    if strategy is None:
        return make()
    with strategy.scope():
        return make()


def test_single_device_counts_every_variable_once_on_its_device():
    report = tfdist.memory_report(built())
    assert list(report) == ["/device:CPU:0"]
    entry = report["/device:CPU:0"]
    assert entry["weights"] == 4 * PARAMETERS
    assert entry["optimizer_state"] == 4 * PARAMETERS + SCALARS  # one momentum slot
    assert entry["parameter_shard"] == 0
    assert entry["gradient_buffers"] == 4 * PARAMETERS
    assert entry["total"] == 3 * 4 * PARAMETERS + SCALARS


def test_mirrored_holds_a_full_copy_on_every_replica():
    report = tfdist.memory_report(built(tfdist.get_strategy("mirrored", devices=DEVICES[2])))
    assert list(report) == ["/device:CPU:0", "/device:CPU:1"]
    for entry in report.values():
        assert (entry["weights"], entry["optimizer_state"]) == (4 * PARAMETERS, 4 * PARAMETERS + SCALARS)


def test_central_storage_holds_variables_and_summed_gradients_on_the_parameter_device():
    strategy = tfdist.get_strategy("central_storage", compute_devices=DEVICES[2], parameter_device="/cpu:1")
    report = tfdist.memory_report(built(strategy))
    entry = report["/device:CPU:1"]
    assert entry["weights"] == 4 * PARAMETERS
    assert entry["gradient_buffers"] == 4 * PARAMETERS
    assert report.get("/device:CPU:0", {}).get("weights", 0) == 0


def test_sharded_optimizer_splits_the_adam_state_into_even_slices():
    model = built(tfdist.get_strategy("sharded_optimizer", stage=1, devices=DEVICES[4]), keras.optimizers.Adam)
    report = tfdist.memory_report(model)
    shard = -(-PARAMETERS // 4)
    assert len(report) == 4
    for entry in report.values():
        assert entry["weights"] == 4 * PARAMETERS
        assert entry["optimizer_state"] == 2 * 4 * shard + SCALARS
        assert entry["parameter_shard"] == 4 * shard
        assert entry["gradient_buffers"] == 4 * PARAMETERS  # stage 1 all-reduces the whole gradient

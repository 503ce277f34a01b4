"""tfdist.memory_report: bytes per device by kind, from the variables a model holds."""

from __future__ import annotations

import keras

import tfdist
from tests.conftest import DEVICES, build_model
from tfdist import memory

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
        assert entry["parameter_shard"] == 0  # no float32 copy of the slice of float32 weights
        assert entry["gradient_buffers"] == 4 * PARAMETERS  # stage 1 all-reduces the whole gradient
        assert entry["peak"] is None  # CPU: TensorFlow keeps no per-device allocator statistics


def test_sharded_stage_2_holds_its_gradient_slice_and_two_buckets():
    # 2410 parameters on 4 replicas in 1024-byte buckets: 10 buckets of 4 chunks of 61.
    strategy = tfdist.get_strategy("sharded_optimizer", stage=2, devices=DEVICES[4], bucket_bytes=1024)
    report = tfdist.memory_report(built(strategy, keras.optimizers.Adam))
    for entry in report.values():
        assert entry["optimizer_state"] == 2 * 4 * 610 + SCALARS
        assert entry["gradient_buffers"] == 4 * (610 + 2 * 4 * 61)


def test_sharded_stages_reducing_layer_by_layer_hold_their_slice_and_the_largest_group(digits):
    # The same model in 1024-byte buckets: after a step, each layer's gradients (2080 and 330
    # elements) are a group of their own; the largest is held reduced with the replica's slice.
    x, y = digits
    for stage in (1, 2):
        strategy = tfdist.get_strategy("sharded_optimizer", stage=stage, devices=DEVICES[4], bucket_bytes=1024)
        model = built(strategy, keras.optimizers.Adam)
        before = tfdist.memory_report(model)["/device:CPU:0"]["gradient_buffers"]
        model.fit(x[:32], y[:32], batch_size=32, verbose=0)
        for entry in tfdist.memory_report(model).values():
            assert entry["gradient_buffers"] == 4 * (610 + 64 * 32 + 32)
        assert before == (4 * PARAMETERS if stage == 1 else 4 * (610 + 2 * 4 * 61))


def test_cpu_devices_report_no_measured_peak():
    report = tfdist.memory_report(built(tfdist.get_strategy("mirrored", devices=DEVICES[2])))
    assert [entry["peak"] for entry in report.values()] == [None, None]
    assert all(entry["total"] == entry["weights"] + entry["optimizer_state"] + entry["gradient_buffers"]
               for entry in report.values())


def test_measured_peak_is_the_allocator_peak_of_local_gpu_and_tpu_devices():
    asked = []

    def memory_info(device):
        asked.append(device)
        return {"current": 10, "peak": 123}

    assert memory.measured_peak("/device:GPU:1", memory_info) == 123
    assert memory.measured_peak("/job:localhost/replica:0/task:0/device:TPU:0", memory_info) == 123
    assert memory.measured_peak("/device:CPU:0", memory_info) is None
    assert memory.measured_peak("/job:worker/replica:0/task:1/device:GPU:0", memory_info) is None
    assert asked == ["GPU:1", "TPU:0"]

    def no_statistics(device):
        raise ValueError(f"No memory info for {device}")

    assert memory.measured_peak("/device:GPU:0", no_statistics) is None

"""Multi-worker synchronous training (issue 4): real TensorFlow servers in separate processes.

Each cluster test starts its job with `tfdist.launch.run_job` on free 127.0.0.1
ports (tests/strategies/multi_worker_job.py is the script every process runs)
and compares with a single-process run in this test process, which has 4
logical CPU devices (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.conftest import DEVICES, build_model, max_relative_difference
from tests.strategies.parity import PARITY_RTOL
from tfdist.cluster import ClusterConfigError
from tfdist.launch import run_job

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multi_worker_job.py")
# Generous: two cores shared with the rest of the suite.
JOB_TIMEOUT_S = 240
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def run(out, *args, restarts=0):
    # TMPDIR: the non-chief's temporary write directories land in `out`.
    return run_job([sys.executable, JOB, "--out", str(out), *args], workers=2, restarts=restarts,
                   env={**ENV, "TMPDIR": str(out)}, timeout=JOB_TIMEOUT_S)


def results(out, task):
    with open(os.path.join(out, f"{task}.json")) as f:
        data = json.load(f)
    weights = np.load(os.path.join(out, f"{task}.npz"))
    return data, {k: weights[k] for k in weights.files}


def group(weights, prefix):
    return [weights[f"{prefix}_{i}"] for i in range(4)]


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})


def mirrored_reference(x, y, epochs, tf_data=False, validation_data=None):
    """The same model and global batch under single-process 2-replica mirrored.

    Returns the model and its history, with the per-batch logs as `history.batch_logs`.
    """
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[2])
    with strategy.scope():
        model = build_model()
    batches = BatchLogs()
    if tf_data:
        history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=epochs, verbose=0,
                            callbacks=[batches])
    else:
        history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                            validation_data=validation_data, callbacks=[batches])
    history.batch_logs = batches.logs
    return model, history


# ---------------------------------------------------------------------------
# One 2-worker job, several checks.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_worker_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_worker")
    writers = out / "writers"
    status = run(out, "--epochs", "2", "--writers", str(writers), "--tf-data", "--tf-keras", "--batchnorm",
                 "--custom-loop", "--dropout-masks")
    return status, out, writers


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_two_workers_train_to_identical_weights_matching_mirrored(two_worker_job, digits):
    status, out, _ = two_worker_job
    assert status == 0
    chief, chief_w = results(out, "worker0")
    other, other_w = results(out, "worker1")
    assert (chief["is_chief"], other["is_chief"]) == (True, False)
    assert chief["replicas"] == other["replicas"] == 2
    assert chief["iterations"] == other["iterations"] == 40
    for key in chief_w:
        np.testing.assert_array_equal(chief_w[key], other_w[key])
    x, y = digits[0][:640], digits[1][:640]
    reference, history = mirrored_reference(x, y, epochs=2, validation_data=(x[:100], y[:100]))
    assert max_relative_difference(reference.get_weights(), group(chief_w, "keras3")) < PARITY_RTOL
    assert sorted(chief["history"]) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(chief["history"][key], history.history[key], rtol=1e-5)
    for key in ("accuracy", "val_accuracy"):
        np.testing.assert_allclose(chief["history"][key], history.history[key], rtol=1e-6)
    assert other["history"] == chief["history"]
    # Every worker sees the same per-batch logs (a callback deciding on them decides alike
    # everywhere), the global ones mirrored computes. They are read from the replicas'
    # metric state summed in the step's gradient all-reduce: the train function holds one
    # all-reduce (the gradients' one bucket, with the metrics) and TensorFlow's agreement
    # on whether every worker has a batch left; Keras's reads would add one per metric
    # variable (4: loss and accuracy, a total and a count each).
    assert len(chief["batch_logs"]) == 40 and other["batch_logs"] == chief["batch_logs"]
    for key, rtol in (("loss", 1e-5), ("accuracy", 1e-6)):
        np.testing.assert_allclose([b[key] for b in chief["batch_logs"]],
                                   [b[key] for b in history.batch_logs], rtol=rtol)
    assert chief["train_collectives"] == {"CollectiveReduceV2": 2}
    ref_eval = reference.evaluate(x, y, batch_size=50, verbose=0, return_dict=True)
    assert chief["evaluate"]["accuracy"] == pytest.approx(ref_eval["accuracy"], abs=1e-7)
    assert chief["evaluate"]["loss"] == pytest.approx(ref_eval["loss"], rel=1e-5)
    np.testing.assert_allclose(chief["predict"], reference.predict(x[:101], verbose=0), rtol=1e-4, atol=1e-5)


@pytest.mark.cluster
@pytest.mark.slow
def test_batchnorm_moving_statistics_are_averaged_over_workers_as_under_mirrored(two_worker_job, digits):
    # Keras 3 creates BatchNorm's moving mean and variance with aggregation
    # "none": each worker kept the statistics of its own half of every batch,
    # and the chief saved its own (moving_mean[2]: -0.405 on worker 0, -0.386
    # on worker 1; averaged, as mirrored's 2 replicas: -0.395).
    status, out, _ = two_worker_job
    assert status == 0
    chief_w, other_w = results(out, "worker0")[1], results(out, "worker1")[1]
    chief = [chief_w[f"batchnorm_{i}"] for i in range(7)]
    for ours, theirs in zip(chief, [other_w[f"batchnorm_{i}"] for i in range(7)]):
        np.testing.assert_array_equal(ours, theirs)
    x, y = digits[0][:192], digits[1][:192]
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        reference = build_model("batchnorm", metrics=())
    reference.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert max_relative_difference(reference.get_weights(), chief) < PARITY_RTOL


@pytest.mark.cluster
@pytest.mark.slow
def test_each_worker_draws_its_own_dropout_masks(two_worker_job):
    # Every worker's SeedGenerator state is the same, so every worker's replica
    # drew the same dropout mask (stock tf.distribute still does). The replica
    # of worker 1 (replica 1 of the job) folds its id into the seed; worker 0's
    # keeps one device's draws.
    status, out, _ = two_worker_job
    assert status == 0
    chief, other = results(out, "worker0")[0]["dropout_masks"], results(out, "worker1")[0]["dropout_masks"]
    one_device = keras.layers.Dropout(0.5, seed=7)
    folded = keras.random.SeedGenerator(0)
    for step in range(2):
        np.testing.assert_array_equal(chief[step], one_device(tf.ones((1, 64)), training=True).numpy()[0])
        state = tf.constant([7, step], tf.int64)
        folded.state.assign(tf.random.experimental.stateless_fold_in(state, tf.constant(1, tf.int64)))
        np.testing.assert_array_equal(other[step], keras.random.dropout(tf.ones((1, 64)), 0.5, seed=folded).numpy()[0])
        assert np.sum(np.not_equal(chief[step], other[step])) >= 16


@pytest.mark.cluster
@pytest.mark.slow
def test_a_custom_training_loop_matches_one_device(two_worker_job):
    # Keras's own optimizer.apply in each replica failed here at the first step
    # (a LossScaleOptimizer's conditional update, "merge_call called while
    # defining a new graph"), and clipped each replica's share.
    from tests.strategies import custom_loop

    status, out, _ = two_worker_job
    assert status == 0
    (chief, chief_w), (other, other_w) = results(out, "worker0"), results(out, "worker1")
    reference, ref_optimizer, ref_scales = custom_loop.train(
        tf.distribute.get_strategy(), custom_loop.clipped_loss_scaled_adam, **custom_loop.EVERY_FIX
    )
    assert ref_scales == [1024.0, 2048.0, 1024.0, 1024.0]  # grown, then halved at the overflow
    expected = {"scales": ref_scales, "iterations": int(ref_optimizer.iterations.numpy())}
    assert chief["custom_loop"] == other["custom_loop"] == expected
    for i, want in enumerate(reference.get_weights()):
        np.testing.assert_array_equal(chief_w[f"loop_{i}"], other_w[f"loop_{i}"])
        np.testing.assert_allclose(chief_w[f"loop_{i}"], want, atol=1e-6)


@pytest.mark.cluster
@pytest.mark.slow
def test_tf_data_input_is_sharded_across_workers_and_matches_mirrored(two_worker_job, digits):
    status, out, _ = two_worker_job
    assert status == 0
    chief, chief_w = results(out, "worker0")
    x, y = digits[0][:640], digits[1][:640]
    reference, history = mirrored_reference(x, y, epochs=1, tf_data=True)
    assert max_relative_difference(reference.get_weights(), group(chief_w, "tfdata")) < PARITY_RTOL
    # Four steps per host call (steps_per_execution=4): the metrics are read once per call,
    # all four variables in one all-reduce. The train function holds 4 all-reduces: that
    # read, the step's bucket (in the loop body) and TensorFlow's agreement on whether every
    # worker has a batch left, before the loop and in it. Keras's reads would be 4, not 1.
    np.testing.assert_allclose(chief["sink_history"]["loss"], history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(chief["sink_history"]["accuracy"], history.history["accuracy"], rtol=1e-6)
    assert chief["sink_collectives"] == {"CollectiveReduceV2": 4}


@pytest.mark.cluster
@pytest.mark.slow
def test_tf_keras_fit_under_multi_worker_matches_mirrored(two_worker_job, digits):
    import tf_keras

    status, out, _ = two_worker_job
    assert status == 0
    chief, chief_w = results(out, "worker0")
    _, other_w = results(out, "worker1")
    for i in range(4):
        np.testing.assert_array_equal(chief_w[f"tf_keras_{i}"], other_w[f"tf_keras_{i}"])
    x, y = digits[0][:640], digits[1][:640]
    # Reduced without collectives: stock MirroredStrategies share collective
    # group 1 and instance keys from 100 (tensorflow#62790), so one in another
    # test of this process, with another shape, would abort this one's.
    strategy = tf.distribute.MirroredStrategy(DEVICES[2], cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        tf_keras.utils.set_random_seed(0)
        reference = tf_keras.Sequential(
            [tf_keras.Input((64,)), tf_keras.layers.Dense(32, activation="relu"), tf_keras.layers.Dense(10)]
        )
        reference.compile(optimizer=tf_keras.optimizers.SGD(0.1),
                          loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0)
    assert max_relative_difference(reference.get_weights(), group(chief_w, "tf_keras")) < PARITY_RTOL
    np.testing.assert_allclose(chief["tf_keras_loss"], history.history["loss"], rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.slow
def test_only_the_chief_writes_checkpoints_and_summaries(two_worker_job):
    # Both workers run ModelCheckpoint and TensorBoard; the non-chief's copies
    # write to a temporary directory that is removed. Without tfdist's
    # redirection each worker would write its own events file here.
    status, out, writers = two_worker_job
    assert status == 0
    assert not [p for p in os.listdir(out) if p.startswith("tfdist_")]  # the temporary directory is gone
    events = sorted(p for p in os.listdir(writers / "tb" / "train") if p.startswith("events.out"))
    assert len(events) == 1
    assert sorted(os.listdir(writers)) == ["ckpt.weights.h5", "tb"]


# ---------------------------------------------------------------------------
# Fault tolerance: a worker killed mid-epoch, the job restarted.
# ---------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_killed_worker_job_restarts_and_resumes_from_backup(tmp_path, digits):
    epochs, steps = 4, 20
    backup = tmp_path / "backup"
    status = run(tmp_path, "--epochs", str(epochs), "--backup-dir", str(backup),
                 "--crash-epoch", "2", "--crash-batch", "5", restarts=1)
    assert status == 0
    finished = [tuple(map(int, line.split())) for line in (tmp_path / "epochs.log").read_text().splitlines()]
    # (attempt, epoch): epochs 0 and 1 done before the kill, 2 and 3 after the restart.
    assert finished == [(0, 0), (0, 1), (1, 2), (1, 3)]
    batches = (tmp_path / "batches.log").read_text().splitlines()
    repeated = len(batches) - epochs * steps
    assert 0 < repeated <= steps  # at most one epoch's progress was done twice
    chief, chief_w = results(tmp_path, "worker0")
    _, other_w = results(tmp_path, "worker1")
    assert chief["iterations"] == epochs * steps
    for key in chief_w:
        np.testing.assert_array_equal(chief_w[key], other_w[key])
    # Weights as if never interrupted: nothing applied twice, nothing lost.
    reference, _ = mirrored_reference(digits[0][:640], digits[1][:640], epochs=epochs)
    assert max_relative_difference(reference.get_weights(), group(chief_w, "keras3")) < PARITY_RTOL


# ---------------------------------------------------------------------------
# In-process: options and cluster errors are raised before any server starts.
# ---------------------------------------------------------------------------


def test_bad_tf_config_fails_before_a_server_starts(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:1", "localhost:x"]}, '
                                    '"task": {"type": "worker", "index": 0}}')
    with pytest.raises(ClusterConfigError) as e:
        tfdist.get_strategy("multi_worker")
    assert str(e.value).startswith("TF_CONFIG: field 'cluster.worker[1]' has a port that is not a number: 'x'.")


def test_ps_cluster_is_refused_with_the_fix():
    config = {"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]}, "task": {"type": "worker", "index": 0}}
    with pytest.raises(ClusterConfigError) as e:
        tfdist.get_strategy("multi_worker", cluster=config)
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster.ps' lists 1 parameter server(s), but the multi_worker strategy has "
        "none. Remove 'ps' from the cluster, or use tfdist.get_strategy('parameter_server')."
    )


def test_tf_config_required_when_asked_for(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ClusterConfigError, match="the environment variable TF_CONFIG is not set"):
        tfdist.get_strategy("multi_worker", cluster="tf_config")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"communication": "mpi"},
         "option 'communication' must be one of 'auto', 'ring', 'nccl'. Received: communication='mpi'"),
        ({"collective_timeout": -1},
         "option 'collective_timeout' must be a number of seconds >= 0 (0 for no timeout). "
         "Received: collective_timeout=-1"),
        ({"devices_per_worker": 0},
         "option 'devices_per_worker' must be an integer >= 1 (replicas each worker trains on: its "
         "GPUs, else its logical CPU devices). Received: devices_per_worker=0"),
        ({"auto_shard": "rows"},
         "option 'auto_shard' must be one of 'auto', 'file', 'data', 'off'. Received: auto_shard='rows'"),
        ({"hierarchical": "yes"}, "option 'hierarchical' must be True or False. Received: hierarchical='yes' (type str)"),
        ({"cluster": "k8s"},
         "option 'cluster' must be 'tf_config' (read the TF_CONFIG environment variable), 'slurm' (this "
         "Slurm job step), 'kubernetes' (this pod of an Indexed Job), a TF_CONFIG dict, or a "
         "tfdist.cluster.ClusterConfig. Received: cluster='k8s'"),
    ],
)
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(tfdist.OptionError) as e:
        tfdist.get_strategy("multi_worker", **kwargs)
    assert str(e.value) == message


def test_more_devices_per_worker_than_a_cpu_host_has():
    # The test process has 4 logical CPU devices (conftest).
    with pytest.raises(ValueError) as e:
        tfdist.get_strategy("multi_worker", devices_per_worker=5)
    assert str(e.value) == (
        "devices_per_worker=5 needs 5 logical CPU devices in each worker; this worker has 4. Split its "
        "CPU first: tfdist.configure_local_devices(5) at the top of the script, TFDIST_LOCAL_DEVICES=5, "
        "or start the job with `tfdist launch --devices-per-worker 5`."
    )


def test_a_bad_devices_per_worker_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("TFDIST_DEVICES_PER_WORKER", "two")
    with pytest.raises(tfdist.OptionError) as e:
        tfdist.get_strategy("multi_worker")
    assert str(e.value) == (
        "Environment variable TFDIST_DEVICES_PER_WORKER must be an integer >= 1 (replicas per worker), "
        "or unset. Received: TFDIST_DEVICES_PER_WORKER='two'"
    )


def test_one_cpu_worker_trains_on_its_logical_devices_like_mirrored(digits):
    # TensorFlow gives a CPU worker one replica; with devices_per_worker=2 it
    # trains on CPU:0 and CPU:1, as mirrored does on the same two devices.
    x, y = digits
    x, y = x[:320], y[:320]
    reference, _ = mirrored_reference(x, y, epochs=1)
    strategy = tfdist.get_strategy("multi_worker", devices_per_worker=2)
    assert strategy.num_replicas_in_sync == 2
    assert strategy.hierarchical_exchange is None  # one worker: nothing crosses processes
    assert [d.rsplit(":", 1)[-1] for d in strategy.extended.worker_devices] == ["0", "1"]
    with strategy.scope():
        model = build_model()
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert model.optimizer.iterations.numpy() == 10
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5


def test_launch_devices_per_worker_sets_the_split_and_the_replicas():
    from tfdist.launch import devices_per_worker_environment

    assert devices_per_worker_environment(2, environ={}) == {
        "TFDIST_DEVICES_PER_WORKER": "2", "TFDIST_LOCAL_DEVICES": "2",
    }
    # A split the user chose, or GPUs (the worker's replicas), are left alone.
    assert devices_per_worker_environment(2, environ={"TFDIST_LOCAL_DEVICES": "4"}) == {
        "TFDIST_DEVICES_PER_WORKER": "2",
    }
    assert devices_per_worker_environment(2, environ={"CUDA_VISIBLE_DEVICES": "0,1"}) == {
        "TFDIST_DEVICES_PER_WORKER": "2",
    }


_DEVICES_JOB = """
import json, os, sys
import numpy as np
import tfdist  # TFDIST_LOCAL_DEVICES (tfdist launch --devices-per-worker): the CPU split first
import keras

from tfdist.collectives import collective_ops_in

# argv: out directory, strategy name, sharded optimizer stage (0: none), hierarchical (multi_worker: 1 or 0),
# sink_size
stage, hierarchical = int(sys.argv[3]), sys.argv[4] == "1"
options = {"stage": stage} if stage else {"hierarchical": hierarchical}
strategy = tfdist.get_strategy(sys.argv[2], collective_timeout=120.0, sink_size=int(sys.argv[5]), **options)
x, y = tfdist.datasets.load_digits()
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
model.fit(x[:640], y[:640], batch_size=32, shuffle=False, verbose=0)
task = strategy.cluster_config.task_id
np.savez(os.path.join(sys.argv[1], f"worker{task}.npz"), *model.get_weights())
with open(os.path.join(sys.argv[1], f"worker{task}.json"), "w") as f:
    json.dump({"replicas": strategy.num_replicas_in_sync, "local": len(strategy.extended.worker_devices),
               "iterations": int(model.optimizer.iterations.numpy()),
               "collectives": collective_ops_in(model.train_function.traced_graphs[-1], by_device=True)}, f)
"""


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("name,stage,hierarchical,sink", [
    ("multi_worker", 0, True, 1), ("multi_worker", 0, True, 4), ("multi_worker", 0, False, 1),
    ("sharded_optimizer", 2, False, 1),
])
def test_two_workers_with_two_devices_each_train_like_four_local_replicas(name, stage, hierarchical, sink,
                                                                          tmp_path, digits):
    # multi_worker sums each bucket within a worker first, then across the two
    # workers from CPU:0 (hierarchical, the default), or in one ring through
    # all 4 devices. The sharded optimizer's stage 2 too: replica r of 4
    # (worker-major) owns slice r, reduce-scattered and all-gathered across
    # both workers' devices.
    from tfdist.launch import devices_per_worker_environment

    script = tmp_path / "job.py"
    script.write_text(_DEVICES_JOB)
    env = {**ENV, "TMPDIR": str(tmp_path), **devices_per_worker_environment(2, environ={})}
    status = run_job([sys.executable, str(script), str(tmp_path), name, str(stage), str(int(hierarchical)),
                      str(sink)], workers=2, env=env, timeout=JOB_TIMEOUT_S)
    assert status == 0
    x, y = digits
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[4])
    with strategy.scope():
        reference = build_model(optimizer=keras.optimizers.Adam(1e-2))
    reference.fit(x[:640], y[:640], batch_size=32, shuffle=False, verbose=0)
    for task in (0, 1):
        with open(tmp_path / f"worker{task}.json") as f:
            result = json.load(f)
        collectives = result.pop("collectives")
        assert result == {"replicas": 4, "local": 2, "iterations": 20}
        # The step's gradients (and at sink 1 the metrics riding with them)
        # fit one bucket. Hierarchical: its cross-worker all-reduce runs on
        # CPU:0 alone, beside TensorFlow's own all-reduce there (does every
        # worker still have a batch: once per step, and once before the loop
        # of a host call of several steps), and at sink 4 the metrics' one
        # all-reduce per host call. One ring: every device joins the bucket's.
        if name == "multi_worker":
            assert collectives == {
                (True, 1): {"CollectiveReduceV2 CPU:0": 2},
                (True, 4): {"CollectiveReduceV2 CPU:0": 4},
                (False, 1): {"CollectiveReduceV2 CPU:0": 2, "CollectiveReduceV2 CPU:1": 1},
            }[(hierarchical, sink)]
        saved = np.load(tmp_path / f"worker{task}.npz")
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        assert max_relative_difference(reference.get_weights(), weights) < 1e-5


def test_nccl_on_a_cpu_host_is_refused():
    with pytest.raises(ValueError) as e:
        tfdist.get_strategy("multi_worker", communication="nccl")
    assert str(e.value) == (
        "communication='nccl' needs GPUs, and this worker has none. Use communication='ring' "
        "(or 'auto'). Received: communication='nccl'"
    )


def test_without_tf_config_it_is_one_local_worker(monkeypatch, digits):
    # The same script runs as one process: one worker, one CPU replica.
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = tfdist.get_strategy("multi_worker", communication="ring", collective_timeout=30.0)
    assert strategy.cluster_config is None
    assert (strategy.num_replicas_in_sync, strategy.is_chief) == (1, True)
    assert strategy.write_dir("/tmp/model.keras") == "/tmp/model.keras"
    with strategy.scope():
        model = build_model()
    model.fit(digits[0][:64], digits[1][:64], batch_size=32, epochs=1, shuffle=False, verbose=0)
    reference = build_model()
    reference.fit(digits[0][:64], digits[1][:64], batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < PARITY_RTOL
    assert keras.ops.convert_to_numpy(model.optimizer.iterations) == 2


# ---------------------------------------------------------------------------
# The example: TensorFlow's tutorial shape, under `tfdist launch --workers 2`.
# ---------------------------------------------------------------------------

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "multi_worker", "train.py")


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_tutorial_example_trains_under_launch_and_workers_agree(tmp_path, capsys):
    model_dir = tmp_path / "model"
    status = run_job(
        [sys.executable, EXAMPLE, "--epochs", "2", "--steps-per-epoch", "6", "--model-dir", str(model_dir)],
        workers=2, env={**ENV, "TMPDIR": str(tmp_path)}, timeout=JOB_TIMEOUT_S,
    )
    assert status == 0
    out = capsys.readouterr().out.splitlines()
    epochs = {w: [line.split(" - ")[-2:] for line in out if line.startswith(f"[worker:{w}] 6/6")] for w in (0, 1)}
    assert len(epochs[0]) == 2 and epochs[0] == epochs[1]  # same loss and accuracy on both workers
    assert sorted(os.listdir(model_dir)) == ["ckpt", "logs", "model.keras"]  # backup deleted at the end
    assert sorted(os.listdir(model_dir / "ckpt")) == ["epoch1.weights.h5", "epoch2.weights.h5"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tfdist_")]
    restored = keras.saving.load_model(model_dir / "model.keras")
    assert restored.optimizer.iterations.numpy() == 12


@pytest.mark.parametrize(
    "policy, expected",
    [("file", "FILE"), ("data", "DATA"), ("off", "OFF")],
)
def test_auto_shard_option_sets_the_dataset_policy(policy, expected):
    from tfdist.strategies.multi_worker import _with_shard_policy

    ds = tf.data.Dataset.range(8).batch(2)
    sharded = _with_shard_policy(ds, policy)
    assert sharded.options().experimental_distribute.auto_shard_policy == getattr(
        tf.data.experimental.AutoShardPolicy, expected
    )


def test_auto_shard_auto_keeps_the_datasets_own_policy():
    # Keras sets DATA on the datasets it builds from arrays; "auto" leaves it.
    from tfdist.strategies.multi_worker import _with_shard_policy

    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = tf.data.Dataset.range(8).with_options(opts)
    assert _with_shard_policy(ds, "auto").options().experimental_distribute.auto_shard_policy == (
        tf.data.experimental.AutoShardPolicy.DATA
    )

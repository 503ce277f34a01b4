"""A real Slurm runs the shipped examples/multi_worker/slurm.sbatch unchanged (issue 38, item 6).

A single-host Slurm (tests/slurm_cluster.py: munged, slurmctld, slurmd of the
host's short name, `proctrack/linuxproc`, `task/none`, `select/cons_tres`,
free ports; installed with apt-get where missing, the tests skip with the
reason where it cannot be) runs `sbatch examples/multi_worker/slurm.sbatch`
with only `sbatch` options and the script's own arguments:

1. 2 tasks, `multi_worker`: the saved model equals 2-replica `mirrored`
   trained in this process on the same batches.
2. 2 tasks of 2 devices, `sharded_optimizer` (4 replicas): Slurm requeues the
   job (`scontrol requeuehold`: SIGTERM to every task, as for a preemption);
   both tasks save at the same step and exit 0. The job is submitted again,
   same MODEL_DIR, with `--ntasks=1` (2 replicas): it resumes at the next step
   and finishes. Before the requeue the backup equals 4-replica `mirrored`;
   after it, the final model equals 2-replica `mirrored` trained from the
   backup on the batches after its position.

Every daemon the module started is stopped at its end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import time

import keras
import pytest

import tfdist
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.conftest import DEVICES, max_relative_difference
from tests.slurm_cluster import SingleHostSlurm, Unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join("examples", "multi_worker", "slurm.sbatch")
JOB_TIMEOUT_S = 300
RTOL = 1e-5

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def example():
    """examples/multi_worker/train.py as a module: its model and its dataset."""
    spec = importlib.util.spec_from_file_location("multi_worker_example", os.path.join(
        ROOT, "examples", "multi_worker", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    try:
        cluster = SingleHostSlurm.start(str(folder))
    except Unavailable as reason:
        pytest.skip(f"no single-host Slurm here: {reason}")
    yield cluster
    cluster.stop()


def free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (the tasks' ports from TFDIST_SLURM_PORT_BASE)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


def job_environment(model_dir, **extra) -> dict:
    """What the submitting shell exports: this Python first on PATH (the script runs `python`), tfdist."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
           "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2",
           "TFDIST_SLURM_PORT_BASE": str(free_port_pair()), "MODEL_DIR": str(model_dir), **extra}
    for name in ("TF_CONFIG", "TFDIST_LOCAL_DEVICES", "TFDIST_DEVICES_PER_WORKER"):
        if name not in extra:
            env.pop(name, None)
    return env


def mirrored_reference(module, devices, steps: int, global_batch: int, start=None):
    """`mirrored` on `devices` in this process: the example's model, from `start` (a backup) or its seed."""
    keras.utils.set_random_seed(0)  # as the example: its weights and its input's order
    with tfdist.get_strategy("mirrored", devices=devices).scope():
        model = module.build_and_compile_cnn_model()
    skip = 0
    if start is not None:
        model.optimizer.build(model.trainable_variables)
        model.load_weights(str(start / "latest.weights.h5"))
        skip = json.loads((start / "training_metadata.json").read_text())["tfdist"]["data_batches"]
    model.fit(module.digits_dataset(global_batch).skip(skip), epochs=1, steps_per_epoch=steps, verbose=0)
    return model


def saved_weights(path) -> list:
    return keras.models.load_model(str(path)).get_weights()


def backup_weights(module, folder) -> list:
    """A backup's weights, read into the example's model in plain Keras."""
    model = module.build_and_compile_cnn_model()
    model.optimizer.build(model.trainable_variables)
    model.load_weights(str(folder / "latest.weights.h5"))
    return model.get_weights()


@pytest.mark.usefixtures("no_leftover_processes")
def test_sbatch_runs_the_shipped_script_and_multi_worker_trains_like_2_replica_mirrored(slurm, tmp_path):
    model_dir = tmp_path / "run"
    job = slurm.sbatch([f"--output={tmp_path}/slurm-%j.out", SBATCH, "--epochs", "2", "--steps-per-epoch", "6",
                        "--global-batch-size", "64"], job_environment(model_dir), cwd=ROOT)
    state = slurm.wait(job, JOB_TIMEOUT_S)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "0: <tfdist MultiWorkerMirroredStrategy" in log and ", chief=True" in log and ", chief=False" in log
    assert f"0: saved {model_dir / 'model.keras'}" in log
    reference = mirrored_reference(example(), DEVICES[2], 12, 64)
    assert max_relative_difference(reference.get_weights(), saved_weights(model_dir / "model.keras")) < RTOL


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_requeued_sharded_job_saves_on_sigterm_and_resumes_at_another_task_count(slurm, tmp_path):
    module = example()
    model_dir, epochs, steps, batch = tmp_path / "run", 3, 16, 64
    args = ["--strategy", "sharded_optimizer", "--epochs", str(epochs), "--steps-per-epoch", str(steps),
            "--global-batch-size", str(batch)]
    devices = {"TFDIST_LOCAL_DEVICES": "2", "TFDIST_DEVICES_PER_WORKER": "2"}
    job = slurm.sbatch([f"--output={tmp_path}/first-%j.out", SBATCH, *args],
                       job_environment(model_dir, **devices), cwd=ROOT)
    log = tmp_path / f"first-{job}.out"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    # The first epoch's line (verbose=2), then requeue: Slurm sends SIGTERM to every task.
    while not (log.exists() and f"0: {steps}/{steps} - " in log.read_text()):
        assert slurm.state(job) in ("PENDING", "RUNNING"), log.read_text()[-3000:] if log.exists() else job
        assert time.monotonic() < deadline, "the job did not train"
        time.sleep(0.1)
    signalled = time.monotonic()
    slurm.run("scontrol", "requeuehold", job, check=True)
    assert slurm.wait(job, JOB_TIMEOUT_S, until=("PENDING",)) == "PENDING"
    print(f"\nseconds from requeuehold to the requeued job pending: {time.monotonic() - signalled:.2f}")
    first = log.read_text()
    slurm.run("scancel", job, check=True)
    metadata = json.loads((model_dir / "backup" / "training_metadata.json").read_text())
    saved, saved_epoch = metadata["tfdist"], metadata["epoch"]
    step = saved["optimizer_step"]
    assert steps <= step < epochs * steps and (saved["workers"], saved["replicas"]) == (2, 4)
    position = f"epoch {saved_epoch + 1}, step {saved['steps_done']} of {steps} (optimizer step {step})"
    assert f"0: tfdist: preempted (stop signal to another task): worker:0 saved {position}" in first \
        or f"0: tfdist: preempted (SIGTERM): worker:0 saved {position} to {model_dir / 'backup'}" in first
    assert "1: tfdist: preempted (" in first and f"worker:1 saved {position} to its own temporary copy" in first
    snapshot = tmp_path / "snapshot"
    shutil.copytree(model_dir / "backup", snapshot)

    # Submitted again at 1 task (2 replicas), same MODEL_DIR.
    submitted = time.monotonic()
    job = slurm.sbatch(["--ntasks=1", f"--output={tmp_path}/second-%j.out", SBATCH, *args],
                       job_environment(model_dir, **devices), cwd=ROOT)
    second_log = tmp_path / f"second-{job}.out"
    while slurm.state(job) in ("PENDING", "RUNNING") and not (
            second_log.exists() and f"0: {steps}/{steps} - " in second_log.read_text()):
        time.sleep(0.1)
    print(f"seconds from sbatch to the resumed epoch's end at 1 task: {time.monotonic() - submitted:.2f}")
    state = slurm.wait(job, JOB_TIMEOUT_S)
    second = (tmp_path / f"second-{job}.out").read_text()
    assert state == "COMPLETED", second[-3000:]
    following = (f"the next step is {saved['steps_done'] + 1}" if saved["steps_done"] < steps
                 else "its steps are done; the epoch ends")
    assert (f"0: tfdist: resumed from {model_dir / 'backup'} at {position}: {following} "
            "(saved by 2 worker(s), 4 replica(s); now 1, 2).") in second
    # Each segment against mirrored at its replica count: 4 up to the backup, 2 from it to the end.
    before = mirrored_reference(module, DEVICES[4], step, batch)
    assert max_relative_difference(before.get_weights(), backup_weights(module, snapshot)) < RTOL
    after = mirrored_reference(module, DEVICES[2], epochs * steps - step, batch, start=snapshot)
    final = keras.models.load_model(str(model_dir / "model.keras"))
    assert int(final.optimizer.iterations.numpy()) == epochs * steps
    assert max_relative_difference(after.get_weights(), final.get_weights()) < RTOL

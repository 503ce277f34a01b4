"""Jobs stopped by signals and by a lost worker resume at another size with no step repeated (issue 38).

One chain of real `tfdist launch` jobs (`tests/resize_job.py`: the digits MLP,
Adam, a fixed global batch of 48, `BackupAndRestore`), each run's checkpoint the
next run's start:

A. 2 workers; SIGTERM to worker 1 alone (as Kubernetes evicts one pod): both
   workers save the same step, exit 0, and the launcher exits 0.
B. `--workers 2:3 --restarts 0` from A's backup: 3 workers (2 -> 3); worker 2
   fails for good after 3 steps, the launcher restarts the job with 2 workers
   (3 -> 2) from the last `save_freq` backup, and it finishes.
C. 1 worker from A's backup (2 -> 1); SIGTERM to the launcher: the worker saves
   and the launcher exits 0.

Each run's weights at its end are compared with plain Keras on one device
trained from the run's starting checkpoint for the same steps, on the same
batches (the dataset skipped to the checkpoint's data position): the resumed
run at its new size equals an uninterrupted run from the same checkpoint.
The optimizer steps each run trained are read from the workers' logs: a
preempted run's successor starts at the step after the saved one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import resize_job as job
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.conftest import max_relative_difference
from tests.strategies.parity import PARITY_RTOL

JOB = os.path.abspath(job.__file__)
ROOT = os.path.dirname(os.path.dirname(JOB))
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
RUN_TIMEOUT_S = 240  # generous: two cores shared with the rest of the suite
EPOCHS, STEPS = 3, 8  # 24 steps in all

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]


def launch(out, *flags, extra=()):
    """Starts `tfdist launch FLAGS -- python resize_job.py --out OUT EXTRA` in its own process."""
    command = [sys.executable, "-m", "tfdist.cli", "launch", *flags, "--",
               sys.executable, JOB, "--out", str(out), "--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS),
               *extra]
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV, "TMPDIR": str(out / "tmp")}
    env.pop("TF_CONFIG", None)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(launcher) -> tuple[int, str]:
    try:
        out, _ = launcher.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        launcher.kill()
        out, _ = launcher.communicate()
        raise AssertionError(f"the job did not finish in {RUN_TIMEOUT_S} s:\n{out[-3000:]}") from None
    return launcher.returncode, out


def steps(out, task: str, run: int) -> list[int]:
    """The optimizer step after each step `task` trained in its run `run`."""
    path = out / f"steps-{task}-{run}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def wait_for_steps(out, task: str, run: int, count: int, launcher) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(steps(out, task, run)) < count:
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the job did not train"
        time.sleep(0.05)


def metadata(backup) -> dict:
    return json.loads((backup / "training_metadata.json").read_text())


def describe(saved: dict) -> str:
    """A backup's position as the workers' lines say it (epochs 1-based)."""
    return (f"epoch {saved['epoch'] + 1}, step {saved['tfdist']['steps_done']} of {STEPS} "
            f"(optimizer step {saved['tfdist']['optimizer_step']})")


def plain_model():
    """The job's model in plain Keras (no strategy), its optimizer built so a checkpoint loads whole."""
    model = job.build()
    model.optimizer.build(model.trainable_variables)
    return model


def checkpoint_weights(backup) -> list:
    model = plain_model()
    model.load_weights(str(backup / "latest.weights.h5"))
    return model.get_weights()


def reference(start, steps_to_train: int) -> tuple[list, int]:
    """Plain Keras on one device from checkpoint `start` (None: the initial weights): (weights, optimizer step)."""
    model = plain_model()
    skip = 0
    if start is not None:
        model.load_weights(str(start / "latest.weights.h5"))
        skip = metadata(start)["tfdist"]["data_batches"]
    model.fit(job.dataset().skip(skip), epochs=1, steps_per_epoch=steps_to_train, shuffle=False, verbose=0)
    return model.get_weights(), int(model.optimizer.iterations.numpy())


def assert_equal_to_reference(start, end_weights, end_step: int, start_step: int) -> None:
    weights, step = reference(start, end_step - start_step)
    assert step == end_step
    assert max_relative_difference(weights, end_weights) < PARITY_RTOL


def test_signals_and_a_lost_worker_stop_the_job_and_it_resumes_at_other_sizes_with_no_step_repeated(tmp_path):
    figures = {}
    # A. Two workers; SIGTERM to worker 1 only, after it trained 4 steps.
    a = tmp_path / "a"
    launcher = launch(a, "--workers", "2", "--grace-period", "60", extra=["--step-seconds", "0.3"])
    wait_for_steps(a, "worker1", 1, 4, launcher)
    signalled = time.monotonic()
    os.kill(int((a / "pid-worker1-1").read_text()), signal.SIGTERM)
    status, out = finish(launcher)
    figures["A: seconds from SIGTERM to the launcher's exit"] = time.monotonic() - signalled
    assert status == 0, out[-3000:]
    saved = metadata(a / "backup")
    step_a = saved["tfdist"]["optimizer_step"]
    # Both workers trained exactly the saved steps: no step after it, none lost before it.
    assert steps(a, "worker0", 1) == steps(a, "worker1", 1) == list(range(1, step_a + 1))
    assert saved["tfdist"]["workers"] == 2 and saved["epoch"] * STEPS + saved["tfdist"]["steps_done"] == step_a
    position = describe(saved)
    assert f"[worker:1] tfdist: preempted (SIGTERM): worker:1 saved {position} to its own temporary copy" in out
    assert f"[worker:0] tfdist: preempted (stop signal to another task): worker:0 saved {position} to {a / 'backup'}" \
        in out
    assert f"tfdist launch: a stop signal reached the job; every worker saved {position} and exited." in out
    assert_equal_to_reference(None, checkpoint_weights(a / "backup"), step_a, 0)
    s1 = tmp_path / "s1"
    shutil.copytree(a / "backup", s1)

    # B. --workers 2:3 from A's checkpoint: 3 workers; worker 2 fails for good after 3 steps.
    b = tmp_path / "b"
    shutil.copytree(s1, b / "backup")
    started = time.monotonic()
    launcher = launch(b, "--workers", "2:3", "--restarts", "0", extra=["--save-every", "2", "--fail", "3:2:3"])
    wait_for_steps(b, "worker0", 1, 1, launcher)
    figures["B: seconds from launch to the first step at 3 workers"] = time.monotonic() - started
    status, out = finish(launcher)
    assert status == 0, out[-3000:]
    three = steps(b, "worker0", 1)
    assert three[0] == step_a + 1  # 2 -> 3: the step after A's
    assert steps(b, "worker2", 1) == three[:3] and len(three) == 3
    # The 2-worker restart read the last save_freq backup of the 3-worker run (its chief's snapshot).
    resumed = metadata(b / "snapshots" / "2")
    step_b = resumed["tfdist"]["optimizer_step"]
    assert resumed["tfdist"]["workers"] == 3 and step_b in three
    two = steps(b, "worker0", 2)
    assert steps(b, "worker1", 2) == two == list(range(step_b + 1, EPOCHS * STEPS + 1))
    figures["B: steps repeated after the lost worker"] = three[-1] - step_b
    assert json.loads((b / "final.json").read_text()) == {"iterations": EPOCHS * STEPS, "workers": 2}
    where = describe(resumed)
    assert ("tfdist launch: worker:2 failed 1 time(s), more than --restarts 0 allows: restarting the job with the "
            "remaining 2 worker(s) (at least 2), resuming from its last checkpoint in 1 s.") in out
    assert ("tfdist launch: summary: the job went from 3 to 2 workers after worker:2 failed 1 time(s), more than "
            f"--restarts 0 allows; the 2-worker job resumed at {where}.") in out
    assert_equal_to_reference(s1, checkpoint_weights(b / "snapshots" / "2"), step_b, step_a)  # at 3 workers
    final = np.load(b / "final.npz")
    assert_equal_to_reference(b / "snapshots" / "2", [final[f"arr_{i}"] for i in range(len(final.files))],
                              EPOCHS * STEPS, step_b)  # at 2 workers, to the end

    # C. One worker from A's checkpoint (2 -> 1); SIGTERM to the launcher after 3 steps.
    c = tmp_path / "c"
    shutil.copytree(s1, c / "backup")
    started = time.monotonic()
    launcher = launch(c, "--workers", "1", extra=["--step-seconds", "0.3"])
    wait_for_steps(c, "worker0", 1, 1, launcher)
    figures["C: seconds from launch to the first step at 1 worker"] = time.monotonic() - started
    wait_for_steps(c, "worker0", 1, 3, launcher)
    signalled = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    status, out = finish(launcher)
    figures["C: seconds from SIGTERM to the launcher's exit"] = time.monotonic() - signalled
    assert status == 0, out[-3000:]
    saved = metadata(c / "backup")
    step_c = saved["tfdist"]["optimizer_step"]
    assert steps(c, "worker0", 1) == list(range(step_a + 1, step_c + 1))
    assert saved["tfdist"]["workers"] == 1
    assert "tfdist launch: SIGTERM received; every worker saved epoch" in out
    assert_equal_to_reference(s1, checkpoint_weights(c / "backup"), step_c, step_a)
    print("\n".join(f"{name}: {value:.2f}" for name, value in figures.items()))

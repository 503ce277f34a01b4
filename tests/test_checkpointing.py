"""Atomic checkpoints (issue 15, items 1 and 6): kills during a write lose at most the epoch being saved.

The fault tests run `tests/checkpointing_job.py` in child processes and kill
them with SIGKILL while a checkpoint file is open and half written (the job's
test layer announces each layer it has written and then sleeps, so the kill
lands at a known point of Keras's own write); the next run must resume.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import tfdist
from tests import checkpointing_job as job
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.conftest import DEVICES, max_relative_difference
from tests.strategies.parity import PARITY_RTOL
from tfdist import checkpointing
from tfdist.launch import run_job
from tfdist.strategies import multi_worker

JOB = os.path.abspath(job.__file__)
ROOT = os.path.dirname(os.path.dirname(JOB))
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
RUN_TIMEOUT_S = 240  # generous: two cores shared with the rest of the suite
SLOW_S = 0.5  # the job's sleep after each layer written: the kill lands inside it
STEPS = job.EXAMPLES // job.BATCH  # 4 steps per epoch


def run_child(out, strategy: str, kill_at: str | None = None, delay: float = 0.0):
    """Runs one job process; SIGKILLs it `delay` s after it prints `kill_at`.

    Returns (pid, printed lines, exit status).
    """
    env = {**os.environ, **ENV, "TFDIST_LOCAL_DEVICES": "2"}
    env.pop("TF_CONFIG", None)
    command = [sys.executable, JOB, "--out", str(out), "--strategy", strategy]
    if kill_at is not None:  # "SAVING backup epoch=1 part=0": that write only is slowed
        writer, epoch = re.match(r"SAVING (\w+) epoch=(\d+) ", kill_at).groups()
        command += ["--slow", str(SLOW_S), "--slow-at", f"{writer}:{epoch}"]
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
    )
    lines, pending, deadline = [], b"", time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"the job did not finish in {RUN_TIMEOUT_S} s: {lines[-5:]}")
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                lines.append(line.decode(errors="replace"))
                if kill_at is not None and lines[-1] == kill_at:
                    time.sleep(delay)
                    child.send_signal(signal.SIGKILL)
                    kill_at = None
        status = child.wait()
        if status not in (0, -signal.SIGKILL):
            raise AssertionError(f"the job failed with status {status}:\n" + "\n".join(lines[-30:]))
        return child.pid, lines, status
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()


def after(lines, prefix: str) -> list[str]:
    """The lines starting with `prefix`."""
    return [line for line in lines if line.startswith(prefix)]


def listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def metadata(out) -> dict:
    """Keras's part of the backup's metadata: the epoch to resume at and the batch."""
    with open(out / "backup" / "training_metadata.json") as f:
        data = json.load(f)
    return {"epoch": data["epoch"], "batch": data["batch"]}


def reference_weights(epochs: int) -> list:
    """The job's model trained without interruption under 2-replica mirrored, in this process."""
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        model = job.build()
    x, y = job.data()
    model.fit(x, y, batch_size=job.BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


# ---------------------------------------------------------------------------
# One process killed three times during a write, under three strategies.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_kill_during_any_checkpoint_write_loses_at_most_the_epoch_being_saved(tmp_path):
    out, backup = tmp_path, tmp_path / "backup"
    # 1. Killed as BackupAndRestore writes epoch 1's backup, one layer of four written.
    pid, lines, status = run_child(out, "mirrored", kill_at="SAVING backup epoch=1 part=0")
    assert status == -signal.SIGKILL
    assert after(lines, "EPOCH") == ["EPOCH 0", "EPOCH 1"]
    # The half-written file is the temporary one; epoch 0's backup is whole and in place.
    assert listing(backup) == [f".tfdist-{pid}-latest.weights.h5", "latest.weights.h5", "training_metadata.json"]
    assert metadata(out) == {"epoch": 1, "batch": 0}

    # 2. Resumes at epoch 1 (only the epoch being saved is repeated), under
    # sharded_optimizer; killed 0.1 s after three of four layers of the
    # ModelCheckpoint `.keras` of epoch 2 were written.
    pid, lines, status = run_child(out, "sharded_optimizer", kill_at="SAVING keras epoch=2 part=2", delay=0.1)
    assert status == -signal.SIGKILL
    assert after(lines, "MODEL_KERAS") == [f"MODEL_KERAS iterations={1 * STEPS}"]
    assert after(lines, "EPOCH") == ["EPOCH 1", "EPOCH 2"]
    assert listing(backup) == ["latest.weights.h5", "training_metadata.json"]  # the leftover was removed
    assert metadata(out) == {"epoch": 3, "batch": 0}  # epoch 2's backup was complete before the .keras write
    assert f".tfdist-{pid}-model.keras" in listing(out)

    # 3. Under central_storage: the .keras of epoch 1 survived the kill; the
    # backup resumes at epoch 3. Killed 0.25 s after the last layer of epoch
    # 3's backup was written (the file still open: the optimizer's state follows).
    pid, lines, status = run_child(out, "central_storage", kill_at="SAVING backup epoch=3 part=3", delay=0.25)
    assert status == -signal.SIGKILL
    assert after(lines, "MODEL_KERAS") == [f"MODEL_KERAS iterations={2 * STEPS}"]
    assert after(lines, "EPOCH") == ["EPOCH 3"]
    assert metadata(out) == {"epoch": 3, "batch": 0}

    # 4. Resumes at epoch 3 and finishes: 4 epochs of 4 steps, as if never killed.
    _, lines, status = run_child(out, "mirrored")
    assert status == 0
    assert after(lines, "EPOCH") == ["EPOCH 3"]
    assert after(lines, "DONE") == [f"DONE iterations={4 * STEPS}"]
    assert listing(backup) == ["latest.weights.h5", "training_metadata.json"]
    assert metadata(out) == {"epoch": 4, "batch": 0}
    assert listing(out) == ["backup", "final-worker0.npz", "log-worker0.txt", "model.keras"]
    final = np.load(out / "final-worker0.npz")
    final = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert max_relative_difference(reference_weights(4), final) < PARITY_RTOL
    loaded = keras.models.load_model(out / "model.keras")
    assert int(loaded.optimizer.iterations.numpy()) == 4 * STEPS


# ---------------------------------------------------------------------------
# A 2-worker job under `tfdist launch --restarts 2`, its chief killed mid-write.
# ---------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_two_worker_job_whose_chief_is_killed_during_a_write_resumes_and_finishes(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    command = [sys.executable, JOB, "--out", str(tmp_path), "--strategy", "multi_worker", "--epochs", "3",
               "--self-kill", "backup:1:1"]
    status = run_job(command, workers=2, restarts=2, env={**ENV, "TMPDIR": str(temp)}, timeout=RUN_TIMEOUT_S)
    assert status == 0
    chief = (tmp_path / "log-worker0.txt").read_text().splitlines()
    other = (tmp_path / "log-worker1.txt").read_text().splitlines()
    # Killed after two of four layers of epoch 1's backup; the restarted job
    # resumes at epoch 1 on both workers, from the chief's epoch-0 backup.
    killed = chief.index("SAVING backup epoch=1 part=1")
    assert chief[killed + 1] == "START attempt=1"
    for log in (chief, other):
        restarted = log[log.index("START attempt=1"):]
        assert after(restarted, "EPOCH") == ["EPOCH 1", "EPOCH 2"]
        assert restarted[-1] == f"DONE iterations={3 * STEPS}"
    assert after(chief, "MODEL_KERAS") == [f"MODEL_KERAS iterations={1 * STEPS}"]
    assert listing(tmp_path / "backup") == ["latest.weights.h5", "training_metadata.json"]
    assert metadata(tmp_path) == {"epoch": 3, "batch": 0}
    weights = [np.load(tmp_path / f"final-worker{i}.npz") for i in range(2)]
    for key in weights[0].files:
        np.testing.assert_array_equal(weights[0][key], weights[1][key])
    assert listing(temp) == []  # the launcher's and the non-chief's temporary folders are gone


# ---------------------------------------------------------------------------
# In-process: the writes themselves, and what a resume does with leftovers.
# ---------------------------------------------------------------------------


class ListingDense(keras.layers.Dense):
    """Records its folder's contents while its variables are being written."""

    folder = None
    seen: list = []

    def save_own_variables(self, store):
        super().save_own_variables(store)
        ListingDense.seen.append(sorted(os.listdir(ListingDense.folder)))


def listing_model():
    model = keras.Sequential([keras.Input((4,)), ListingDense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("method, name", [("save", "m.keras"), ("save_weights", "m.weights.h5")])
def test_tfdist_models_write_a_temporary_file_and_other_models_write_in_place(method, name, tmp_path):
    ListingDense.folder = str(tmp_path)
    ListingDense.seen = []
    getattr(listing_model(), method)(str(tmp_path / name))
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        distributed = listing_model()
    getattr(distributed, method)(str(tmp_path / name))
    assert ListingDense.seen == [[name], [f".tfdist-{os.getpid()}-{name}", name]]
    assert listing(tmp_path) == [name]


def test_a_failed_write_leaves_the_previous_file_and_no_temporary_file(tmp_path):
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        model = listing_model()
    path = tmp_path / "m.weights.h5"
    model.save_weights(str(path))
    before = path.read_bytes()

    def fail(temporary):
        with open(temporary, "wb") as f:
            f.write(b"half")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        checkpointing.write_atomically(str(path), fail)
    assert path.read_bytes() == before
    assert listing(tmp_path) == ["m.weights.h5"]


def write(path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def test_a_resume_completes_a_backup_killed_between_its_two_renames(tmp_path):
    weights, meta = str(tmp_path / "latest.weights.h5"), str(tmp_path / "training_metadata.json")
    write(weights, "epoch 2 weights")  # already renamed into place
    write(meta, '{"epoch": 1, "batch": 0}')
    write(tmp_path / ".tfdist-123-training_metadata.json", '{"epoch": 2, "batch": 0}')
    assert checkpointing.recover_backup(str(tmp_path), weights, meta, writer=True) == []
    assert listing(tmp_path) == ["latest.weights.h5", "training_metadata.json"]
    assert json.loads(open(meta).read()) == {"epoch": 2, "batch": 0}


@pytest.mark.parametrize("writer, left", [
    (True, []),
    (False, [".tfdist-123-.tfdist-123-latest.weights.h5", ".tfdist-123-training_metadata.json",
             ".tfdist-77-latest.weights.h5"]),
])
def test_a_resume_discards_unfinished_backup_writes_in_the_writers_folder_only(writer, left, tmp_path):
    weights, meta = str(tmp_path / "latest.weights.h5"), str(tmp_path / "training_metadata.json")
    write(weights, "epoch 1 weights")
    write(meta, '{"epoch": 1, "batch": 0}')
    # Process 123 was writing its weights (through the parameter-server loop's
    # own temporary name) and had written its metadata; process 77 had begun.
    write(tmp_path / ".tfdist-123-.tfdist-123-latest.weights.h5", "half")
    write(tmp_path / ".tfdist-123-training_metadata.json", '{"epoch": 2, "batch": 0}')
    write(tmp_path / ".tfdist-77-latest.weights.h5", "ha")
    removed = checkpointing.recover_backup(str(tmp_path), weights, meta, writer=writer)
    assert removed == ([] if not writer else [".tfdist-123-.tfdist-123-latest.weights.h5",
                                               ".tfdist-123-training_metadata.json",
                                               ".tfdist-77-latest.weights.h5"])
    assert listing(tmp_path) == sorted(left + ["latest.weights.h5", "training_metadata.json"])
    assert json.loads(open(meta).read()) == {"epoch": 1, "batch": 0}


def test_leftovers_of_writers_that_are_gone_are_removed_before_the_next_write(tmp_path):
    child = subprocess.Popen(["true"])
    child.wait()
    gone, alive = child.pid, os.getppid()
    for name in (f".tfdist-{gone}-m.keras", f".tfdist-{alive}-m.keras", f".tfdist-{gone}-other.keras"):
        write(tmp_path / name, "x")
    assert checkpointing.remove_leftovers(str(tmp_path), "m.keras") == [f".tfdist-{gone}-m.keras"]
    assert listing(tmp_path) == sorted([f".tfdist-{alive}-m.keras", f".tfdist-{gone}-other.keras"])


# ---------------------------------------------------------------------------
# Non-chief write directories (item 6).
# ---------------------------------------------------------------------------

MAKE_WRITE_DIR = """
import os
import types
from tfdist.strategies import multi_worker
task = types.SimpleNamespace(task_type="worker", task_id=1)
print(os.getpid(), multi_worker._worker_temp_dir(types.SimpleNamespace(cluster_config=task)), flush=True)
"""


@pytest.mark.usefixtures("no_leftover_processes")
def test_non_chief_write_dirs_go_at_exit_and_a_killed_workers_at_the_next_start(tmp_path):
    child = subprocess.Popen(["true"])
    child.wait()
    stale = tmp_path / f"tfdist_worker1_{child.pid}_abc"  # a SIGKILLed worker's
    running = tmp_path / f"tfdist_worker1_{os.getppid()}_def"  # a running worker's
    for folder in (stale, running):
        folder.mkdir()
        write(folder / "ckpt.weights.h5", "x")
    made = subprocess.run([sys.executable, "-c", MAKE_WRITE_DIR], env={**os.environ, **ENV, "TMPDIR": str(tmp_path)},
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert made.returncode == 0, made.stderr
    pid, path = made.stdout.split()
    assert os.path.dirname(path) == str(tmp_path)
    assert os.path.basename(path).startswith(f"tfdist_worker1_{pid}_")
    assert listing(tmp_path) == [running.name]  # the stale one at the start, the child's own at its exit
    assert multi_worker.remove_stale_write_dirs(str(tmp_path)) == []


# ---------------------------------------------------------------------------
# Errors name the file; checksums; a failed restore changes nothing; a full disk (issue 38, item 5).
# ---------------------------------------------------------------------------


def small_model():
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 4), np.float32), np.zeros((8, 3), np.float32), batch_size=4, verbose=0)
    return model


def overwrite_values(path, dataset: str) -> None:
    """Overwrites the first bytes of `dataset`'s values inside an HDF5 file, as a disk error would."""
    import h5py

    with h5py.File(path, "r") as h5:
        offset = h5[dataset].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x7f" * 8)


def test_a_weights_file_changed_after_its_write_is_an_error_naming_it_and_the_model_keeps_its_weights(tmp_path):
    model = small_model()
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    before = [w.copy() for w in model.get_weights()]
    overwrite_values(path, "layers/dense/vars/0")
    with pytest.raises(checkpointing.CheckpointError) as error:
        model.load_weights(path)
    assert str(error.value).startswith(
        f"Cannot read checkpoint '{path}': its values do not match its SHA-256 (")
    assert str(error.value).endswith(
        "The file was changed or damaged after it was written (a copy cut short, a disk error); restore it from "
        "another copy, or delete it to start over")
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Keras's own file (no checksum) still loads; a truncated one names the file.
    keras.Model.save_weights.__wrapped__(model, path)
    model.load_weights(path)
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(checkpointing.CheckpointError, match=rf"^Cannot read checkpoint '{path}': Unable to "
                                                            r"synchronously open file \(truncated file"):
        model.load_weights(path)


def test_a_keras_file_whose_bytes_changed_fails_its_crc_naming_the_file(tmp_path):
    model = small_model()
    path = str(tmp_path / "m.keras")
    model.save(path)
    data = bytearray(open(path, "rb").read())
    start = data.index(b"\x89HDF")  # the weights member, stored uncompressed
    data[start + 2000:start + 2008] = b"\x7f" * 8
    open(path, "wb").write(bytes(data))
    with pytest.raises(checkpointing.CheckpointError, match=rf"^Cannot read checkpoint '{path}': member "
                                                            r"'model.weights.h5' does not match its CRC-32"):
        model.load_weights(path)


def test_a_truncated_backup_metadata_fails_the_restore_before_any_weight_is_loaded(tmp_path):
    model = small_model()
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 3), np.float32)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)])
    meta = tmp_path / "training_metadata.json"
    meta.write_text(meta.read_text()[:10])
    with pytest.raises(ValueError) as json_error:
        json.loads(meta.read_text())
    fresh = small_model()
    fresh.set_weights([w + 1 for w in fresh.get_weights()])
    before = [w.copy() for w in fresh.get_weights()]
    with pytest.raises(checkpointing.CheckpointError) as error:
        fresh.fit(x, y, batch_size=4, epochs=2, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path))])
    assert str(error.value) == (
        f"Cannot read checkpoint '{meta}': {json_error.value}. The backup's weights were not loaded. Restore the "
        "file from another copy, or delete the backup folder to start over")
    for a, b in zip(before, fresh.get_weights()):
        np.testing.assert_array_equal(a, b)


FULL_DISK_JOB = """
import atexit, os, sys
import keras, numpy as np, tfdist
folder = sys.argv[1]
with tfdist.get_strategy("mirrored", devices=["/cpu:0"]).scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(200), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="mse")
model.fit(np.zeros((8, 64)), np.zeros((8, 10)), verbose=0)
path = os.path.join(folder, "m.weights.h5")
model.save_weights(path)
print("first", os.path.getsize(path), flush=True)
# After the traceback: what the failed write left (the tmpfs goes with the process).
atexit.register(lambda: print("left", os.listdir(folder), tfdist.checkpointing.verify(path) is not None, flush=True))
model.save_weights(path)
"""


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_write_that_does_not_fit_beside_the_previous_file_is_an_error_not_a_crash(tmp_path):
    # A 200 KiB tmpfs of its own (user and mount namespaces): the first 199 KB file fits, a
    # second copy beside it does not. h5py writing to the full disk segfaults (status -11).
    folder = tmp_path / "small"
    folder.mkdir()
    if not shutil.which("unshare") or subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode:
        pytest.skip("this host does not let the test make a user and mount namespace for a small tmpfs")
    shell = f'mount -t tmpfs -o size=200k tmpfs {folder} && exec "$@"'
    done = subprocess.run(["unshare", "-Urm", "sh", "-c", shell, "sh", sys.executable, "-c", FULL_DISK_JOB,
                           str(folder)], env={**os.environ, **ENV}, cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 1, done.stderr[-2000:]
    first, left = done.stdout.splitlines()
    size = int(first.split()[1])
    assert 150_000 < size <= 200 * 1024
    assert left == "left ['m.weights.h5'] True"  # the previous file, whole (its checksum verified)
    last = done.stderr.strip().splitlines()[-1]
    path = folder / "m.weights.h5"
    assert last.startswith(f"tfdist.checkpointing.CheckpointError: [Errno 28] Cannot write checkpoint '{path}': "
                           f"No space left on device. It needs {size / 1024:.0f} KiB beside the previous file until "
                           "the rename replaces it; ")
    assert last.endswith(f" are free in {folder}. Free space there or write elsewhere (docs/operations.md, "
                         "Checkpoints). The previous checkpoint there is untouched")

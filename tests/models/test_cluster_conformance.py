"""Model zoo conformance on real clusters (issue 13): every zoo model under multi_worker and parameter_server.

Two jobs, each started once per module (`tests/models/cluster_zoo_job.py`
is the script), then one test id per zoo model reads its results:

- multi_worker: a 2-worker job (`tfdist launch --workers 2`: TF_CONFIG on free
  127.0.0.1 ports, one CPU replica per worker) trains every zoo model in turn
  for one epoch (3 steps of the zoo's global batch of 16, dropout 0,
  `shuffle=False`; each worker is given the whole arrays and keeps its 8 of
  each batch) and evaluates it. Each model's weights must match single-device
  Keras trained on the same data from the same seed within the zoo entry's
  `tolerance`, both workers must end bit-identical, and `evaluate` must match
  one device's.
- parameter_server: TensorFlow's in-process cluster (2 worker and 1 ps
  servers, the coordinator in the job's process, as in TensorFlow's tutorial)
  trains every zoo model asynchronously for `PS_EPOCHS` epochs. Its final
  loss on the training data must be below the initial loss and within
  `PS_MARGIN` of the same model trained synchronously on one device for the
  same steps. Models the strategy refuses must raise exactly the refusal.

The single-device references are trained in this process while a job runs.
Both jobs run one after the other: run at the same time on the 2-core
machine they took longer (167 s against 143 s in one measurement).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.child_processes import descendants, no_leftover_processes  # noqa: F401 (fixture)
from tests.conftest import max_relative_difference
from tests.models.zoo import ZOO
from tests.strategies.ps_cluster import REPO

JOB = os.path.join(REPO, "tests", "models", "cluster_zoo_job.py")
MODELS = list(ZOO)
# Each job trains all 9 models; on the loaded 2-core machine the
# multi_worker job took 95-130 s and the parameter_server job 30-45 s.
MW_TIMEOUT_S = 300
PS_TIMEOUT_S = 200
MW_EPOCHS = 1  # 3 steps: the steps each zoo tolerance is stated for

# Asynchronous training: 10 epochs of 3 steps, summed over both workers.
# With 5, the rnn (SGD) had moved its loss on one device by only 0.027 (0.694
# to 0.668), too little to compare with; with 10 it moves 0.062, and the
# others 1.1 to 2.3 (transformer to 0.09, the lowest).
PS_EPOCHS = 10
PS_STEPS = PS_EPOCHS * 3
# The coordinator runs a closure again when it judges a busy worker lost
# (one more step each time; possible under heavy load on a 2-core machine).
PS_RETRIED_STEPS = 2
# The asynchronous final loss must lie within PS_MARGIN of the synchronous
# run's progress (initial - final loss) of the synchronous final loss: with
# 0.75, asynchronous training achieves at least a quarter of the synchronous
# decrease. Measured over 9 runs of the job, (final - synchronous final) /
# progress ranged from -0.02 to 0.55 (transformer 0.09..0.55: in one run under
# a loaded CI machine its first asynchronous epoch rose above the initial loss
# before falling; rnn 0.16..0.23, mlp 0.11..0.15, multi_io 0.05..0.10,
# recommender -0.02..0.05, shared_frozen within 0.004): the order in which two
# workers apply stale gradients varies with the load.
PS_MARGIN = 0.75
# Before Adam's update of a variable was one locked op on its ps task
# (`tfdist.engine.update.LockedInPlace`; before, ordered reads), the recommender diverged in 2 of 27
# runs of the job (epoch loss 3.9 to 2645): one worker read another's new m
# with its old v. The margin above now holds for every model.

# Evaluate on the trained weights: float32 forward passes of weights that
# agree within the model's tolerance; measured at most 2e-7.
EVALUATE_RTOL = 1e-5

PS_REFUSALS = {
    name: (
        "compile",
        "NotImplementedError: BatchNormalization(synchronized=True) under strategy 'parameter_server' "
        "is not supported: workers update the variables asynchronously, one batch at a time, with no "
        "global batch. Use a synchronous strategy (mirrored, multi_worker, ...) for this feature.",
    )
    for name in ("convnet", "resnet")
}
PS_REFUSALS["custom_step"] = (
    "compile",
    "NotImplementedError: A custom train_step under strategy 'parameter_server' is not supported: "
    "tfdist's step applies each worker's gradient to the variables on the ps tasks itself. "
    "Received: CustomStepModel.train_step overridden",
)




def _single_device_run(entry) -> dict:
    """One zoo model trained on one device: initial loss, weights and evaluate after
    `MW_EPOCHS`, then (the same run, continued) loss and steps after `PS_EPOCHS`."""
    x, y = entry.data()
    model = entry.make(seed=0, dropout=0.0)

    def evaluate():
        return model.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)

    run = {"initial_loss": evaluate()["loss"]}
    model.fit(x, y, batch_size=entry.batch_size, epochs=MW_EPOCHS, shuffle=False, verbose=0)
    run["mw_weights"] = model.get_weights()
    run["mw_evaluate"] = evaluate()
    model.fit(x, y, batch_size=entry.batch_size, epochs=PS_EPOCHS - MW_EPOCHS, shuffle=False, verbose=0)
    run["ps_final_loss"] = evaluate()["loss"]
    run["ps_steps"] = int(model.optimizer.iterations.numpy())
    return run


@functools.cache
def single_device_runs() -> dict:
    """`_single_device_run` of every zoo model, once per test process."""
    return {name: _single_device_run(entry) for name, entry in ZOO.items()}


def _assert_all_stopped(before: set) -> None:
    deadline = time.monotonic() + 5.0
    left = set(descendants(os.getpid())) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = set(descendants(os.getpid())) - before
    assert not left, f"processes left running after the job: {sorted(left)}"


def _record(out, name: str, value) -> None:
    # The measured numbers, for the README's "Models verified" table.
    with open(out / "measured.jsonl", "a") as f:
        f.write(json.dumps({"model": name, "value": value}) + "\n")


def _child_env() -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO)
    for name in ("TF_CONFIG", "TFDIST_RESTART_COUNT", "TFDIST_LOCAL_DEVICES"):
        env.pop(name, None)
    return env


def _run(out, command: list, env: dict, timeout: float) -> dict:
    """Runs a job (its output in `out/job.log`) while this process trains the single-device
    references; stops it after `timeout` seconds. Returns its exit code and log, and fails
    if it leaves a process running."""
    before = set(descendants(os.getpid()))
    deadline = time.monotonic() + timeout
    with open(out / "job.log", "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            single_device_runs()
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()  # `tfdist launch` stops its workers on SIGTERM
        finally:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    _assert_all_stopped(before)
    return {"code": proc.returncode, "log": (out / "job.log").read_text(errors="replace"), "out": out}


# ---------------------------------------------------------------------------
# multi_worker: one 2-worker job trains every model.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_worker_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo_multi_worker")
    command = [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "2", "--timeout", str(MW_TIMEOUT_S),
               "--", sys.executable, JOB, "multi_worker", str(out)]
    # TMPDIR: the non-chief's temporary write directories land in `out`.
    job = _run(out, command, {**_child_env(), "TMPDIR": str(out)}, MW_TIMEOUT_S + 30)
    assert job["code"] == 0, f"the job exited with {job['code']} (124: timed out):\n{job['log'][-4000:]}"
    tasks = {}
    for task in ("worker0", "worker1"):
        with open(job["out"] / f"{task}.json") as f:
            results = json.load(f)
        weights = np.load(job["out"] / f"{task}.npz")
        tasks[task] = (results, {k: weights[k] for k in weights.files})
    return {"tasks": tasks, "out": job["out"]}


def _weights(weights: dict, name: str) -> list:
    count = len([k for k in weights if k.startswith(f"{name}/")])
    return [weights[f"{name}/{i}"] for i in range(count)]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_trains_on_two_workers_like_one_device(name, multi_worker_job):
    entry = ZOO[name]
    (chief, chief_w), (other, other_w) = (multi_worker_job["tasks"][t] for t in ("worker0", "worker1"))
    assert chief["replicas"] == other["replicas"] == 2
    assert "error" not in chief[name] and "error" not in other[name], (chief[name], other[name])
    assert chief[name]["iterations"] == other[name]["iterations"] == MW_EPOCHS * 3
    ours, theirs = _weights(chief_w, name), _weights(other_w, name)
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)  # both workers bit-identical
    reference = single_device_runs()[name]
    difference = max_relative_difference(reference["mw_weights"], ours)
    _record(multi_worker_job["out"], name, difference)
    assert difference < entry.tolerance, (difference, entry.why)
    expected = reference["mw_evaluate"]
    assert sorted(chief[name]["evaluate"]) == sorted(expected)
    assert chief[name]["evaluate"] == pytest.approx(expected, rel=EVALUATE_RTOL)
    assert other[name]["evaluate"] == chief[name]["evaluate"]


# ---------------------------------------------------------------------------
# parameter_server: one in-process cluster trains every model asynchronously.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parameter_server_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo_parameter_server")
    command = [sys.executable, JOB, "parameter_server", str(out), str(PS_EPOCHS)]
    job = _run(out, command, {**_child_env(), "GRPC_FAIL_FAST": "use_caller"}, PS_TIMEOUT_S)
    assert job["code"] == 0, f"the job exited with {job['code']}:\n{job['log'][-4000:]}"
    with open(job["out"] / "parameter_server.json") as f:
        return {"results": json.load(f), "out": job["out"]}


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_trains_asynchronously_near_one_device(name, parameter_server_job):
    results = parameter_server_job["results"]
    assert (results["num_workers"], results["num_ps"]) == (2, 1)
    r = results[name]
    if name in PS_REFUSALS:
        where, error = PS_REFUSALS[name]
        assert (r.get("where"), r.get("error")) == (where, error)
        return
    assert "error" not in r, r
    reference = single_device_runs()[name]
    assert reference["ps_steps"] == PS_STEPS
    assert PS_STEPS <= r["iterations"] <= PS_STEPS + PS_RETRIED_STEPS, r
    # Before training the model is the one-device model: evaluate agrees.
    assert r["initial_loss"] == pytest.approx(reference["initial_loss"], rel=EVALUATE_RTOL)
    initial, sync_final, final = reference["initial_loss"], reference["ps_final_loss"], r["final_loss"]
    progress = initial - sync_final
    _record(parameter_server_job["out"], name, {"initial": initial, "final": final, "sync_final": sync_final,
                                                "of_progress": (final - sync_final) / progress})
    assert final < initial, r
    assert abs(final - sync_final) <= PS_MARGIN * progress, (r, sync_final)

"""Parameter-server training (issue 5): real TF servers, one process per task, on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import tfdist
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.strategies.ps_cluster import REPO, Cluster, free_ports

JOB = os.path.join(REPO, "tests", "strategies", "ps_job.py")
IN_PROCESS_JOB = os.path.join(REPO, "tests", "strategies", "ps_in_process_job.py")
CUSTOM_LOOP_JOB = os.path.join(REPO, "tests", "strategies", "ps_custom_loop_job.py")


def _tf_config(cluster: dict, task: str = "chief", index: int = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task, "index": index}})


def _result(log: str) -> dict:
    lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
    assert lines, log[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# ---------------------------------------------------------------------------
# Bad input, rejected before any server starts.
# ---------------------------------------------------------------------------


def _resolver(cluster: dict, task_type=None, task_id=None):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id, rpc_layer="grpc"
    )


@pytest.fixture
def environment(monkeypatch):
    """Sets how the cluster is given: `environment("TF_CONFIG", tf_config)`, `("tfdist launch", ...)`."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("TFDIST_RESTART_COUNT", raising=False)

    def set_up(kind: str, tf_config: str | None = None):
        if tf_config is not None:
            monkeypatch.setenv("TF_CONFIG", tf_config)
        if kind == "tfdist launch":
            monkeypatch.setenv("TFDIST_RESTART_COUNT", "0")  # as `tfdist launch` sets it

    return set_up


NO_PS = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
NO_CHIEF = {"worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
TUTORIAL = "(e.g. tfdist launch --chief --workers 2 --ps 1 -- python train.py)"
MULTI_WORKER = "; or use strategy 'multi_worker' for synchronous training without parameter servers."


@pytest.mark.parametrize(
    "kind, expected",
    [
        (
            "TF_CONFIG",
            "from TF_CONFIG. To fix it, add a 'ps' job to the cluster in every process's TF_CONFIG, "
            'e.g. "ps": ["host:2222"]' + MULTI_WORKER,
        ),
        (
            "tfdist launch",
            f"from the TF_CONFIG set by `tfdist launch`. To fix it, add --ps 1 to the `tfdist launch` "
            f"command {TUTORIAL}" + MULTI_WORKER,
        ),
        (
            "cluster_resolver",
            "from cluster_resolver=SimpleClusterResolver. To fix it, add a 'ps' job to the "
            'tf.train.ClusterSpec of the resolver passed as cluster_resolver=, e.g. {..., "ps": '
            '["localhost:2224"]}' + MULTI_WORKER,
        ),
    ],
)
def test_cluster_without_ps_tasks_is_rejected_naming_its_source(kind, expected, environment):
    if kind == "cluster_resolver":
        environment(kind)
        options = {"cluster_resolver": _resolver({"worker": ["127.0.0.1:2"]})}
        jobs = "['worker']"
    else:
        environment(kind, _tf_config(NO_PS))
        options = {}
        jobs = "['chief', 'worker']"
    with pytest.raises(tfdist.ClusterConfigError) as e:
        tfdist.get_strategy("parameter_server", **options)
    assert str(e.value) == (
        "Strategy 'parameter_server' needs a 'ps' job with at least one task to hold the variables. "
        f"Received: cluster jobs {jobs} " + expected
    )


def test_resolver_without_workers_is_rejected_naming_it(environment):
    environment("cluster_resolver")
    with pytest.raises(tfdist.ClusterConfigError) as e:
        tfdist.get_strategy("parameter_server", cluster_resolver=_resolver({"ps": ["127.0.0.1:3"]}))
    assert str(e.value) == (
        "Strategy 'parameter_server' needs a 'worker' job with at least one task to run the training "
        "steps. Received: cluster jobs ['ps'] from cluster_resolver=SimpleClusterResolver. To fix it, "
        "add a 'worker' job to the tf.train.ClusterSpec of the resolver passed as cluster_resolver=, "
        'e.g. {..., "worker": ["localhost:2224"]}.'
    )


@pytest.mark.parametrize(
    "kind, expected",
    [
        (
            "TF_CONFIG",
            "Strategy 'parameter_server' needs a 'chief' job in TF_CONFIG: the coordinator that builds "
            "the model and runs model.fit, and whose end the worker and ps tasks wait for. Received: "
            "cluster jobs ['ps', 'worker'] from TF_CONFIG. To fix it, add a 'chief' job to the cluster "
            "in every process's TF_CONFIG, e.g. \"chief\": [\"host:2222\"]; or coordinate from a process "
            "outside the cluster by passing it cluster_resolver=tf.distribute.cluster_resolver."
            "SimpleClusterResolver(cluster_spec, rpc_layer='grpc').",
        ),
        (
            "tfdist launch",
            "Strategy 'parameter_server' needs a 'chief' job in the TF_CONFIG set by `tfdist launch`: the "
            "coordinator that builds the model and runs model.fit, and whose end the worker and ps tasks "
            "wait for. Received: cluster jobs ['ps', 'worker'] from the TF_CONFIG set by `tfdist launch`. "
            f"To fix it, add --chief to the `tfdist launch` command {TUTORIAL}.",
        ),
    ],
)
def test_tf_config_without_chief_is_rejected_naming_its_source(kind, expected, environment):
    environment(kind, _tf_config(NO_CHIEF, task="worker"))
    with pytest.raises(tfdist.ClusterConfigError) as e:
        tfdist.get_strategy("parameter_server")
    assert str(e.value) == expected


def test_resolver_naming_a_missing_chief_task_is_rejected(environment):
    environment("cluster_resolver")
    with pytest.raises(tfdist.ClusterConfigError) as e:
        tfdist.get_strategy("parameter_server", cluster_resolver=_resolver(NO_CHIEF, "chief", 0))
    assert str(e.value) == (
        "Strategy 'parameter_server' got a resolver whose task is 'chief', but its cluster has no "
        "'chief' job. Received: task_type='chief' and cluster jobs ['ps', 'worker'] from "
        "cluster_resolver=SimpleClusterResolver. To coordinate from this process, outside the cluster, "
        "leave the resolver's task_type None, e.g. SimpleClusterResolver(cluster_spec, rpc_layer='grpc'); "
        "or add a 'chief' job to the tf.train.ClusterSpec of the resolver passed as cluster_resolver=, "
        'e.g. {..., "chief": ["localhost:2224"]}.'
    )


def test_evaluator_needs_a_chief(environment):
    environment("cluster_resolver")
    with pytest.raises(tfdist.ClusterConfigError) as e:
        tfdist.get_strategy("parameter_server", cluster_resolver=_resolver(NO_CHIEF, "evaluator", 0))
    assert str(e.value) == (
        "Strategy 'parameter_server' runs a sidecar evaluator beside a 'chief' job only: it evaluates "
        "the chief's checkpoints and exits when the chief does. Received: cluster jobs ['ps', 'worker'] "
        "from cluster_resolver=SimpleClusterResolver and task type 'evaluator'. To fix it, add a 'chief' "
        "job to the tf.train.ClusterSpec of the resolver passed as cluster_resolver=, e.g. {..., "
        '"chief": ["localhost:2224"]}; or call model.evaluate in the coordinating process.'
    )


def test_resolver_with_a_bad_address_is_rejected_naming_it(environment):
    environment("cluster_resolver")
    resolver = _resolver({"worker": ["localhost"], "ps": ["127.0.0.1:3"]})
    with pytest.raises(tfdist.ClusterConfigError) as e:
        tfdist.get_strategy("parameter_server", cluster_resolver=resolver)
    assert str(e.value) == (
        "cluster_resolver=SimpleClusterResolver: field 'cluster.worker[0]' must be a 'host:port' string "
        "such as 'localhost:2222'. Received: cluster.worker[0]='localhost' (no port)"
    )


def test_missing_tf_config_is_rejected(environment):
    environment("TF_CONFIG")
    with pytest.raises(tfdist.ClusterConfigError) as e:
        tfdist.get_strategy("parameter_server")
    assert str(e.value) == (
        "Strategy 'parameter_server' needs a cluster of worker and ps tasks. Set TF_CONFIG in every "
        "process, with a chief to coordinate (tfdist launch --chief --workers 2 --ps 1 -- python "
        "train.py does it for a local job), or pass cluster_resolver= a ClusterResolver of the worker "
        "and ps tasks to coordinate them from this process. Received: TF_CONFIG unset"
    )


@pytest.mark.parametrize(
    "spec", ["num_shards:0", "shards:2", "max_shard_bytes:-1", 3], ids=["zero", "unknown", "negative", "int"]
)
def test_bad_variable_partitioner_is_rejected(spec, monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        _tf_config({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}),
    )
    with pytest.raises(tfdist.OptionError) as e:
        tfdist.get_strategy("parameter_server", variable_partitioner=spec)
    assert str(e.value).startswith(
        "option 'variable_partitioner' must be 'num_shards:N' (every variable in N shards), "
        "'max_shard_bytes:B' (shards of at most B bytes), 'min_shard_bytes:B' (shards of at least "
        f"B bytes), or a tf.distribute.experimental.partitioners.Partitioner. Received: variable_partitioner={spec!r}"
    )


@pytest.mark.cluster
def test_model_code_on_a_worker_process_is_a_clear_error(tmp_path):
    # join=False hands a worker its server instead of blocking; building or
    # fitting a model there is a mistake that must say so.
    ports = free_ports(3)
    cluster = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{ports[1]}"],
        "ps": [f"127.0.0.1:{ports[2]}"],
    }
    script = (
        "import tfdist\n"
        "task = tfdist.get_strategy('parameter_server', join=False)\n"
        "print(type(task).__name__, task.task_type, task.task_id)\n"
        "try:\n"
        "    with task.scope():\n"
        "        pass\n"
        "except ValueError as e:\n"
        "    print('ERROR', e)\n"
    )
    env = dict(os.environ, TF_CONFIG=_tf_config(cluster, "worker", 0), TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "ServingTask worker 0"
    assert lines[1] == (
        "ERROR strategy.scope() was called in the 'worker' task 0 of a parameter-server job. Only the "
        "chief builds, compiles and fits the model; worker and ps tasks serve it. Let "
        "tfdist.get_strategy('parameter_server') block on these tasks (join=True, the default), "
        "which runs the model code on the chief only."
    )


def test_sidecar_evaluator_evaluates_the_chiefs_latest_checkpoint(monkeypatch, tmp_path, digits):
    from tests.conftest import build_model

    monkeypatch.setenv(
        "TF_CONFIG",
        _tf_config({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}, "evaluator"),
    )
    task = tfdist.get_strategy("parameter_server")
    assert type(task).__name__ == "EvaluatorTask" and task.task_type == "evaluator"
    x, y = digits
    trainer = build_model(seed=0)
    checkpoint = str(tmp_path / "model.weights.h5")
    with task.scope():
        model = build_model(seed=1)
    expected = []
    for _ in range(2):
        trainer.fit(x[:640], y[:640], batch_size=32, epochs=1, verbose=0)
        trainer.save_weights(checkpoint)
        expected.append(trainer.evaluate(x[1500:], y[1500:], verbose=0, return_dict=True))
        logs = task.evaluate_checkpoints(
            model, (x[1500:], y[1500:]), checkpoint, poll_seconds=0.01, max_evaluations=1
        )
        assert logs == [pytest.approx(expected[-1], rel=1e-6)]
    assert expected[1]["loss"] < expected[0]["loss"]


# ---------------------------------------------------------------------------
# No chief: the coordinator in the current process, as in TensorFlow's tutorial.
# ---------------------------------------------------------------------------


def _child_env() -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    for name in ("TF_CONFIG", "TFDIST_RESTART_COUNT", "TFDIST_LOCAL_DEVICES"):
        env.pop(name, None)
    return env


@pytest.mark.cluster
@pytest.mark.usefixtures("no_leftover_processes")
def test_in_process_cluster_without_chief_trains():
    # tests/strategies/ps_in_process_job.py: the tutorial's create_in_process_cluster
    # (2 workers and 1 ps as tf.distribute.Servers in the coordinator's process) and a
    # SimpleClusterResolver of worker and ps jobs only, naming no task.
    out = subprocess.run(
        [sys.executable, IN_PROCESS_JOB, "2", "1"], env=_child_env(), capture_output=True, text=True,
        timeout=120, cwd=REPO,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    r = _result(out.stdout)
    assert (r["task_type"], r["num_workers"], r["num_ps"]) == ("chief", 2, 1)
    assert r["variable_jobs"] == ["ps"]
    # 3 epochs of 20 steps, summed over both workers (one more per retried closure).
    assert 60 <= r["iterations"] <= 62, r
    loss = r["loss"]
    assert loss[0] > loss[1] > loss[2], r
    assert loss[2] < 0.5 * loss[0], r
    assert r["eval"]["accuracy"] > 0.6, r


@pytest.mark.cluster
@pytest.mark.usefixtures("no_leftover_processes")
def test_custom_training_loop_over_a_partitioned_embedding_updates_as_fit_does():
    # tests/strategies/ps_custom_loop_job.py: the tutorial's custom loop (GradientTape over
    # model.trainable_variables, optimizer.apply_gradients) with an Embedding split in 2 shards,
    # 1 worker and 2 ps in-process; then model.fit for as many steps on the same batches.
    out = subprocess.run(
        [sys.executable, CUSTOM_LOOP_JOB], env=_child_env(), capture_output=True, text=True,
        timeout=120, cwd=REPO,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    r = _result(out.stdout)
    assert r["shards"] == [[10, 8], [10, 8]] and r["kernel_sharded"] is False, r
    # One gradient per Keras variable, the embedding's regrouped from its shards.
    assert r["gradient_types"][0] == "IndexedSlices" and r["embedding_dense_shape"] == [20, 8], r
    assert len(r["gradient_types"]) == 3, r
    assert r["same_initial"] and r["moved"] > 0.1, r
    assert r["loop_iterations"] == r["fit_iterations"] == 4, r
    assert r["max_diff_loop_vs_fit"] <= 1e-5, r
    # A tape over ordinary variables in the same process, before and after the patch: unchanged.
    assert r["patched"] == [False, True], r
    before, after = r["ordinary_types"]
    assert before == after == ["EagerTensor", "EagerTensor", "IndexedSlices", "EagerTensor"], r
    assert r["ordinary_identical"], r


@pytest.mark.cluster
@pytest.mark.usefixtures("no_leftover_processes")
def test_worker_of_a_cluster_without_chief_serves_until_sigterm():
    # No chief to watch for the end of the job: the task serves until it is stopped.
    worker, ps = free_ports(2)
    script = (
        "import tensorflow as tf, tfdist\n"
        f"spec = tf.train.ClusterSpec({{'worker': ['127.0.0.1:{worker}'], 'ps': ['127.0.0.1:{ps}']}})\n"
        "resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(\n"
        "    spec, task_type='worker', task_id=0, rpc_layer='grpc')\n"
        "task = tfdist.get_strategy('parameter_server', cluster_resolver=resolver, join=False)\n"
        "print(task, flush=True)\n"
        "task.join()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=REPO,
    )
    try:
        from tfdist.strategies.parameter_server import _chief_reachable

        _wait_for(lambda: _chief_reachable(f"127.0.0.1:{worker}") or proc.poll() is not None, 60, "the server")
        time.sleep(2.0)  # serving: it must not exit by itself
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.startswith(f"<tfdist ServingTask worker:0 target='grpc://127.0.0.1:{worker}'>"), stdout


# ---------------------------------------------------------------------------
# A whole job: convergence, partitioning, save and load, input errors.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_main")
    with Cluster(JOB, ["main", str(out)], workers=2, ps=2, tmp_path=out) as cluster:
        cluster.start_all()
        code = cluster.wait_chief(timeout=240)
        exits = cluster.wait_all_exit(timeout=30)
        log = cluster.log()
        assert code == 0, log[-4000:]
        yield {"result": _result(log), "exits": exits, "log": log, "cluster": cluster.spec}


@pytest.mark.cluster
@pytest.mark.slow
def test_fit_converges_like_synchronous_training(main_job):
    r = main_job["result"]
    history = r["history"]
    assert len(history["loss"]) == 4
    # 4 epochs of ceil(1500 / 32) = 47 steps, summed over both workers. The count is
    # exact unless the coordinator judges a busy worker lost and runs a closure again
    # (one step each time; possible under heavy load on a 2-core machine).
    assert 4 * 47 <= r["iterations"] <= 4 * 47 + 2, r
    sync_loss, sync_acc = r["sync_eval"]
    ps_loss, ps_acc = r["ps_eval"]
    # Asynchronous updates on 2 workers land near the synchronous result on the same data
    # (sync: loss 0.129, accuracy 0.970; async runs: loss 0.14 to 0.18, accuracy 0.94 to 0.96).
    assert ps_loss < 2 * sync_loss, r
    assert ps_acc > sync_acc - 0.06, r
    assert history["loss"][-1] < history["loss"][0] / 3, r
    # The inline evaluation at the end of the last epoch is model.evaluate's.
    assert history["val_loss"][-1] == pytest.approx(ps_loss, rel=1e-6)


@pytest.mark.cluster
@pytest.mark.slow
def test_fit_on_arrays_runs_one_pass_of_batches(main_job):
    r = main_job["result"]
    # ceil(1500 / 64) = 24 steps, continuing from the trained weights.
    assert 24 <= r["numpy_steps"] <= 24 + 2, r["numpy_steps"]
    assert r["numpy_loss"][0] < r["history"]["loss"][0] / 3


@pytest.mark.cluster
@pytest.mark.slow
def test_tf_keras_fit_works_under_the_same_strategy(main_job):
    r = main_job["result"]
    assert r["tf_keras_iterations"] == 2 * 20
    # From near ln(10) = 2.3 down: 2 epochs of 20 steps.
    assert r["tf_keras_loss"][0] < 2.3
    assert r["tf_keras_loss"][1] < 0.6 * r["tf_keras_loss"][0]


@pytest.mark.cluster
@pytest.mark.slow
def test_every_task_exits_cleanly_when_the_chief_finishes(main_job):
    assert main_job["exits"] == {
        ("ps", 0): 0,
        ("ps", 1): 0,
        ("worker", 0): 0,
        ("worker", 1): 0,
        ("chief", 0): 0,
    }


@pytest.mark.cluster
@pytest.mark.slow
def test_each_ps_holds_only_its_partitions(main_job):
    placement = main_job["result"]["placement"]
    table = [(task, shape) for task, shape in placement["table/embeddings"]]
    assert table == [(0, [544, 8]), (1, [544, 8])]
    for path, parts in placement.items():
        if path.endswith("table_embeddings_momentum") or path.endswith("table_embeddings_velocity"):
            # Adam's moments of shard i live with shard i.
            assert [(task, shape) for task, shape in parts] == [(0, [544, 8]), (1, [544, 8])], path
    for path, parts in placement.items():
        assert all(task in (0, 1) for task, _ in parts), path  # nothing on the chief or workers


@pytest.mark.cluster
@pytest.mark.slow
def test_partitioned_embedding_survives_save_and_load(main_job):
    r = main_job["result"]
    assert r["emb_iterations"] == 3 * 30
    assert r["loaded_table_shape"] == [1088, 8]
    assert r["loaded_table_max_diff"] == 0.0
    assert r["loaded_predict_max_diff"] < 1e-5
    assert r["loaded_eval"] == pytest.approx(r["emb_eval"], rel=1e-5)
    # ModelCheckpoint wrote the model of the last epoch from the chief.
    assert r["checkpoint_eval"] == pytest.approx(r["emb_eval"], rel=1e-5)
    assert r["emb_loss"][-1] < 0.6 * r["emb_loss"][0]


@pytest.mark.cluster
@pytest.mark.slow
def test_input_that_workers_cannot_rebuild_is_rejected(main_job):
    r = main_job["result"]
    assert r["unsafe_error"] == (
        "ValueError: The dataset passed to fit is not per-worker-safe: it runs Python code of the "
        "chief process (op 'PyFunc', from Dataset.from_generator, tf.py_function or "
        "tf.numpy_function), and under strategy 'parameter_server' every worker builds its own copy "
        "of the input, where that Python code does not exist. Build the dataset from tensors or "
        "files instead, e.g. tf.data.Dataset.from_tensor_slices(...) or tf.data.TFRecordDataset(...)."
    )
    assert r["infinite_error"] == (
        "ValueError: fit under strategy 'parameter_server' needs `steps_per_epoch` for infinite "
        "data: each worker iterates its own copy of the input, so an epoch has no end of its own. "
        "Pass steps_per_epoch=N (steps per epoch, summed over workers). Received: "
        "steps_per_epoch=None with an infinite dataset"
    )


# ---------------------------------------------------------------------------
# Failures: a worker killed and restarted, then a ps task killed and the job restarted.
# ---------------------------------------------------------------------------


def _epochs(path: str) -> list[tuple[int, float]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(a), float(b)) for a, b in (line.split() for line in f if line.strip())]


@pytest.mark.cluster
@pytest.mark.slow
def test_worker_failure_is_survived_and_ps_failure_resumes_from_backup(tmp_path):
    epochs_file = str(tmp_path / "epochs.txt")
    cluster = Cluster(JOB, ["faults", str(tmp_path)], workers=2, ps=1, tmp_path=tmp_path)
    with cluster:
        chief = cluster.start_all(chief_args=["1000"])
        _wait_for(lambda: len(_epochs(epochs_file)) >= 1, 180, "the first epoch")

        # A worker dies mid-fit: the other one carries on, and the restarted one rejoins.
        cluster.kill("worker", 1)
        killed_at = len(_epochs(epochs_file))
        log_size = os.path.getsize(cluster.log_path("worker", 1))
        cluster.start("worker", 1)
        _wait_for(lambda: len(_epochs(epochs_file)) >= killed_at + 2, 120, "epochs while worker 1 is down")
        _wait_for(lambda: "BATCH" in cluster.log("worker", 1)[log_size:], 120, "worker 1 to rejoin")
        assert chief.poll() is None

        # A ps task dies: its variables are gone, so fit stops with a clear error.
        cluster.kill("ps", 0)
        code = cluster.wait_chief(timeout=120)
        log = cluster.log()
        assert code == 1, log[-3000:]
        match = re.search(
            r"tfdist\.engine\.parameter_server\.ParameterServerError: Training stopped in epoch (\d+): "
            r"ps task 0 \((127\.0\.0\.1:\d+)\) became unavailable, and the variables it held are lost\. "
            r"Restart the job; with keras\.callbacks\.BackupAndRestore\(backup_dir\) in fit's callbacks, "
            r"training resumes from the last completed epoch\.",
            log,
        )
        assert match, log[-3000:]
        failed_epoch = int(match.group(1))
        assert match.group(2) == cluster.spec["ps"][0]
        assert failed_epoch == len(_epochs(epochs_file))
        # The workers see the chief go and exit on their own.
        exits = cluster.wait_all_exit(timeout=30)
        assert exits[("worker", 0)] == 0 and exits[("worker", 1)] == 0
        loss_before = _epochs(epochs_file)[-1][1]

        # The job restarts (as `tfdist launch --restarts 1` would) and resumes from the backup.
        cluster.procs.clear()
        chief = cluster.start_all(chief_args=[str(failed_epoch + 1)])
        assert cluster.wait_chief(timeout=240) == 0, cluster.log()[-3000:]
        r = _result(cluster.log())
        resumed = _epochs(epochs_file)[failed_epoch:]
        assert [epoch for epoch, _ in resumed] == [failed_epoch]
        assert r["epochs_run"] == 1
        # Trained weights came back: a fresh model starts near loss 2.3.
        assert resumed[0][1] < loss_before + 0.2
        # Chance is 0.1; every CI run but one passed a bar of 0.9, and that one ended
        # at 0.899: where the kills land (timing) moves the result.
        assert r["eval"][1] > 0.85
        assert set(cluster.wait_all_exit(timeout=30).values()) == {0}

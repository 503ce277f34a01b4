"""No silent hang (issue 15, item 2): start-up and collective timeouts, with real processes.

Every job runs its tasks as separate processes on 127.0.0.1 with free ports;
each test stops every process it started. Collectives that TensorFlow aborts
run in those child processes, never in the test process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import tfdist
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tfdist import options as options_lib
from tfdist.cluster import ClusterConfigError, StartupTimeoutError
from tfdist.launch import free_ports

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timeouts_job.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def tf_config(ports, index, job="worker", cluster=None) -> str:
    cluster = cluster or {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


def child_env(config: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TFDIST_RESTART_COUNT", "TFDIST_LOCAL_DEVICES")}
    return {**env, **ENV, "TF_CONFIG": config}


def stop(*processes) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()


# Loads TensorFlow first, so that the time printed is when the strategy starts.
WAITING_TASK = textwrap.dedent("""
    import sys, time, tfdist
    tfdist.strategies
    print(f"creating {time.time():.3f}", flush=True)
    tfdist.get_strategy("multi_worker", startup_timeout=float(sys.argv[1]))
""")


def test_a_peer_that_never_starts_is_named_after_the_startup_timeout():
    ports = free_ports(2)  # nobody listens on worker:0's port
    task = subprocess.Popen([sys.executable, "-c", WAITING_TASK, "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(tf_config(ports, 1)))
    try:
        out, err = task.communicate(timeout=90)
        ended = time.time()
    finally:
        stop(task)
    assert task.returncode == 1
    assert err.rstrip().splitlines()[-1] == (
        "tfdist.cluster.StartupTimeoutError: TF_CONFIG: worker:1 waited 3 s (startup_timeout) for the other "
        f"tasks of the job, and 1 of 1 never answered: worker:0 at 127.0.0.1:{ports[0]} (connection refused). "
        "Start every task of the job (each runs the same script with its own TF_CONFIG), check their "
        "addresses, or wait longer with startup_timeout= (tfdist launch --startup-timeout S, environment "
        "TFDIST_STARTUP_TIMEOUT)."
    )
    waited = ended - float(out.split()[1])
    assert 3.0 <= waited < 8.0, waited


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_sigterm_and_sigint_end_a_process_waiting_for_its_peers(sig, status):
    ports = free_ports(2)
    # SIGINT at its default in the child: a process started in the background
    # by a shell without job control (CI under `make`) inherits SIGINT ignored,
    # and Python then never installs its handler, so no Ctrl-C could end it.
    task = subprocess.Popen([sys.executable, "-c", WAITING_TASK, "300"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(tf_config(ports, 0)),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # While it waits, the task listens on its own port (for its peers).
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and task.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", ports[0]), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(0.5)
        sent = time.monotonic()
        task.send_signal(sig)
        task.wait(timeout=10)
        took = time.monotonic() - sent
    finally:
        stop(task)
    assert task.returncode == status
    assert took < 3.0, took


def test_a_port_already_in_use_is_named(monkeypatch):
    monkeypatch.delenv("TFDIST_RESTART_COUNT", raising=False)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    other = free_ports(1)[0]
    try:
        with pytest.raises(ClusterConfigError) as e:
            tfdist.get_strategy("multi_worker", cluster=json.loads(tf_config([port, other], 0)))
        ps_cluster = {"chief": [f"127.0.0.1:{other}"], "worker": [f"127.0.0.1:{port}"], "ps": ["127.0.0.1:1"]}
        monkeypatch.setenv("TF_CONFIG", tf_config(None, 0, "worker", ps_cluster))
        with pytest.raises(ClusterConfigError) as ps_error:
            tfdist.get_strategy("parameter_server")
    finally:
        taken.close()
    for error in (e, ps_error):
        assert str(error.value) == (
            f"TF_CONFIG: port {port} of this task (worker:0, address '127.0.0.1:{port}') is already in use by "
            f"another process, so its TensorFlow server cannot start. Stop the process that holds it "
            f"(`ss -ltnp 'sport = :{port}'` shows it), or give worker:0 a free port in every process's "
            "TF_CONFIG (`tfdist launch` picks free ports itself)."
        )


def test_the_parameter_server_chief_names_the_tasks_that_never_answered(monkeypatch):
    monkeypatch.delenv("TFDIST_RESTART_COUNT", raising=False)
    chief, worker, ps = free_ports(3)
    cluster = {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"], "ps": [f"127.0.0.1:{ps}"]}
    monkeypatch.setenv("TF_CONFIG", tf_config(None, 0, "chief", cluster))
    start = time.monotonic()
    with pytest.raises(StartupTimeoutError) as e:
        tfdist.get_strategy("parameter_server", startup_timeout=1)
    assert 1.0 <= time.monotonic() - start < 4.0
    assert str(e.value) == (
        "TF_CONFIG: chief:0 waited 1 s (startup_timeout) for the other tasks of the job, and 2 of 2 never "
        f"answered: ps:0 at 127.0.0.1:{ps} (connection refused); worker:0 at 127.0.0.1:{worker} (connection "
        "refused). Start every task of the job (each runs the same script with its own TF_CONFIG), check "
        "their addresses, or wait longer with startup_timeout= (tfdist launch --startup-timeout S, "
        "environment TFDIST_STARTUP_TIMEOUT)."
    )


def test_timeouts_resolve_from_argument_environment_then_default(monkeypatch):
    option = options_lib.COLLECTIVE_TIMEOUT
    monkeypatch.delenv("TFDIST_COLLECTIVE_TIMEOUT", raising=False)
    assert options_lib.seconds(option, None, 600) == 600.0
    assert options_lib.seconds(option, 0, 600) == 0.0
    monkeypatch.setenv("TFDIST_COLLECTIVE_TIMEOUT", "45")
    assert options_lib.seconds(option, None, 600) == 45.0
    assert options_lib.seconds(option, 7, 600) == 7.0
    monkeypatch.setenv("TFDIST_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(tfdist.OptionError) as e:
        options_lib.seconds(option, None, 600)
    assert str(e.value) == (
        "Environment variable TFDIST_COLLECTIVE_TIMEOUT must be a number of seconds >= 0 (0 for no timeout). "
        "Received: TFDIST_COLLECTIVE_TIMEOUT='soon'"
    )
    with pytest.raises(tfdist.OptionError) as e:
        tfdist.get_strategy("multi_worker", startup_timeout=0)
    assert str(e.value) == "option 'startup_timeout' must be a number of seconds > 0. Received: startup_timeout=0"


def start_job(mode: str, collective_timeout: str):
    ports = free_ports(2)
    return [
        subprocess.Popen([sys.executable, JOB, mode, collective_timeout], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env(tf_config(ports, i)), cwd=REPO)
        for i in range(2)
    ]


def wait_for_line(process, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and process.poll() is not None:
            break
    raise AssertionError(f"no line starting with {prefix!r}; status {process.poll()}")


@pytest.mark.cluster
def test_a_worker_stuck_in_python_fails_its_peer_after_the_collective_timeout():
    # Worker 1 sleeps in Python before step 3; its TensorFlow heartbeats go on, so only the
    # collective timeout can end worker 0's wait.
    w0, w1 = start_job("hang", "8")
    try:
        assert wait_for_line(w0, "ready", 120).split()[2] == "collective_timeout=8.0"
        hung_at = float(wait_for_line(w1, "hanging", 120).split()[1])
        _, err = w0.communicate(timeout=60)
        ended = time.time()
        assert w1.poll() is None  # still asleep: TensorFlow cannot tell it is stuck
    finally:
        stop(w0, w1)
    assert w0.returncode == 1
    assert "DeadlineExceededError" in err and "Collective has timed out during execution." in err
    # The timeout fired (8 s), not the default 600 s; the rest is the process's exit, up to
    # 20.7 s measured on the 2-core machine with another cluster test beside the suite.
    assert 8.0 <= ended - hung_at < 40.0, ended - hung_at


@pytest.mark.cluster
def test_a_stopped_worker_is_named_by_its_peer_within_the_heartbeat_timeout():
    w0, w1 = start_job("train", "default")
    try:
        # The default collective timeout of a 2-worker job.
        assert wait_for_line(w0, "ready", 120).split()[2] == "collective_timeout=600.0"
        wait_for_line(w1, "step 2", 120)
        w1.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = w0.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        stop(w0, w1)
    assert w0.returncode == 1
    assert "UnavailableError" in err
    assert "The following tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1" in err
    assert 5.0 <= took < 30.0, took


def test_a_collective_timeout_is_explained_naming_the_option_and_the_tasks(monkeypatch):
    # The explanation alone (the cluster job above shows TensorFlow's error): a strategy of a
    # 2-worker cluster is not created here, as it would start a TensorFlow server in this process.
    import tensorflow as tf

    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = tfdist.get_strategy("multi_worker", collective_timeout=8)
    strategy.cluster_config = tfdist.cluster.ClusterConfig.create(
        {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "worker", 0
    )
    timeout = tf.errors.DeadlineExceededError(None, None, "Collective has timed out during execution.")
    explained = strategy.explain_collective_error(timeout)
    assert type(explained) is tf.errors.DeadlineExceededError
    assert explained.message == (
        "A collective (all-reduce or broadcast) of worker:0 waited longer than collective_timeout=8 s for "
        "the other tasks of the job (worker:0 at 127.0.0.1:2222, worker:1 at 127.0.0.1:2223): one of them "
        "is stuck in Python, much slower, or gone without its TensorFlow runtime noticing; TensorFlow cannot "
        "tell which. Look at the other tasks' output. If a task legitimately takes longer between steps (the "
        "chief writing a large checkpoint, a slow first step), raise collective_timeout= (environment "
        "TFDIST_COLLECTIVE_TIMEOUT; 0 turns it off). TensorFlow aborted this process's collectives: restart "
        "the job (tfdist launch --restarts K).\n"
        "TensorFlow's error: Collective has timed out during execution."
    )
    other = tf.errors.UnavailableError(None, None, "The following tasks are unhealthy")
    assert strategy.explain_collective_error(other) is None


@pytest.mark.cluster
def test_workers_with_different_numbers_of_batches_are_told_the_cause():
    # Worker 1's input ends after 3 batches while worker 0's goes on: its "has another
    # batch" agreement (int64) meets worker 0's gradient all-reduce (float32) under one
    # collective instance, and TensorFlow says only "Collective instance N expected type 0
    # and data_type 9 but got type 0 and data_type 1".
    w0, w1 = start_job("uneven", "default")
    try:
        _, err1 = w1.communicate(timeout=120)
        _, err0 = w0.communicate(timeout=60)
    finally:
        stop(w0, w1)
    assert (w0.returncode, w1.returncode) == (1, 1)
    err = err0 + err1
    assert "errors_impl.InternalError: " + WORKERS_DISAGREE in err
    assert "expected type 0 and data_type 9 but got type 0 and data_type 1" in err


WORKERS_DISAGREE = (
    "The workers of the job reached different collectives at the same point of training: most often "
    "their inputs hold different numbers of batches (one worker's input ended while another's went on), "
    "else the workers run different models or step options (bucket_bytes, precision, accumulation_steps, "
    "sink_size must be the same on every worker). Give every worker the same number of batches: let "
    "tf.data shard one dataset (auto_shard 'auto' or 'data'), or repeat() it and pass steps_per_epoch; "
    "and run the same script with the same options everywhere. TensorFlow aborted this process's "
    "collectives: restart the job.\n"
)


def test_collectives_that_differ_between_workers_are_explained(monkeypatch):
    import tensorflow as tf

    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = tfdist.get_strategy("multi_worker")
    types = "Collective instance 114 expected type 0 and data_type 9 but got type 0 and data_type 1"
    shapes = "Shape mismatch in the collective instance 119. Op at device ... expected shape [13]"
    # One worker: there is no other worker to disagree with.
    assert strategy.explain_collective_error(tf.errors.InternalError(None, None, types)) is None
    # A strategy of a 2-worker cluster would start a server in this process.
    strategy.cluster_config = tfdist.cluster.ClusterConfig.create(
        {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "worker", 0
    )
    for error_type, text in ((tf.errors.InternalError, types), (tf.errors.InvalidArgumentError, shapes)):
        explained = strategy.explain_collective_error(error_type(None, None, text))
        assert type(explained) is error_type
        assert explained.message == WORKERS_DISAGREE + "TensorFlow's error: " + text
    assert strategy.explain_collective_error(tf.errors.InternalError(None, None, "Missing 1-th output")) is None

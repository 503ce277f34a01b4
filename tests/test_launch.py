"""`tfdist launch` (issue 4): local jobs start, report, restart and stop completely.

The processes here are tiny Python scripts that do not import TensorFlow, so
the launcher's behaviour is tested in seconds; tests/strategies/test_multi_worker.py
runs real TensorFlow jobs through it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tfdist import launch
from tfdist.launch import run_job

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(tmp_path, body: str, name: str = "job.py") -> list[str]:
    path = tmp_path / name
    path.write_text(
        "import json, os, subprocess, sys, time\n"
        "config = json.loads(os.environ['TF_CONFIG'])\n"
        "role = f\"{config['task']['type']}:{config['task']['index']}\"\n"
        "attempt = int(os.environ['TFDIST_RESTART_COUNT'])\n"
        "out = sys.argv[1]\n" + textwrap.dedent(body)
    )
    return [sys.executable, str(path), str(tmp_path)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_each_process_gets_its_tf_config_and_prefixed_output(tmp_path, capsys):
    command = script(tmp_path, """
        print("hello from", role)
        with open(os.path.join(out, role + ".tmp"), "w") as f:
            json.dump({"config": config, "devices": os.environ.get("TFDIST_LOCAL_DEVICES")}, f)
        os.rename(os.path.join(out, role + ".tmp"), os.path.join(out, role + ".json"))
        # The evaluator is stopped when the job ends: the chief waits for it to have written.
        while role == "chief:0" and not os.path.exists(os.path.join(out, "evaluator:0.json")):
            time.sleep(0.01)
    """)
    assert run_job(command, workers=2, chief=True, evaluator=True, env={"TFDIST_LOCAL_DEVICES": "3"}) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == [
        "[chief:0] hello from chief:0",
        "[evaluator:0] hello from evaluator:0",
        "[worker:0] hello from worker:0",
        "[worker:1] hello from worker:1",
    ]
    seen = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in ("chief:0", "worker:0", "worker:1",
                                                                           "evaluator:0")}
    cluster = seen["chief:0"]["config"]["cluster"]
    assert sorted(cluster) == ["chief", "worker"]  # the evaluator is not in the cluster, as TF expects
    addresses = cluster["chief"] + cluster["worker"]
    assert len(addresses) == 3 and len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") and int(a.split(":")[1]) > 0 for a in addresses)
    for role, data in seen.items():
        job, index = role.split(":")
        assert data["config"] == {"cluster": cluster, "task": {"type": job, "index": int(index)}}
        assert data["devices"] == "3"


def test_failure_stops_the_others_and_reports_the_last_lines(tmp_path, capsys):
    command = script(tmp_path, """
        if role == "worker:1":
            while not os.path.exists(os.path.join(out, "grandchild.pid")):
                time.sleep(0.01)
            for i in range(30):
                print("step", i)
            sys.exit(3)
        child = subprocess.Popen(["sleep", "60"])  # in the worker's process group
        open(os.path.join(out, "grandchild.tmp"), "w").write(str(child.pid))
        os.rename(os.path.join(out, "grandchild.tmp"), os.path.join(out, "grandchild.pid"))
        time.sleep(60)
        print("worker 0 was not stopped")
    """)
    assert run_job(command, workers=2) == 3
    captured = capsys.readouterr()
    assert "worker 0 was not stopped" not in captured.out
    assert "[worker:1] step 29" in captured.out.splitlines()
    expected_tail = "\n".join(f"    step {i}" for i in range(10, 30))  # the last 20 lines
    assert captured.err == (
        f"tfdist launch: worker:1 exited with status 3; stopping the job. Its last lines:\n{expected_tail}\n"
        "tfdist launch: the job failed 1 time(s); giving up.\n"
        "tfdist launch: summary: worker:0  stopped by the launcher  restarts 0\n"
        "tfdist launch: summary: worker:1  exited with status 3     restarts 0  last error: step 29\n"
    )
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert not alive(grandchild)


def test_killed_process_is_named_with_its_signal(tmp_path, capsys):
    command = script(tmp_path, """
        if role == "worker:0":
            print("going")
            os.kill(os.getpid(), 9)
        time.sleep(60)
    """)
    assert run_job(command, workers=2) == 137
    assert capsys.readouterr().err.startswith(
        "tfdist launch: worker:0 was killed by signal SIGKILL; stopping the job. Its last lines:\n    going\n"
    )


def test_status_is_the_chiefs_and_servers_are_stopped(tmp_path, capsys):
    # ps tasks and the evaluator serve until stopped; the chief decides the job.
    command = script(tmp_path, """
        open(os.path.join(out, role + ".tmp"), "w").write(str(os.getpid()))
        os.rename(os.path.join(out, role + ".tmp"), os.path.join(out, role + ".pid"))
        if role in ("ps:0", "ps:1", "evaluator:0"):
            time.sleep(600)
        while not all(os.path.exists(os.path.join(out, r + ".pid")) for r in ("ps:0", "ps:1", "evaluator:0")):
            time.sleep(0.01)
        print("trained")
    """)
    assert run_job(command, workers=1, chief=True, ps=2, evaluator=True) == 0
    for role in ("ps:0", "ps:1", "evaluator:0"):
        assert not alive(int((tmp_path / f"{role}.pid").read_text()))
    assert sorted(capsys.readouterr().out.splitlines()) == ["[chief:0] trained", "[worker:0] trained"]


def test_restarts_run_the_whole_job_again(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    command = script(tmp_path, """
        open(os.path.join(out, f"{attempt}-{role}"), "w").close()
        if attempt < 2 and role == "worker:1":
            while not os.path.exists(os.path.join(out, f"{attempt}-worker:0")):
                time.sleep(0.01)
            print(f"failing in attempt {attempt}")  # not the same failure twice: no early stop
            sys.exit(7)
        if attempt < 2:
            time.sleep(60)
    """)
    assert run_job(command, workers=2, restarts=3) == 0
    runs = sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit())
    assert runs == ["0-worker:0", "0-worker:1", "1-worker:0", "1-worker:1", "2-worker:0", "2-worker:1"]
    err = capsys.readouterr().err
    assert err.count("worker:1 exited with status 7") == 2
    assert "tfdist launch: restarting the job (restart 1 of 3) in 0.01 s.\n" in err
    assert "tfdist launch: restarting the job (restart 2 of 3) in 0.02 s.\n" in err
    assert "restart 3 of 3" not in err
    assert err.endswith(
        "tfdist launch: summary: worker:0  exited with status 0  restarts 2\n"
        "tfdist launch: summary: worker:1  exited with status 0  restarts 2  error before a restart: failing in attempt 1\n"
    )


def test_restarts_give_up_after_k_and_return_the_failure(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    command = script(tmp_path, "sys.exit(5)\n")
    assert run_job(command, workers=1, restarts=1) == 5
    err = capsys.readouterr().err
    assert err.count("worker:0 exited with status 5") == 2
    assert err.endswith(
        "tfdist launch: the job failed 2 time(s); giving up.\n"
        "tfdist launch: summary: worker:0  exited with status 5  restarts 1\n"
    )


def test_timeout_stops_everything(tmp_path, capsys):
    command = script(tmp_path, "time.sleep(600)\n")
    assert run_job(command, workers=2, timeout=1.0) == 124
    assert capsys.readouterr().err == (
        "tfdist launch: the job did not finish within the timeout; stopped all 2 processes.\n"
        "tfdist launch: summary: worker:0  stopped by the launcher  restarts 0\n"
        "tfdist launch: summary: worker:1  stopped by the launcher  restarts 0\n"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(command="python train.py", workers=2),
         "Argument 'command' must be a non-empty list of strings, e.g. ['python', 'train.py']. "
         "Received: command='python train.py'"),
        (dict(command=["python"], workers=0),
         "A job needs at least one training process: pass workers >= 1 or chief=True. "
         "Received: workers=0, chief=False"),
        (dict(command=["python"], workers=2, restarts=-1),
         "Argument 'restarts' must be an integer >= 0. Received: restarts=-1"),
        (dict(command=["python"], workers=2, timeout=0),
         "Argument 'timeout' must be a number of seconds > 0 or None. Received: timeout=0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError) as e:
        run_job(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workers", "0"], "tfdist launch: A job needs at least one training process: pass --workers 1 or "
                             "more, or --chief. Received: workers=0, chief=False"),
        (["--workers", "2", "--timeout", "0"], "tfdist launch: --timeout must be a number of seconds > 0 "
                                               "(leave --timeout out for no limit). Received: timeout=0.0"),
    ],
)
def test_bad_command_line_arguments_are_named_by_their_flags(flags, message, capsys):
    from tfdist.cli import main

    assert main(["launch", *flags, "--", sys.executable, "-c", "pass"]) == 2
    assert capsys.readouterr().err.strip() == message


def test_cli_ctrl_c_stops_every_process(tmp_path):
    command = script(tmp_path, """
        open(os.path.join(out, role + ".pid"), "w").write(str(os.getpid()))
        print("ready", flush=True)
        time.sleep(600)
    """)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "2", "--", *command],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    try:
        ready = []
        while len(ready) < 2:
            line = launcher.stdout.readline()
            assert line, "launcher ended before its workers were ready"
            if line.rstrip().endswith("ready"):
                ready.append(line.split()[0])
        assert sorted(ready) == ["[worker:0]", "[worker:1]"]
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == launch.EXIT_INTERRUPTED
        assert "tfdist launch: SIGINT received; stopped every process of the job." in launcher.stderr.read()
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        launcher.stderr.close()
    for role in ("worker:0", "worker:1"):
        pid = int((tmp_path / f"{role}.pid").read_text())
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)


def test_cli_without_a_command_exits_2(capsys):
    from tfdist.cli import main

    assert main(["launch", "--workers", "2"]) == 2
    assert capsys.readouterr().err == (
        "tfdist launch: no command given. Usage: tfdist launch --workers 2 -- python train.py\n"
    )


def test_with_parameter_servers_the_job_ends_with_the_chief(tmp_path, capsys, monkeypatch):
    # Under the parameter-server strategy workers serve until stopped: the job
    # ends with the chief, without waiting for them (with a wait as long as the
    # timeout, the job would time out: status 124).
    monkeypatch.setattr(launch, "FINISH_GRACE_S", 600.0)
    command = script(tmp_path, """
        if role != "chief:0":
            time.sleep(600)
        print("chief done")
    """)
    assert run_job(command, workers=2, chief=True, ps=1, timeout=30) == 0
    assert capsys.readouterr().out.splitlines() == ["[chief:0] chief done"]


def test_chief_led_synchronous_workers_may_finish_after_the_chief(tmp_path, capsys):
    command = script(tmp_path, """
        if role == "worker:0":
            time.sleep(1)
        print("done")
    """)
    assert run_job(command, workers=1, chief=True) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[chief:0] done", "[worker:0] done"]


def test_with_parameter_servers_a_failed_worker_restarts_in_place(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    # Under the parameter-server strategy the chief's coordinator reschedules a
    # dead worker's steps; the launcher brings the worker back at the same
    # address so it rejoins. The chief finishes only once the restarted
    # worker:1 has been seen; the job's status is the chief's.
    command = script(tmp_path, """
        with open(os.path.join(out, f"{role}-{attempt}"), "w") as f:
            f.write(json.dumps(config["cluster"]))
        if role == "worker:1" and attempt == 0:
            sys.exit(9)
        if role == "chief:0":
            while not os.path.exists(os.path.join(out, "worker:1-1")):
                time.sleep(0.01)
            print("chief done")
            sys.exit(0)
        time.sleep(600)
    """)
    assert run_job(command, workers=2, chief=True, ps=1, restarts=2, timeout=60) == 0
    started = sorted(p.name for p in tmp_path.iterdir() if ":" in p.name)
    assert started == ["chief:0-0", "ps:0-0", "worker:0-0", "worker:1-0", "worker:1-1"]
    # Same cluster, same address: the restarted worker rejoins the running job.
    assert (tmp_path / "worker:1-0").read_text() == (tmp_path / "worker:1-1").read_text()
    captured = capsys.readouterr()
    assert ("tfdist launch: worker:1 exited with status 9; restarting it in place in 0.01 s "
            "(restart 1 of 2 for this worker).\n") in captured.err
    assert "tfdist launch: summary: worker:1  exited with status 0" not in captured.err  # it serves until stopped
    assert "tfdist launch: summary: worker:1  stopped by the launcher  restarts 1\n" in captured.err
    assert "restarting the job" not in captured.err
    assert "[chief:0] chief done" in captured.out


def test_with_parameter_servers_a_worker_that_keeps_failing_fails_the_job(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    command = script(tmp_path, """
        if role == "worker:0":
            sys.exit(4)
        time.sleep(600)
    """)
    assert run_job(command, workers=1, chief=True, ps=1, restarts=1, timeout=60) == 4
    err = capsys.readouterr().err
    assert "worker:0 exited with status 4; restarting it in place in 0.01 s (restart 1 of 1 for this worker)." in err
    assert "worker:0 exited with status 4; stopping the job." in err

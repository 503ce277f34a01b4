"""`tfdist launch` as an operator meets it (issue 15): a launcher that owns its tasks.

Signals to the launcher (SIGKILL included) end every task; restarts back off
and stop when a failure repeats with no progress; each task's output is
prefixed, other tasks' progress bars and TensorFlow's start-up noise dropped;
each task's temporary directory goes when it ends; usage errors name the fix.

The tasks are tiny Python scripts, without TensorFlow except where real
TensorFlow servers show what reaches them with and without
`--private-network`. Launchers that must be signalled run in their own process
from `tfdist/launch.py` loaded by path, which imports nothing of tfdist or
TensorFlow, so they start in well under a second.
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

from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.test_launch import REPO, alive, script
from tfdist import launch
from tfdist.launch import run_job

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

LAUNCH_PY = os.path.join(REPO, "tfdist", "launch.py")


def start_launcher(tmp_path, body: str, workers: int, **settings) -> subprocess.Popen:
    """A launcher process running `run_job` on the task script `body`; `settings` override its constants.

    Its TMPDIR is `tmp_path / "tmp"`.
    """
    (tmp_path / "tmp").mkdir(exist_ok=True)
    command = script(tmp_path, body)
    driver = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("standalone_launch", {LAUNCH_PY!r})
        launch = sys.modules["standalone_launch"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(launch)
        for name, value in {settings!r}.items():
            setattr(launch, name, value)
        assert "tensorflow" not in sys.modules
        sys.exit(launch.run_job({command!r}, workers={workers}))
    """)
    return subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})


def wait_for_pids(tmp_path, roles, launcher, timeout=30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [tmp_path / f"{role}.pid" for role in roles]
        if all(f.exists() for f in files):
            return {role: int(f.read_text()) for role, f in zip(roles, files)}
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.02)
    raise AssertionError("the tasks did not start")


def wait_gone(pids, timeout: float) -> float:
    """Seconds until none of `pids` runs; fails after `timeout`."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        assert time.monotonic() - start < timeout, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.02)
    return time.monotonic() - start


def kill_all(launcher, pids) -> None:
    if launcher.poll() is None:
        launcher.kill()
    launcher.communicate()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


WRITE_PID_AND_SERVE = """
    tmp = os.path.join(out, role + ".tmp")
    open(tmp, "w").write(str(os.getpid()))
    os.rename(tmp, os.path.join(out, role + ".pid"))
    time.sleep(600)
"""


# ---------------------------------------------------------------------------
# Signals.
# ---------------------------------------------------------------------------


def test_sigkill_of_the_launcher_ends_every_task(tmp_path):
    launcher = start_launcher(tmp_path, WRITE_PID_AND_SERVE, workers=3)
    pids = {}
    try:
        pids = wait_for_pids(tmp_path, ["worker:0", "worker:1", "worker:2"], launcher)
        # Each task leads its own session, as before: only the parent-death
        # signal reaches it when the launcher cannot act.
        assert all(os.getsid(p) == p for p in pids.values())
        launcher.kill()
        launcher.wait()
        assert wait_gone(pids.values(), timeout=5.0) < 5.0
    finally:
        kill_all(launcher, pids.values())
    # A killed launcher cannot remove its temporary directory; the next launch does.
    tmp = tmp_path / "tmp"
    assert [p.name.startswith(f"tfdist_launch_{launcher.pid}_") for p in tmp.iterdir()] == [True]
    assert run_job([sys.executable, "-c", "pass"], workers=1, env={"TMPDIR": str(tmp)}) == 0
    assert list(tmp.iterdir()) == []


def test_what_a_failed_task_left_in_its_process_group_is_stopped(tmp_path):
    command = script(tmp_path, """
        if role == "worker:1":
            child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL)  # outlives worker:1
            open(os.path.join(out, "grandchild.pid"), "w").write(str(child.pid))
            sys.exit(3)
        time.sleep(600)
    """)
    assert run_job(command, workers=2) == 3
    assert not alive(int((tmp_path / "grandchild.pid").read_text()))


@pytest.mark.parametrize("sig, status", [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_sighup_and_sigterm_stop_the_job_killing_a_task_that_ignores_sigterm(tmp_path, sig, status):
    body = textwrap.dedent("""
        import signal
        if role == "worker:1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """) + textwrap.dedent(WRITE_PID_AND_SERVE)
    # After a signal to the launcher, tasks get the grace period to save (none here) before SIGKILL.
    launcher = start_launcher(tmp_path, body, workers=2, STOP_GRACE_S=1.0, GRACE_PERIOD_S=0.5)
    pids = {}
    try:
        pids = wait_for_pids(tmp_path, ["worker:0", "worker:1"], launcher)
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=20)
        assert launcher.returncode == status
        name = signal.Signals(sig).name
        assert err == (
            f"tfdist launch: {name} received; stopped every process of the job.\n"
            "tfdist launch: summary: worker:0  stopped by the launcher  restarts 0\n"
            "tfdist launch: summary: worker:1  stopped by the launcher  restarts 0\n"
        )
        assert not any(alive(p) for p in pids.values())
    finally:
        kill_all(launcher, pids.values())


# ---------------------------------------------------------------------------
# Restarts.
# ---------------------------------------------------------------------------


def test_backoff_doubles_from_one_second_up_to_thirty():
    assert [launch._backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert launch._backoff(0) == 1  # after a run that made progress


def test_restarts_of_a_command_that_fails_at_once_back_off(tmp_path, capsys, monkeypatch):
    # Each attempt fails differently (its number is its last line), so none is
    # the repeated failure that stops restarts early.
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.25)
    monkeypatch.setattr(launch, "BACKOFF_MAX_S", 0.6)
    command = script(tmp_path, """
        open(os.path.join(out, f"start-{attempt}"), "w").write(repr(time.monotonic()))
        print(f"attempt {attempt} fails")
        sys.exit(3)
    """)
    assert run_job(command, workers=1, restarts=3) == 3
    starts = [float((tmp_path / f"start-{i}").read_text()) for i in range(4)]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    for gap, wait in zip(gaps, [0.25, 0.5, 0.6]):
        assert wait <= gap < wait + 1.0, gaps
    err = capsys.readouterr().err
    for n, wait in ((1, "0.25"), (2, "0.5"), (3, "0.6")):
        assert f"tfdist launch: restarting the job (restart {n} of 3) in {wait} s.\n" in err


def test_a_failure_repeated_without_progress_stops_the_restarts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    command = script(tmp_path, """
        open(os.path.join(out, f"{attempt}-{role}"), "w").close()
        if role == "worker:1":
            print("loading the checkpoint")
            print("OSError: Unable to synchronously open file (bad object header version number)")
            sys.exit(1)
        time.sleep(600)
    """)
    assert run_job(command, workers=2, restarts=5) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit()) == [
        "0-worker:0", "0-worker:1", "1-worker:0", "1-worker:1",
    ]
    err = capsys.readouterr().err
    error = "OSError: Unable to synchronously open file (bad object header version number)"
    assert err.endswith(
        "tfdist launch: worker:1 failed as in its previous run (exited with status 1, last error: "
        f"{error}) within 60 s of its start, with no progress in between; a restart would fail the same "
        "way, so the job stops here.\n"
        "tfdist launch: summary: worker:0  stopped by the launcher  restarts 1\n"
        f"tfdist launch: summary: worker:1  exited with status 1     restarts 1  last error: {error}\n"
    )


def test_the_same_failure_after_progress_is_restarted(tmp_path, capsys, monkeypatch):
    # A run that lasted PROGRESS_S made progress (e.g. epochs checkpointed):
    # failing the same way again is worth another restart.
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(launch, "PROGRESS_S", 0.3)
    command = script(tmp_path, """
        time.sleep(0.4)
        print("RuntimeError: preempted")
        sys.exit(2)
    """)
    assert run_job(command, workers=1, restarts=2) == 2
    err = capsys.readouterr().err
    assert "restart 2 of 2" in err and "failed as in its previous run" not in err
    assert "tfdist launch: the job failed 3 time(s); giving up.\n" in err


def test_with_parameter_servers_a_worker_failing_the_same_way_is_not_restarted_again(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    command = script(tmp_path, """
        if role == "worker:0":
            print("ValueError: bad shard")
            sys.exit(4)
        time.sleep(600)
    """)
    assert run_job(command, workers=1, chief=True, ps=1, restarts=5, timeout=60) == 4
    err = capsys.readouterr().err
    assert err.count("restarting it in place") == 1
    assert ("tfdist launch: worker:0 failed as in its previous run (exited with status 4, last error: "
            "ValueError: bad shard) within 60 s of its start, with no progress in between; not restarting "
            "it again.\n") in err


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------

PRINTS = r"""
    print("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
    print("I0000 00:00:1795406845.583601   18024 port.cc:153] oneDNN custom operations are on.")
    # A multi-line log message: its second line names a task (was shown on its own).
    print("I0000 00:00:1795406846.1   18024 coordination_service.cc:1] Example stragglers:")
    print("/job:worker/replica:0/task:1")
    print("E0000 00:00:1795406848.832300   18024 cuda_platform.cc:52] failed call to cuInit: INTERNAL")
    print("To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
          "with the appropriate compiler flags.")
    print("W0000 00:00:1795406848.832300   18024 some_op.cc:7] a real warning")
    print("Epoch 1/1")
    sys.stdout.write("\r1/2 \x1b[32m━━\x1b[0m loss: 0.9")
    sys.stdout.write("\b" * 20 + "\r2/2 \x1b[32m━━━━\x1b[0m loss: 0.5   \n")
    print("trained", role)
"""


def test_output_is_prefixed_and_only_the_chiefs_progress_bars_are_shown(tmp_path, capsys):
    assert run_job(script(tmp_path, PRINTS), workers=2) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("[worker:0]")] == [
        "[worker:0] W0000 00:00:1795406848.832300   18024 some_op.cc:7] a real warning",
        "[worker:0] Epoch 1/1",
        "[worker:0] 2/2 \x1b[32m━━━━\x1b[0m loss: 0.5",
        "[worker:0] trained worker:0",
    ]
    assert [line for line in lines if line.startswith("[worker:1]")] == [
        "[worker:1] W0000 00:00:1795406848.832300   18024 some_op.cc:7] a real warning",
        "[worker:1] trained worker:1",
    ]
    assert len(lines) == 6


def test_all_progress_and_tf_logs_keep_everything(tmp_path, capsys):
    assert run_job(script(tmp_path, PRINTS), workers=2, all_progress=True, tf_logs=True) == 0
    lines = capsys.readouterr().out.splitlines()
    for role in ("worker:0", "worker:1"):
        mine = [line for line in lines if line.startswith(f"[{role}]")]
        assert len(mine) == 10
        assert mine[1] == f"[{role}] I0000 00:00:1795406845.583601   18024 port.cc:153] oneDNN custom operations are on."
        assert mine[3] == f"[{role}] /job:worker/replica:0/task:1"
        assert mine[8] == f"[{role}] 2/2 \x1b[32m━━━━\x1b[0m loss: 0.5"


def test_peers_complaining_once_the_job_has_finished_are_not_shown(tmp_path, capsys):
    # What worker 1 printed after every training process of a successful job
    # ended (issue 15: "StartAbort UNAVAILABLE ... leader task was preempted/died").
    command = script(tmp_path, """
        if role == "chief:0":
            print("E0000 00:00:1.0   1 coordination_service_agent.cc:1] UNAVAILABLE: before the end, shown")
            print("done")
            sys.exit(0)
        open(os.path.join(out, "worker.pid"), "w").write(str(os.getpid()))
        time.sleep(1.0)  # the chief has ended by now, and the launcher has seen it
        print("E0000 00:00:1.0   1 coordination_service_agent.cc:1] StartAbort UNAVAILABLE: leader task was "
              "preempted/died")
        print("bye")
    """)
    assert run_job(command, workers=1, chief=True) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == [
        "[chief:0] E0000 00:00:1.0   1 coordination_service_agent.cc:1] UNAVAILABLE: before the end, shown",
        "[chief:0] done",
        "[worker:0] bye",
    ]


def test_a_complaint_about_a_peer_that_already_exited_cleanly_is_not_shown(tmp_path, capsys):
    # What worker 0 (the chief) printed in benchmarks/vs_ddp.py's successful
    # jobs when worker 1 finished first: its coordination service reports that
    # task 1 stopped sending heartbeats. Task 1 had exited with status 0, so it
    # is the end of the job; a complaint about a task still running is shown.
    command = script(tmp_path, """
        if role == "worker:1":
            print("finished")
            sys.exit(0)
        if role == "worker:2":
            time.sleep(2.5)  # still running when worker 0 names it
            print("finished later")
            sys.exit(0)
        time.sleep(1.0)  # worker 1 has exited by now, and the launcher has seen it
        print("E0000 00:00:1.0   1 coordination_service_agent.cc:1] UNAVAILABLE: task "
              "/job:worker/replica:0/task:2 is unreachable")
        print("E0000 00:00:1.0   1 base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort "
              "UNAVAILABLE: Error reported from /job:worker/task:1: The following tasks are unhealthy "
              "(stopped sending heartbeats):")
        print("/job:worker/replica:0/task:1")
        print("The tasks have crashed. Check the task logs for an earlier error, or scheduler events "
              "(e.g. preemption, eviction) to debug further.")
        print("done")
    """)
    assert run_job(command, workers=3) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == [
        "[worker:0] E0000 00:00:1.0   1 coordination_service_agent.cc:1] UNAVAILABLE: task "
        "/job:worker/replica:0/task:2 is unreachable",
        "[worker:0] done",
        "[worker:1] finished",
        "[worker:2] finished later",
    ]


# ---------------------------------------------------------------------------
# Temporary directories.
# ---------------------------------------------------------------------------


def test_each_task_has_its_own_temporary_directory_removed_when_it_ends(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    parent = tmp_path / "tmp"
    parent.mkdir()
    command = script(tmp_path, """
        import tempfile
        mine = tempfile.mkdtemp(prefix=f"tfdist_{role.replace(':', '')}_")  # as a non-chief's write_dir
        open(os.path.join(mine, "ckpt"), "w").write("x")
        open(os.path.join(out, f"{attempt}-{role}.tmp"), "w").write(mine)
        if attempt == 1:
            previous = open(os.path.join(out, f"0-{role}.tmp")).read()
            print("previous attempt's directory exists:", os.path.exists(previous))
        if attempt == 0 and role == "worker:1":
            while not os.path.exists(os.path.join(out, "0-worker:0.tmp")):
                time.sleep(0.01)
            sys.exit(1)
        if attempt == 0:
            time.sleep(600)
    """)
    assert run_job(command, workers=2, restarts=1, env={"TMPDIR": str(parent)}) == 0
    made = {p.name: p.read_text() for p in tmp_path.iterdir() if p.name.endswith(".tmp")}
    assert sorted(made) == ["0-worker:0.tmp", "0-worker:1.tmp", "1-worker:0.tmp", "1-worker:1.tmp"]
    assert all(path.startswith(str(parent) + os.sep) for path in made.values())
    assert len(set(os.path.dirname(path) for path in made.values())) == 4  # one directory per task and run
    assert not any(os.path.exists(path) for path in made.values())
    assert os.listdir(parent) == []  # the launcher's own directory is gone too
    assert capsys.readouterr().out.count("previous attempt's directory exists: False") == 2


# ---------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------


def test_an_unknown_flag_is_a_usage_error_naming_it(capsys):
    from tfdist.cli import main

    with pytest.raises(SystemExit) as e:
        main(["launch", "--workers", "2", "--foo", "--", sys.executable, "-c", "pass"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith("tfdist launch: error: unrecognized arguments: --foo\n")


def test_a_flag_before_a_command_without_dashes_is_a_usage_error(capsys):
    from tfdist.cli import main

    with pytest.raises(SystemExit) as e:
        main(["launch", "--workers", "2", "--foo", "python", "train.py"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        "tfdist launch: error: unrecognized arguments: --foo python train.py. Put the command after --, "
        "e.g. tfdist launch --workers 2 -- python train.py\n"
    )


def test_a_command_that_does_not_exist_is_named(capsys):
    from tfdist.cli import main

    assert main(["launch", "--workers", "2", "--", "no-such-command-tfdist"]) == launch.EXIT_NOT_FOUND
    assert capsys.readouterr().err == (
        "tfdist launch: cannot start 'no-such-command-tfdist': No such file or directory. Check the command "
        "after `--`, e.g. tfdist launch --workers 2 -- python train.py\n"
    )


def test_the_command_keeps_its_own_flags_after_dashes(tmp_path, capsys):
    from tfdist.cli import main

    command = script(tmp_path, "print('args', sys.argv[2:])\n")
    assert main(["launch", "--workers", "1", "--", *command, "--workers", "7", "--", "x"]) == 0
    assert capsys.readouterr().out == "[worker:0] args ['--workers', '7', '--', 'x']\n"


def test_startup_timeout_flag_reaches_every_task(tmp_path, capsys):
    from tfdist.cli import main

    command = script(tmp_path, "print('startup', os.environ['TFDIST_STARTUP_TIMEOUT'])\n")
    assert main(["launch", "--workers", "2", "--startup-timeout", "45", "--", *command]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[worker:0] startup 45", "[worker:1] startup 45"]


def test_a_startup_timeout_that_is_not_positive_is_a_usage_error(capsys):
    from tfdist.cli import main

    assert main(["launch", "--workers", "2", "--startup-timeout", "0", "--", sys.executable, "-c", "pass"]) == 2
    assert capsys.readouterr().err == (
        "tfdist launch: --startup-timeout must be a number of seconds > 0. Received: --startup-timeout 0\n"
    )


# ---------------------------------------------------------------------------
# Preemption and jobs that change size (issue 38), with tasks that act as tfdist's do.
# ---------------------------------------------------------------------------

# A task that, on SIGTERM, prints the line tfdist.preemption prints after saving, and exits 0.
SAVES_ON_SIGTERM = """
    import signal
    def saved(signum, frame):
        cause = "SIGTERM" if role == "worker:0" else "stop signal to another task"
        print(f"tfdist: preempted ({cause}): {role} saved epoch 2, step 3 of 8 (optimizer step 11) to /runs/backup, "
              "0.20 s after the signal (the save took 0.05 s); exiting with status 0.", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, saved)
""" + WRITE_PID_AND_SERVE


def test_a_stop_signal_to_the_launcher_after_which_every_worker_saved_exits_0(tmp_path):
    launcher = start_launcher(tmp_path, SAVES_ON_SIGTERM, workers=2, GRACE_PERIOD_S=30.0)
    pids = {}
    try:
        pids = wait_for_pids(tmp_path, ["worker:0", "worker:1"], launcher)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=20)
        assert launcher.returncode == 0, err
        assert err == (
            "tfdist launch: SIGTERM received; every worker saved epoch 2, step 3 of 8 (optimizer step 11) and "
            "exited. Run the same command again to resume there (at any number of workers).\n"
            "tfdist launch: summary: worker:0  saved at epoch 2, step 3 of 8 (optimizer step 11) on SIGTERM and "
            "exited with status 0                      restarts 0\n"
            "tfdist launch: summary: worker:1  saved at epoch 2, step 3 of 8 (optimizer step 11) on stop signal to "
            "another task and exited with status 0  restarts 0\n"
        )
    finally:
        kill_all(launcher, pids.values())


def test_the_grace_period_reaches_every_task_and_bad_values_are_usage_errors(tmp_path, capsys):
    from tfdist.cli import main

    command = script(tmp_path, "print('grace', os.environ['TFDIST_GRACE_PERIOD'])\n")
    assert main(["launch", "--workers", "2", "--grace-period", "12.5", "--", *command]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[worker:0] grace 12.5", "[worker:1] grace 12.5"]
    assert main(["launch", "--workers", "1", "--grace-period", "0", "--", *command]) == 2
    assert capsys.readouterr().err == (
        "tfdist launch: --grace-period must be a number of seconds > 0. Received: --grace-period 0\n")


@pytest.mark.parametrize("flags, message", [
    (["--workers", "3:2"], "argument --workers: expected MIN:MAX with 1 <= MIN <= MAX (e.g. 2:4). Received: '3:2'"),
    (["--workers", "two"], "argument --workers: expected a number of workers N or a range MIN:MAX (e.g. 2:4). "
                           "Received: 'two'"),
])
def test_a_worker_range_that_is_not_one_is_a_usage_error(flags, message, capsys):
    from tfdist.cli import main

    with pytest.raises(SystemExit) as e:
        main(["launch", *flags, "--", sys.executable, "-c", "pass"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(f"tfdist launch: error: {message}\n")


def test_a_warning_is_not_named_as_the_last_error_of_a_failed_task(tmp_path, capsys):
    command = script(tmp_path, """
        print("epoch 3 done", flush=True)
        print("WARNING:tensorflow:From /x/failure_handling.py:805: PreemptionCheckpointHandler.total_run_calls "
              "(from tensorflow.python.distribute.failure_handling.failure_handling) is deprecated", flush=True)
        sys.exit(42)
    """)
    assert run_job(command, workers=1) == 42
    assert capsys.readouterr().err.endswith(
        "tfdist launch: summary: worker:0  exited with status 42  restarts 0  last error: epoch 3 done\n")


# Worker WORKERS:INDEX (of a job of that many) fails at once; the others print and succeed.
LOSES_A_WORKER = """
    size = len(config["cluster"]["worker"])
    if (size, config["task"]["index"]) in {(3, 2), (2, 1)}:
        print("machine lost", flush=True)
        sys.exit(3)
    print(f"tfdist: resumed from /runs/backup at epoch 1, step 4 of 8 (optimizer step 4): the next step is 5 "
          f"(saved by 3 worker(s), 3 replica(s); now {size}, {size}).", flush=True)
    time.sleep(0.5)
"""


def test_a_job_that_loses_workers_for_good_shrinks_to_its_minimum_and_then_gives_up(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "BACKOFF_START_S", 0.01)
    command = script(tmp_path, LOSES_A_WORKER)
    # 3 workers: worker 2 fails; at 2 workers, worker 1 fails; MIN is 2.
    assert run_job(command, workers=3, min_workers=2, restarts=0) == 3
    err = capsys.readouterr().err
    assert ("tfdist launch: worker:2 failed 1 time(s), more than --restarts 0 allows: restarting the job with the "
            "remaining 2 worker(s) (at least 2), resuming from its last checkpoint in 0.01 s.") in err
    assert ("tfdist launch: worker:1 failed 1 time(s), more than --restarts 0 allows, and the job cannot go below 2 "
            "worker(s); giving up.") in err
    assert ("tfdist launch: summary: the job went from 3 to 2 workers after worker:2 failed 1 time(s), more than "
            "--restarts 0 allows; the 2-worker job resumed at epoch 1, step 4 of 8 (optimizer step 4).") in err
    # At 1 as the minimum, the same job finishes with worker 0 alone.
    assert run_job(command, workers=3, min_workers=1, restarts=0) == 0
    err = capsys.readouterr().err
    assert "the job went from 2 to 1 workers after worker:1 failed 1 time(s)" in err


HELP_WITHOUT_PACKAGE_INIT = textwrap.dedent(f"""
    import sys, types
    # tfdist/__init__.py imports TensorFlow; the launcher's own modules must not.
    package = types.ModuleType("tfdist")
    package.__path__ = [{os.path.join(REPO, "tfdist")!r}]
    sys.modules["tfdist"] = package
    from tfdist import cli
    try:
        cli.main(["launch", "--help"])
    except SystemExit:
        pass
    print("tensorflow imported:", "tensorflow" in sys.modules, "keras imported:", "keras" in sys.modules)
""")


def test_launch_help_needs_neither_tensorflow_nor_keras():
    done = subprocess.run([sys.executable, "-c", HELP_WITHOUT_PACKAGE_INIT], capture_output=True, text=True,
                          timeout=60)
    assert "--all-progress" in done.stdout and "--tf-logs" in done.stdout
    assert done.stdout.splitlines()[-1] == "tensorflow imported: False keras imported: False"


@pytest.mark.parametrize("command", [
    ["-c", "from tfdist.cli import main; main(['launch', '--help'])"],  # the `tfdist` console script
    ["-m", "tfdist", "launch", "--help"],
])
def test_tfdist_launch_help_does_not_import_tensorflow(command):
    done = subprocess.run([sys.executable, "-X", "importtime", *command], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "--all-progress" in done.stdout and "--startup-timeout S" in done.stdout
    assert [m for m in imported if m.split(".")[0] in ("tensorflow", "keras")] == []


def test_the_package_loads_on_first_use_and_installs_the_keras_hooks_before_any_strategy():
    code = textwrap.dedent("""
        import sys
        import tfdist
        print("after import:", "tensorflow" in sys.modules)
        strategy = tfdist.get_strategy("mirrored")
        from tfdist._compat import patches
        print("after get_strategy:", "tensorflow" in sys.modules, "Trainer.compile" in patches.installed())
        print(tfdist.strategy_names() == tfdist.registry.strategy_names(), tfdist.OptionError.__module__)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.splitlines() == [
        "after import: False",
        "after get_strategy: True True",
        "True tfdist.options",
    ], done.stderr[-2000:]


def test_a_strategy_class_imported_from_its_module_still_installs_the_hooks():
    # No `tfdist.<name>` is touched: constructing the strategy loads the package.
    code = textwrap.dedent("""
        from tfdist.strategies.mirrored import MirroredStrategy
        import keras, numpy as np
        with MirroredStrategy(["/cpu:0"]).scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile("sgd", "mse")
        model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
        from tfdist._compat import patches
        print("Trainer.compile" in patches.installed(), model.train_function.__module__)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.splitlines() == ["True tfdist.engine.loop"], done.stderr[-2000:]


# ---------------------------------------------------------------------------
# Network exposure (docs/operations.md).
# ---------------------------------------------------------------------------

# Every task starts a real TensorFlow server from its TF_CONFIG cluster (it
# binds 0.0.0.0 whatever the address says); worker 1 runs an op placed on
# worker 0 through it, fed from worker 1 (so nothing is folded away). Each task
# then serves until the test has probed the servers from outside the job.
TENSORFLOW_SERVERS = """
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    def put(name, text=""):
        open(os.path.join(out, name + ".tmp"), "w").write(text)
        os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))

    def wait_for(name):
        while not os.path.exists(os.path.join(out, name)):
            time.sleep(0.02)

    index = config["task"]["index"]
    server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name="worker", task_index=index)
    if index == 0:
        put("serving", json.dumps({"cluster": config["cluster"], "net": os.readlink("/proc/self/ns/net")}))
    else:
        wait_for("serving")
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.int64, [])
            with tf.device("/job:worker/replica:0/task:0"):
                y = x * 2 + 1
            trace = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE, timeout_in_ms=30000)
            metadata = tf.compat.v1.RunMetadata()
            with tf.compat.v1.Session(server.target) as session:
                value = session.run(y, {x: 20}, options=trace, run_metadata=metadata)
        devices = sorted({d.device for d in metadata.step_stats.dev_stats})
        put("remote-op", json.dumps({"value": int(value), "devices": devices}))
    wait_for("probed")
    os._exit(0)  # at once: TensorFlow's exit handlers can take seconds on a loaded host
"""


def host_address() -> str:
    """This host's address on its default route (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("198.51.100.1", 9))  # TEST-NET-2: only picks the route
        address = probe.getsockname()[0]
    except OSError:
        address = "127.0.0.1"
    finally:
        probe.close()
    if address.startswith("127."):
        pytest.skip("this host has no address besides loopback")
    return address


def accepts(address: str, port: int) -> bool:
    """Whether a connection from this (the test's) process to `address:port` is accepted."""
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def wait_for_file(path, launcher, timeout=90.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.05)
    return path.read_text()


def private_network_launcher(tmp_path, command, workers: int) -> subprocess.Popen:
    """`tfdist launch --private-network` running `command`; skips where namespaces are unavailable."""
    try:
        launch.private_network_tools()
    except launch.NoPrivateNetwork as e:
        pytest.skip(f"--private-network is not available here: {e}")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.cli", "launch", "--private-network", "--workers", str(workers),
         "--timeout", "120", "--", *command],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )


def my_network_namespace(pid) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_without_private_network_a_tensorflow_server_accepts_connections_on_every_address(tmp_path):
    # Its address is 127.0.0.1:P, yet it serves on the host's other address too.
    address = host_address()
    launcher = start_launcher(tmp_path, TENSORFLOW_SERVERS, workers=1)
    try:
        serving = json.loads(wait_for_file(tmp_path / "serving", launcher))
        port = int(serving["cluster"]["worker"][0].rsplit(":", 1)[1])
        assert {a: accepts(a, port) for a in (address, "127.0.0.1")} == {address: True, "127.0.0.1": True}
        (tmp_path / "probed").touch()
        assert launcher.wait(timeout=30) == 0, launcher.communicate()
    finally:
        kill_all(launcher, [])


def test_with_private_network_the_tasks_reach_each_other_and_nothing_else_reaches_them(tmp_path):
    address = host_address()
    launcher = private_network_launcher(tmp_path, script(tmp_path, TENSORFLOW_SERVERS), workers=2)
    try:
        remote = json.loads(wait_for_file(tmp_path / "remote-op", launcher))
        assert remote == {"value": 41, "devices": ["/job:worker/replica:0/task:0/device:CPU:0",
                                                   "/job:worker/replica:0/task:1/device:CPU:0"]}
        serving = json.loads((tmp_path / "serving").read_text())
        assert serving["net"] != my_network_namespace("self")
        ports = [int(a.rsplit(":", 1)[1]) for a in serving["cluster"]["worker"]]
        assert {(a, p): accepts(a, p) for a in (address, "127.0.0.1") for p in ports} == {
            (a, p): False for a in (address, "127.0.0.1") for p in ports
        }
        (tmp_path / "probed").touch()
        out, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 0, err
        assert err == (
            "tfdist launch: summary: worker:0  exited with status 0  restarts 0\n"
            "tfdist launch: summary: worker:1  exited with status 0  restarts 0\n"
        )
    finally:
        kill_all(launcher, [])


def test_sigterm_to_the_launcher_under_private_network_stops_the_job(tmp_path):
    # The launcher re-executes itself without --fork: the pid that was started
    # is the launcher that owns the tasks, inside the namespace.
    launcher = private_network_launcher(tmp_path, script(tmp_path, WRITE_PID_AND_SERVE), workers=2)
    pids = {}
    try:
        pids = wait_for_pids(tmp_path, ["worker:0", "worker:1"], launcher)
        for pid in pids.values():
            with open(f"/proc/{pid}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[1]) == launcher.pid  # its parent
            assert my_network_namespace(pid) == my_network_namespace(launcher.pid) != my_network_namespace("self")
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=20)
        assert launcher.returncode == 143
        assert err == (
            "tfdist launch: SIGTERM received; stopped every process of the job.\n"
            "tfdist launch: summary: worker:0  stopped by the launcher  restarts 0\n"
            "tfdist launch: summary: worker:1  stopped by the launcher  restarts 0\n"
        )
        assert not any(alive(p) for p in pids.values())
    finally:
        kill_all(launcher, pids.values())


FIX = ("Run without --private-network and confine the job's ports with a firewall instead "
       '(docs/operations.md, "Network exposure").\n')


@pytest.mark.parametrize("unshare, reason", [
    ('echo "unshare: unshare failed: Operation not permitted" >&2; exit 1',
     "this system does not let this user make user and network namespaces (`unshare --user --map-root-user "
     "--net true` failed: unshare: unshare failed: Operation not permitted)"),
    (None, "`unshare` (util-linux) was not found on PATH"),
], ids=["unshare-fails", "unshare-missing"])
def test_private_network_where_namespaces_are_unavailable_is_a_usage_error(tmp_path, unshare, reason):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = str(bin_dir)
    if unshare is not None:  # an `unshare` that fails as it does where the kernel forbids it
        (bin_dir / "unshare").write_text(f"#!/bin/sh\n{unshare}\n")
        (bin_dir / "unshare").chmod(0o755)
        path += os.pathsep + os.environ["PATH"]
    done = subprocess.run(
        [sys.executable, "-m", "tfdist.cli", "launch", "--private-network", "--workers", "2", "--",
         sys.executable, "-c", "pass"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": path},
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"tfdist launch: --private-network: {reason}. {FIX}"


def test_the_reexecuted_launcher_gets_the_same_flags():
    import argparse

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    argv = ["--workers", "3", "--chief", "--ps", "2", "--evaluator", "--restarts", "4", "--timeout", "0.5",
            "--startup-timeout", "45", "--all-progress", "--tf-logs", "--private-network"]
    args = parser.parse_args(argv)
    assert parser.parse_args(launch._launcher_flags(args)) == args
    assert launch._launcher_flags(parser.parse_args(["--workers", "2"])) == [
        "--workers", "2", "--ps", "0", "--restarts", "0",
    ]

"""`tfdist launch`: runs every process of a multi-process job on this machine.

The same training script a cluster manager would start on many machines is
started here once per task, each process with its own TF_CONFIG on free
127.0.0.1 ports, its output prefixed with its role (`[worker:1] ...`), in its
own process group so that the whole job can be stopped on every exit path:
success, failure of any process, timeout, Ctrl-C or SIGTERM.

The job's status is the chief's (with `chief=True`) or else the workers':
when they have all finished, parameter servers and the evaluator, which serve
until stopped, are stopped and the launcher returns. If a training process
fails, the others are stopped, the failed one and its last lines are printed,
and with `restarts=K` the whole job is started again (fresh ports; the
environment variable `TFDIST_RESTART_COUNT` tells the script which attempt it
is), so a script with `keras.callbacks.BackupAndRestore` resumes where it
stopped.

The launcher itself uses no TensorFlow; only the processes it starts do.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

# Lines of each process kept for the failure report.
TAIL_LINES = 20
# Seconds a process gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
# Seconds the workers of a chief-led job without parameter servers get to
# finish on their own once the chief has (they end a moment later).
FINISH_GRACE_S = 10.0
_POLL_S = 0.05

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclasses.dataclass
class _Task:
    job: str
    index: int
    process: subprocess.Popen
    tail: collections.deque
    reader: threading.Thread
    stopped_by_us: bool = False
    finalized: bool = False

    @property
    def label(self) -> str:
        return f"{self.job}:{self.index}"


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that are free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def local_cluster(workers: int, chief: bool = False, ps: int = 0) -> dict[str, list[str]]:
    """A cluster dict of `chief`/`worker`/`ps` tasks on free 127.0.0.1 ports."""
    counts = [("chief", 1 if chief else 0), ("worker", workers), ("ps", ps)]
    ports = iter(free_ports(sum(n for _, n in counts)))
    return {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for job, n in counts if n}


def _check_arguments(command, workers, chief, ps, evaluator, restarts, timeout) -> None:
    if isinstance(command, str) or not command or not all(isinstance(c, str) for c in command):
        raise ValueError(
            "Argument 'command' must be a non-empty list of strings, e.g. "
            f"['python', 'train.py']. Received: command={command!r}"
        )
    for name, value, low in (("workers", workers, 0), ("ps", ps, 0), ("restarts", restarts, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"Argument '{name}' must be an integer >= {low}. Received: {name}={value!r}")
    if workers == 0 and not chief:
        raise ValueError(
            "A job needs at least one training process: pass workers >= 1 or chief=True. "
            f"Received: workers={workers}, chief={chief}"
        )
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"Argument 'timeout' must be a number of seconds > 0 or None. Received: timeout={timeout!r}")


def _say(message: str) -> None:
    print(f"tfdist launch: {message}", file=sys.stderr, flush=True)


_print_lock = threading.Lock()


def _pump(stream, prefix: str, tail: collections.deque) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        tail.append(line)
        with _print_lock:
            sys.stdout.write(f"{prefix} {line}\n")
            sys.stdout.flush()
    stream.close()


def _start(command, job, index, cluster, base_env, attempt) -> _Task:
    env = dict(base_env)
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    env["TFDIST_RESTART_COUNT"] = str(attempt)
    env.setdefault("PYTHONUNBUFFERED", "1")
    process = subprocess.Popen(
        list(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped as a whole
    )
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    reader = threading.Thread(target=_pump, args=(process.stdout, f"[{job}:{index}]", tail), daemon=True)
    reader.start()
    return _Task(job, index, process, tail, reader)


def _signal_group(task: _Task, sig: int) -> None:
    try:
        os.killpg(task.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(tasks: Sequence[_Task]) -> None:
    """SIGTERM to every process group still running, SIGKILL after the grace period."""
    running = [t for t in tasks if t.process.poll() is None]
    for t in running:
        t.stopped_by_us = True
        _signal_group(t, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for t in running:
        try:
            t.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for t in tasks:
        if t.finalized:
            continue
        # Also stops anything the process left behind in its group. Once done,
        # the group id is never signalled again (the pid may be reused).
        _signal_group(t, signal.SIGKILL)
        t.process.wait()
        t.reader.join(timeout=2.0)
        t.finalized = True


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _report_failure(task: _Task) -> None:
    code = task.process.returncode
    lines = "\n".join(f"    {line}" for line in task.tail) or "    (no output)"
    _say(f"{task.label} {_describe_exit(code)}; stopping the job. Its last lines:\n{lines}")


def _run_once(command, workers, chief, ps, evaluator, base_env, attempt, deadline, restarts=0) -> tuple[int, bool]:
    """Runs the job once; returns (status, whether a restart could help)."""
    cluster = local_cluster(workers, chief, ps)
    roles = [(job, i) for job, addrs in cluster.items() for i in range(len(addrs))]
    if evaluator:
        roles.append(("evaluator", 0))
    tasks: list[_Task] = []
    # With parameter servers, workers are stateless servers the chief's
    # coordinator reschedules around: a failed one is restarted in place (same
    # address, so it rejoins the cluster) up to `restarts` times.
    in_place_left = {i: restarts for i in range(workers)} if ps else {}
    try:
        for job, index in roles:
            tasks.append(_start(command, job, index, cluster, base_env, attempt))
        deciding = [t for t in tasks if t.job == "chief"] or [t for t in tasks if t.job == "worker"]
        while True:
            for position, t in enumerate(tasks):
                code = t.process.poll()
                if code is not None and code != 0 and not t.stopped_by_us:
                    t.reader.join(timeout=2.0)
                    if t.job == "worker" and in_place_left.get(t.index, 0) > 0 and t not in deciding:
                        in_place_left[t.index] -= 1
                        _stop([t])
                        used = restarts - in_place_left[t.index]
                        _say(f"{t.label} {_describe_exit(code)}; restarting it in place "
                             f"(restart {used} of {restarts} for this worker).")
                        tasks[position] = _start(command, t.job, t.index, cluster, base_env, used)
                        continue
                    _stop(tasks)
                    _report_failure(t)
                    return _exit_status(code), True
            if all(t.process.poll() == 0 for t in deciding):
                # Synchronous workers of a chief-led job end a moment after the
                # chief; with parameter servers, workers serve until stopped.
                others = [t for t in tasks if t not in deciding and t.job == "worker" and not ps]
                grace = time.monotonic() + FINISH_GRACE_S
                while any(t.process.poll() is None for t in others) and time.monotonic() < grace:
                    if deadline is not None and time.monotonic() > deadline:
                        _stop(tasks)
                        _say(f"the job did not finish within the timeout; stopped all {len(tasks)} processes.")
                        return EXIT_TIMEOUT, False
                    time.sleep(_POLL_S)
                failed = [t for t in others if t.process.poll() not in (None, 0)]
                _stop(tasks)
                for t in failed:
                    _report_failure(t)
                return (_exit_status(failed[0].process.returncode), True) if failed else (0, False)
            if deadline is not None and time.monotonic() > deadline:
                _stop(tasks)
                _say(f"the job did not finish within the timeout; stopped all {len(tasks)} processes.")
                return EXIT_TIMEOUT, False
            time.sleep(_POLL_S)
    finally:
        _stop(tasks)


def run_job(
    command: list[str],
    workers: int,
    chief: bool = False,
    ps: int = 0,
    evaluator: bool = False,
    restarts: int = 0,
    env: Optional[dict] = None,
    timeout: Optional[float] = None,
) -> int:
    """Runs a multi-process job on this machine and returns its exit status.

    Args:
        command: list of str. The command every process runs, e.g.
            `["python", "train.py", "--epochs", "3"]`.
        workers: int. Number of `worker` tasks.
        chief: bool. Add a `chief` task (default `False`; without it
            `worker:0` is the chief).
        ps: int. Number of parameter-server tasks (default 0).
        evaluator: bool. Add an `evaluator` task, outside the cluster spec as
            TensorFlow expects (default `False`).
        restarts: int. Start the whole job again, up to this many times, when
            a training process fails (default 0). With parameter servers
            (`ps > 0`), a failed worker is instead restarted in place, with
            the same address, up to this many times per worker; a failed
            chief or ps still restarts the whole job.
        env: Optional dict of environment variables added to this process's
            for every task (e.g. `{"TFDIST_LOCAL_DEVICES": "2"}`).
        timeout: Optional float. Seconds after which the job is stopped
            and 124 returned (default: no limit).

    Returns:
        0 if the job succeeded; else the failed process's status (128 + signal
        number if it was killed), 124 on timeout, 130 when interrupted.

    Raises:
        ValueError: an argument is invalid; the message names it.

    Example:

    ```python
    from tfdist.launch import run_job
    status = run_job(["python", "train.py"], workers=2, restarts=1)
    ```
    """
    _check_arguments(command, workers, chief, ps, evaluator, restarts, timeout)
    base_env = dict(os.environ)
    base_env.update({str(k): str(v) for k, v in (env or {}).items()})
    deadline = None if timeout is None else time.monotonic() + timeout

    received = []

    def on_signal(signum, frame):
        # Raise once; a second Ctrl-C must not interrupt the stopping itself.
        if not received:
            received.append(signum)
            raise _Interrupted(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        for attempt in range(restarts + 1):
            status, retry = _run_once(
                command, workers, chief, ps, evaluator, base_env, attempt, deadline, restarts
            )
            if status == 0 or not retry:
                return status
            if attempt < restarts:
                _say(f"restarting the job (restart {attempt + 1} of {restarts}).")
        _say(f"the job failed {restarts + 1} time(s); giving up.")
        return status
    except (_Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, _Interrupted) else signal.SIGINT
        _say(f"{signal.Signals(signum).name} received; stopped every process of the job.")
        return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_arguments(p) -> None:
    """The flags of `tfdist launch`."""
    p.add_argument("--workers", type=int, required=True, help="number of worker processes")
    p.add_argument("--chief", action="store_true", help="add a chief process (else worker:0 is the chief)")
    p.add_argument("--ps", type=int, default=0, help="number of parameter-server processes (default 0)")
    p.add_argument("--evaluator", action="store_true", help="add an evaluator process")
    p.add_argument(
        "--restarts", type=int, default=0,
        help="restart the whole job up to K times on failure; with --ps, restart a failed worker in place",
    )
    p.add_argument("--timeout", type=float, default=None, help="stop the job after S seconds (exit 124)")
    p.usage = (
        "tfdist launch --workers N [--chief] [--ps M] [--evaluator] [--restarts K] [--timeout S] "
        "-- python train.py ARGS"
    )


def main(args) -> int:
    """Runs `tfdist launch` from parsed arguments (`args.rest` holds the command)."""
    command = list(args.rest)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        _say("no command given. Usage: tfdist launch --workers 2 -- python train.py")
        return 2
    try:
        return run_job(command, args.workers, chief=args.chief, ps=args.ps, evaluator=args.evaluator,
                       restarts=args.restarts, timeout=args.timeout)
    except ValueError as e:
        _say(str(e).replace("Argument 'workers'", "--workers").replace("Argument 'ps'", "--ps")
             .replace("Argument 'restarts'", "--restarts").replace("Argument 'timeout'", "--timeout"))
        return 2

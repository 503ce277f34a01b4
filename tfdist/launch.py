"""`tfdist launch`: runs every process of a multi-process job on this machine.

The same training script a cluster manager would start on many machines is
started here once per task, each process with its own TF_CONFIG on free
127.0.0.1 ports and its output prefixed with its role (`[worker:1] ...`). The
launcher owns its processes: each runs in its own process group, stopped as a
whole on every exit path (success, failure of any process, timeout, SIGINT,
SIGTERM, SIGHUP), and on Linux each also gets SIGTERM from the kernel if the
launcher dies without stopping it (SIGKILL included), so no job outlives its
launcher.

A stop signal to the launcher (SIGINT, SIGTERM, SIGHUP) is passed to every
task as SIGTERM, and the tasks get `grace_period` seconds to save at their
next step boundary (`tfdist.preemption`) before SIGKILL; when every worker
says it saved, the launcher exits 0. With `min_workers` (`--workers MIN:MAX`)
a worker that keeps failing is dropped and the job goes on with the others.

The job's status is the chief's (with `chief=True`) or else the workers':
when they have all finished, parameter servers and the evaluator, which serve
until stopped, are stopped and the launcher returns. If a training process
fails, the others are stopped, the failed one and its last lines are printed,
and with `restarts=K` the whole job is started again (fresh ports; the
environment variable `TFDIST_RESTART_COUNT` tells the script which attempt it
is), so a script with `keras.callbacks.BackupAndRestore` resumes where it
stopped. Restarts wait 1 s, doubling up to 30 s while failures come quickly,
and stop early when a restart failed exactly as the attempt before it (same
task, status and last error line) within `PROGRESS_S` of its start: another
would fail the same way. At the end one line per task gives how it ended, its
restarts and its last error line.

Output: progress bars that a task redraws in place reach the terminal only
from the chief (`all_progress=True` shows every task's), each as its final
state once per line; TensorFlow's start-up messages (C++ INFO logs, the CUDA
probe on a host without a GPU, ...) are dropped unless `tf_logs=True`.

Each task's TMPDIR is a fresh directory the launcher removes when the task
ends (and so on every restart): what a script or TensorFlow leaves in the
temporary directory (a non-chief's checkpoint copies, autograph files) goes
with it. What a SIGKILLed launcher leaves there, the next launch removes.

With `--private-network` (command line, Linux) the launcher first re-executes
itself, keeping its pid, in a new user and network namespace whose only network
is its own loopback: TensorFlow's servers, which listen on every interface
whatever the cluster spec says, are then reachable from the job's own
processes only (docs/operations.md, "Network exposure").

The launcher itself uses no TensorFlow; only the processes it starts do.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

# Lines of each process kept for the failure report.
TAIL_LINES = 20
# Seconds a process gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
# Seconds a task gets, after the launcher forwards a stop signal it received, to
# save at its next step boundary and exit (`--grace-period`; each task reads it as
# TFDIST_GRACE_PERIOD, tfdist.preemption); the launcher adds STOP_GRACE_S before SIGKILL.
GRACE_PERIOD_S = 30.0
# The lines a task prints when it saved and stopped on a stop signal
# (tfdist.preemption), and when it resumed from a backup (tfdist.checkpointing).
PREEMPTED_PREFIX = "tfdist: preempted"
RESUMED_PREFIX = "tfdist: resumed from "
_POSITION = r"(epoch \d+, step \d+(?: of \d+)?(?: \(optimizer step \d+\))?)"
_PREEMPTED = re.compile(r"^tfdist: preempted \((.+?)\): \S+ saved " + _POSITION + " to ")
_RESUMED = re.compile(r"^tfdist: resumed from .+ at " + _POSITION + ": ")
# Seconds the workers of a chief-led job without parameter servers get to
# finish on their own once the chief has (they end a moment later).
FINISH_GRACE_S = 10.0
# Restarts wait BACKOFF_START_S after a failure, doubling with each further
# failure that came within PROGRESS_S of its start, at most BACKOFF_MAX_S.
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# A run that fails sooner than this after its start made no progress: if it
# failed exactly as the run before it, restarting it again is not tried.
PROGRESS_S = 60.0
_POLL_S = 0.05

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_CANNOT_RUN = 126
EXIT_NOT_FOUND = 127

_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _CannotStart(Exception):
    def __init__(self, command: Sequence[str], error: OSError):
        super().__init__(f"cannot start {command[0]!r}: {error.strerror or error}")
        self.status = EXIT_NOT_FOUND if isinstance(error, FileNotFoundError) else EXIT_CANNOT_RUN


# ---------------------------------------------------------------------------
# Output: prefixes, progress bars, TensorFlow's start-up noise.
# ---------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Keras's epoch header; its bars are told by their redraws (\r, \b).
_EPOCH_HEADER = re.compile(r"^Epoch \d+/\d+$")
# TensorFlow's C++ log lines: `I0000 00:00:1712345678.123456   1234 port.cc:153] ...`.
_CPP_LOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ [\w.-]+\.(?:cc|h|cpp):\d+\] ")
# Start-up lines every TensorFlow process prints, none of them about the job.
_TF_NOISE = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    r"|^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.$"
)
# W/E-level C++ lines that only say a host has no GPU or that a plugin registered twice.
_TF_NOISE_WE = re.compile(
    r"failed call to cuInit|Unable to register cu(DNN|FFT|BLAS) factory|already been registered"
    r"|computation placer already registered|TF-TRT Warning: Could not find TensorRT"
    r"|kernel driver does not appear to be running|retrieving CUDA diagnostic information"
    r"|cuda_diagnostics\.cc|Could not find cuda drivers"
)
# What peers print when the job has finished and its servers go away.
_SHUTDOWN_NOISE = re.compile(
    r"UNAVAILABLE|CANCELLED|StartAbort|preempted|Socket closed|Connection reset|failed to connect"
)
# The task a TensorFlow message names: `/job:worker/replica:0/task:1` or `/job:worker/task:1`.
_TASK_NAME = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
# The lines TensorFlow continues such a message with (no log prefix of their own).
_SHUTDOWN_CONTINUATION = re.compile(
    r"^/job:\w+/replica:\d+/task:\d+$|^The tasks have crashed\. |^Additional GRPC error information from remote"
    r"|^:UNKNOWN:Error received from peer"
)
# A warning line (Python's, TensorFlow's logger's, its C++ log's), never the summary's "last error".
_WARNING_LINE = re.compile(r"^WARNING:|^W\d{4} |Warning: |^\s+warnings\.warn\(|is deprecated")
# A line that reports an error, for the summary's "last error".
_ERROR_LINE = re.compile(r"Error\b|Exception\b|^Traceback|^[EF]\d{4} |FATAL|Fatal|Killed|Aborted|error:")


def _final_render(text: str) -> tuple[str, bool]:
    """The line a terminal would show for `text` (redraws applied), and whether it redrew."""
    if "\r" not in text and "\b" not in text:
        return text, False
    segments = [s for s in text.split("\r") if s.strip("\b \t")]
    shown: list[str] = []
    for ch in segments[-1] if segments else "":
        if ch == "\b":
            if shown:
                shown.pop()
        else:
            shown.append(ch)
    return "".join(shown).rstrip(), True


def _is_tf_noise(line: str, chief_done: bool, finished_ok: frozenset = frozenset()) -> bool:
    """Whether `line` is TensorFlow start-up noise, or a peer's complaint about a job that has ended.

    A complaint (gRPC UNAVAILABLE, StartAbort, ...) is dropped once the chief
    has succeeded, or when every task it names has already exited with
    status 0 (worker 1 finished first; worker 0's coordination service then
    reports it "stopped sending heartbeats").
    """
    if _TF_NOISE.match(line):
        return True
    level = _CPP_LOG.match(line)
    if level is None:
        return False
    if level.group(1) == "I" or _TF_NOISE_WE.search(line):
        return True
    if not _SHUTDOWN_NOISE.search(line):
        return False
    if chief_done:
        return True
    named = {f"{job}:{index}" for job, index in _TASK_NAME.findall(line)}
    return bool(named) and named <= finished_ok


@dataclasses.dataclass(frozen=True)
class _OutputOptions:
    all_progress: bool = False
    tf_logs: bool = False


# ---------------------------------------------------------------------------
# Processes.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Task:
    job: str
    index: int
    process: subprocess.Popen
    tail: collections.deque
    reader: threading.Thread
    started: float
    tmpdir: str
    stopped_by_us: bool = False
    finalized: bool = False
    # The task's own lines: it saved and stopped on a stop signal; it resumed from a backup.
    preempted: Optional[str] = None
    resumed: Optional[str] = None

    @property
    def label(self) -> str:
        return f"{self.job}:{self.index}"

    def last_error(self) -> Optional[str]:
        """The last line that reports an error, else (for a failed run) its last line that is not a warning."""
        lines = [line.strip() for line in list(self.tail) if line.strip()]
        for line in reversed(lines):
            if _ERROR_LINE.search(line):
                return line
        # A deprecation warning says nothing of why the process ended.
        plain = [line for line in lines if not _WARNING_LINE.search(line)]
        return (plain or lines)[-1] if lines else None


@dataclasses.dataclass
class _Record:
    """What the end-of-job summary says of one task."""

    label: str
    runs: int = 0
    ended: str = "did not start"
    last_error: Optional[str] = None
    # Whether `last_error` is from the task's last run (else from a run before a restart).
    error_in_last_run: bool = False
    # Where the task's last run saved before it stopped on a stop signal.
    saved: Optional[str] = None


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


def _pump(
    stream, task: _Task, is_chief: bool, options: _OutputOptions, chief_done: threading.Event, finished_ok: set
) -> None:
    prefix = f"[{task.label}]"
    show_progress = is_chief or options.all_progress
    continuing = False  # the lines after a dropped complaint that continue it
    for raw in iter(stream.readline, b""):
        line, redrawn = _final_render(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        if not options.tf_logs:
            if continuing and _SHUTDOWN_CONTINUATION.search(line):
                continue
            continuing = False
            if _is_tf_noise(line, chief_done.is_set(), frozenset(finished_ok)):
                # The lines that continue a dropped log message (a task's name on a line
                # of its own, as in "Example stragglers:") go with it.
                continuing = _CPP_LOG.match(line) is not None
                continue
        task.tail.append(line)
        if line.startswith(PREEMPTED_PREFIX):
            task.preempted = line
        elif line.startswith(RESUMED_PREFIX):
            task.resumed = line
        if not show_progress and (redrawn or _EPOCH_HEADER.match(_ANSI.sub("", line))):
            continue
        with _print_lock:
            sys.stdout.write(f"{prefix} {line}\n")
            sys.stdout.flush()
    stream.close()
    # Once the chief has succeeded, its peers' complaints that it went away
    # (gRPC UNAVAILABLE, StartAbort, ...) are the end of the job, not errors.
    if task.process.wait() == 0:
        finished_ok.add(task.label)
        if is_chief:
            chief_done.set()


def _die_with_launcher() -> Optional[Callable[[], None]]:
    """A `preexec_fn` that has the kernel send SIGTERM to the child when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    launcher = os.getpid()

    def preexec() -> None:
        # Resolved before the fork: the child only makes the call.
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the call
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


_TMP_PREFIX = "tfdist_launch_"


def _remove_left_by_killed_launchers(parent: str) -> None:
    """Removes the temporary directories of launchers that no longer run (killed before cleaning up)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(_TMP_PREFIX):].split("_", 1)[0]
        if not name.startswith(_TMP_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except OSError:
            pass  # running, as another user


class _Job:
    """One `run_job` call: how to start, watch and stop its tasks, and what they did."""

    def __init__(self, command, workers, chief, ps, evaluator, restarts, base_env, deadline, options,
                 grace_period=None, min_workers=None):
        self.command = list(command)
        self.workers, self.chief, self.ps, self.evaluator = workers, chief, ps, evaluator
        self.restarts = restarts
        self.grace_period = GRACE_PERIOD_S if grace_period is None else grace_period
        # `--workers MIN:MAX`: the job's worker slots, each with its failures; a slot
        # that fails more than `restarts` times is dropped while MIN remain.
        self.min_workers = min_workers
        self.slots = list(range(workers))
        self.slot_failures: dict[int, int] = {}
        self.resizes: list[dict] = []
        self.signalled: Optional[int] = None  # the stop signal the launcher received
        self.tasks: list[_Task] = []  # the current run's
        self.base_env = base_env
        self.deadline = deadline
        self.options = options
        self.records: dict[str, _Record] = {}
        self.preexec = _die_with_launcher()
        self.chief_done = threading.Event()
        self.finished_ok: set[str] = set()  # labels of this attempt's tasks that exited with status 0
        self.display_chief = "chief:0" if chief else "worker:0"
        parent = base_env.get("TMPDIR")
        parent = parent if parent and os.path.isdir(parent) else tempfile.gettempdir()
        _remove_left_by_killed_launchers(parent)
        self.tmp_root = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}_", dir=parent)

    # -- one process --------------------------------------------------------

    def start(self, job: str, index: int, cluster: dict, attempt: int) -> _Task:
        label = f"{job}:{index}"
        record = self.records.setdefault(label, _Record(label))
        record.runs += 1
        tmpdir = os.path.join(self.tmp_root, f"{job}{index}-{record.runs}")
        os.makedirs(tmpdir, exist_ok=True)
        env = dict(self.base_env)
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
        env["TFDIST_RESTART_COUNT"] = str(attempt)
        env["TMPDIR"] = tmpdir
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["TFDIST_GRACE_PERIOD"] = f"{self.grace_period:g}"
        try:
            process = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as a whole
                preexec_fn=self.preexec,
            )
        except OSError as e:
            shutil.rmtree(tmpdir, ignore_errors=True)
            record.runs -= 1
            raise _CannotStart(self.command, e) from None
        tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        task = _Task(job, index, process, tail, None, time.monotonic(), tmpdir)  # type: ignore[arg-type]
        task.reader = threading.Thread(
            target=_pump, args=(process.stdout, task, label == self.display_chief, self.options, self.chief_done,
                  self.finished_ok),
            daemon=True,
        )
        task.reader.start()
        return task

    def finalize(self, task: _Task) -> None:
        """Once `task` has exited: stops what it left in its group, records how it ended, removes its TMPDIR."""
        if task.finalized:
            return
        # Once finalized, the group id is never signalled again (the pid may be reused).
        _signal_group(task, signal.SIGKILL)
        task.reader.join(timeout=2.0)
        code = task.process.returncode
        record = self.records[task.label]
        record.saved = None
        if code == 0 and task.preempted is not None:
            # "tfdist: preempted (SIGTERM): worker:0 saved DIR at epoch 2, step 5 of 7 (...) (...)"
            match = _PREEMPTED.match(task.preempted)
            signame, where = (match.group(1), match.group(2)) if match else ("a stop signal", "its step")
            record.saved = where
            record.ended = f"saved at {where} on {signame} and exited with status 0"
            record.error_in_last_run = False
        elif task.stopped_by_us and code != 0:
            record.ended = "stopped by the launcher"
        else:
            record.ended = _describe_exit(code)
            record.error_in_last_run = code != 0
            if code != 0:
                record.last_error = task.last_error()
        shutil.rmtree(task.tmpdir, ignore_errors=True)
        task.finalized = True

    def stop(self, tasks: Sequence[_Task]) -> None:
        """SIGTERM to every process group still running, SIGKILL after the grace period.

        After a stop signal to the launcher, the tasks get `grace_period` more
        seconds: they save at their next step boundary (tfdist.preemption).
        """
        running = [t for t in tasks if t.process.poll() is None]
        for t in running:
            t.stopped_by_us = True
            _signal_group(t, signal.SIGTERM)
        grace = STOP_GRACE_S + (self.grace_period if self.signalled is not None else 0.0)
        deadline = time.monotonic() + grace
        for t in running:
            try:
                t.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for t in tasks:
            if not t.finalized:
                _signal_group(t, signal.SIGKILL)
                t.process.wait()
                self.finalize(t)

    # -- one attempt --------------------------------------------------------

    def run_once(self, attempt: int) -> tuple[int, Optional[tuple], float]:
        """Runs the job once: (status, failure signature or None if a restart cannot help, seconds run)."""
        cluster = local_cluster(self.workers, self.chief, self.ps)
        roles = [(job, i) for job, addrs in cluster.items() for i in range(len(addrs))]
        if self.evaluator:
            roles.append(("evaluator", 0))
        tasks: list[_Task] = []
        self.tasks = tasks
        self.chief_done.clear()
        self.finished_ok.clear()
        begun = time.monotonic()
        # With parameter servers, workers are stateless servers the chief's
        # coordinator reschedules around: a failed one is restarted in place
        # (same address, so it rejoins the cluster) up to `restarts` times.
        in_place_left = {i: self.restarts for i in range(self.workers)} if self.ps else {}
        pending: dict[int, tuple[float, int]] = {}  # position -> (when, restart number)
        last_failure: dict[int, tuple] = {}
        quick_failures: dict[int, int] = {}
        try:
            for job, index in roles:
                tasks.append(self.start(job, index, cluster, attempt))
            deciding = [t for t in tasks if t.job == "chief"] or [t for t in tasks if t.job == "worker"]
            while True:
                now = time.monotonic()
                for position, (when, used) in list(pending.items()):
                    if now >= when:
                        del pending[position]
                        old = tasks[position]
                        tasks[position] = self.start(old.job, old.index, cluster, used)
                for position, t in enumerate(tasks):
                    code = t.process.poll()
                    if code is None or code == 0 or t.stopped_by_us or position in pending:
                        continue
                    self.finalize(t)
                    signature = (t.label, code, t.last_error())
                    quick = time.monotonic() - t.started < PROGRESS_S
                    if t.job == "worker" and in_place_left.get(t.index, 0) > 0 and t not in deciding:
                        if quick and last_failure.get(position) == signature:
                            self.stop(tasks)
                            _report_failure(t)
                            _say(_same_failure(signature, "not restarting it again"))
                            return _exit_status(code), None, time.monotonic() - begun
                        last_failure[position] = signature
                        quick_failures[position] = quick_failures.get(position, 0) + 1 if quick else 0
                        in_place_left[t.index] -= 1
                        used = self.restarts - in_place_left[t.index]
                        wait = _backoff(quick_failures[position])
                        _say(f"{t.label} {_describe_exit(code)}; restarting it in place in {wait:g} s "
                             f"(restart {used} of {self.restarts} for this worker).")
                        pending[position] = (time.monotonic() + wait, used)
                        continue
                    self.stop(tasks)
                    _report_failure(t)
                    return _exit_status(code), signature, time.monotonic() - begun
                if all(t.process.poll() == 0 for t in deciding):
                    # Synchronous workers of a chief-led job end a moment after the
                    # chief; with parameter servers, workers serve until stopped.
                    others = [t for t in tasks if t not in deciding and t.job == "worker" and not self.ps]
                    grace = time.monotonic() + FINISH_GRACE_S
                    while any(t.process.poll() is None for t in others) and time.monotonic() < grace:
                        if self.deadline is not None and time.monotonic() > self.deadline:
                            return self._timed_out(tasks), None, time.monotonic() - begun
                        time.sleep(_POLL_S)
                    failed = [t for t in others if t.process.poll() not in (None, 0)]
                    self.stop(tasks)
                    for t in failed:
                        _report_failure(t)
                    if not failed:
                        return 0, None, time.monotonic() - begun
                    code = failed[0].process.returncode
                    return _exit_status(code), (failed[0].label, code, failed[0].last_error()), time.monotonic() - begun
                if self.deadline is not None and time.monotonic() > self.deadline:
                    return self._timed_out(tasks), None, time.monotonic() - begun
                time.sleep(_POLL_S)
        finally:
            self.stop(tasks)
            for resize in self.resizes:
                if resize["attempt"] == attempt:
                    chief = next((t for t in tasks if t.label == self.display_chief and t.resumed), None)
                    match = _RESUMED.match(chief.resumed) if chief is not None else None
                    resize["resumed"] = match.group(1) if match else None

    def _timed_out(self, tasks: Sequence[_Task]) -> int:
        self.stop(tasks)
        _say(f"the job did not finish within the timeout; stopped all {len(tasks)} processes.")
        return EXIT_TIMEOUT

    def saved_by_every_worker(self) -> Optional[str]:
        """Where every training task of the last run saved before it stopped on a stop signal, else None."""
        trainers = [t for t in self.tasks if t.job in ("chief", "worker")]
        if not trainers or any(t.process.poll() != 0 or t.preempted is None for t in trainers):
            return None
        chief = next((t for t in trainers if t.label == self.display_chief), trainers[0])
        match = _PREEMPTED.match(chief.preempted)
        return match.group(2) if match else "its checkpoint"

    def summary(self) -> None:
        """One line per task: how its last run ended, its restarts, its last error line; then the size changes."""
        if not self.records:
            return
        for resize in self.resizes:
            resumed = resize.get("resumed")
            _say(f"summary: the job went from {resize['from']} to {resize['to']} workers after {resize['task']} "
                 f"{resize['why']}; " + (f"the {resize['to']}-worker job resumed at {resumed}." if resumed
                                         else "it did not report a resume (no BackupAndRestore backup to read)."))
        records = list(self.records.values())
        width = max(len(r.label) for r in records)
        ended = max(len(r.ended) for r in records)
        for r in records:
            restarts = max(r.runs - 1, 0)
            line = f"summary: {r.label:<{width}}  {r.ended:<{ended}}  restarts {restarts}"
            if r.last_error:
                line += f"  {'last error' if r.error_in_last_run else 'error before a restart'}: {r.last_error}"
            _say(line)


def _signal_group(task: _Task, sig: int) -> None:
    try:
        os.killpg(task.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _backoff(failures_in_a_row: int) -> float:
    """Seconds before a restart: BACKOFF_START_S after a run that made progress, doubling per quick failure."""
    return min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** max(failures_in_a_row - 1, 0))


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


def _same_failure(signature: tuple, what: str) -> str:
    label, code, error = signature
    return (
        f"{label} failed as in its previous run ({_describe_exit(code)}, last error: "
        f"{error if error else '(no output)'}) within {PROGRESS_S:g} s of its start, with no progress "
        f"in between; {what}."
    )


def run_job(
    command: list[str],
    workers: int,
    chief: bool = False,
    ps: int = 0,
    evaluator: bool = False,
    restarts: int = 0,
    env: Optional[dict] = None,
    timeout: Optional[float] = None,
    all_progress: bool = False,
    tf_logs: bool = False,
    grace_period: Optional[float] = None,
    min_workers: Optional[int] = None,
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
            chief or ps still restarts the whole job. Restarts wait
            `BACKOFF_START_S` (1 s), doubling while runs fail within
            `PROGRESS_S` (60 s) of their start, at most `BACKOFF_MAX_S`
            (30 s); they stop when a run failed as the one before it (same
            task, status and last error line) within `PROGRESS_S`.
        env: Optional dict of environment variables added to this process's
            for every task (e.g. `{"TFDIST_LOCAL_DEVICES": "2"}`). `TMPDIR`
            is the parent of each task's own temporary directory.
        timeout: Optional float. Seconds after which the job is stopped
            and 124 returned (default: no limit).
        all_progress: bool. Show the progress bars of every task (default
            `False`: only the chief's).
        tf_logs: bool. Keep TensorFlow's start-up messages (default `False`:
            dropped).
        grace_period: Optional float. Seconds each task gets to save at its
            next step boundary and exit after the launcher receives SIGINT,
            SIGTERM or SIGHUP (default `GRACE_PERIOD_S`, 30 s; passed to the
            tasks as `TFDIST_GRACE_PERIOD`); SIGKILL follows `STOP_GRACE_S`
            (5 s) later. When every worker saved, the launcher returns 0.
        min_workers: Optional int. Lets the job change size: `workers` is the
            most, `min_workers` the fewest. A worker that fails more than
            `restarts` times (or twice the same way without progress) is
            dropped and the job restarts with the others, resuming from its
            last checkpoint (`BackupAndRestore`; tfdist.resume recomputes each
            worker's share of the global batch), as long as `min_workers`
            remain. Restarts are then counted per worker.

    Returns:
        0 if the job succeeded, or stopped on a stop signal after every worker
        saved; else the failed process's status (128 + signal
        number if it was killed), 124 on timeout, 127 (126) when the command
        cannot be found (run), 128 + the signal's number when stopped by
        SIGINT (130), SIGTERM or SIGHUP.

    Raises:
        ValueError: an argument is invalid; the message names it.

    Example:

    ```python
    from tfdist.launch import run_job
    status = run_job(["python", "train.py"], workers=2, restarts=1)
    ```
    """
    _check_arguments(command, workers, chief, ps, evaluator, restarts, timeout)
    _check_elastic(workers, min_workers, ps, grace_period)
    base_env = dict(os.environ)
    base_env.update({str(k): str(v) for k, v in (env or {}).items()})
    deadline = None if timeout is None else time.monotonic() + timeout
    options = _OutputOptions(all_progress=bool(all_progress), tf_logs=bool(tf_logs))

    received = []
    job = None

    def on_signal(signum, frame):
        # Raise once; a second signal must not interrupt the stopping itself.
        if not received:
            received.append(signum)
            if job is not None:
                job.signalled = signum  # the tasks get the grace period to save
            raise _Interrupted(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for name in _STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                previous[sig] = signal.signal(sig, on_signal)
    try:
        job = _Job(command, workers, chief, ps, evaluator, restarts, base_env, deadline, options,
                   grace_period=grace_period, min_workers=min_workers if min_workers != workers else None)
        return _run_attempts(job)
    except _CannotStart as e:
        job.records.clear()  # nothing ran: no summary
        _say(f"{e}. Check the command after `--`, e.g. tfdist launch --workers 2 -- python train.py")
        return e.status
    except (_Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, _Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        saved = job.saved_by_every_worker() if job is not None else None
        if saved is not None:
            _say(f"{name} received; every worker saved {saved} and exited. Run the same command again to "
                 "resume there (at any number of workers).")
            return 0
        _say(f"{name} received; stopped every process of the job.")
        return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum
    finally:
        if job is not None:
            job.summary()
            shutil.rmtree(job.tmp_root, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_elastic(workers, min_workers, ps, grace_period) -> None:
    if grace_period is not None and (isinstance(grace_period, bool) or not isinstance(grace_period, (int, float))
                                     or grace_period <= 0):
        raise ValueError(f"Argument 'grace_period' must be a number of seconds > 0 or None. "
                         f"Received: grace_period={grace_period!r}")
    if min_workers is None:
        return
    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or not 1 <= min_workers <= workers:
        raise ValueError(f"Argument 'min_workers' must be an integer in 1..workers ({workers}). "
                         f"Received: min_workers={min_workers!r}")
    if ps and min_workers != workers:
        raise ValueError("Argument 'min_workers' (a job that changes size) needs a synchronous job; with "
                         f"parameter servers a failed worker restarts in place. Received: min_workers="
                         f"{min_workers}, ps={ps}")


def _run_attempts(job: _Job) -> int:
    """Runs the job, restarting it (at the same size, or at fewer workers: `min_workers`) as failures allow."""
    restarts = job.restarts
    last_signature, quick_in_a_row, restarts_used, attempt = None, 0, 0, 0
    while True:
        status, signature, seconds = job.run_once(attempt)
        if status == 0 or signature is None:
            saved = job.saved_by_every_worker()
            if status == 0 and saved is not None:
                _say(f"a stop signal reached the job; every worker saved {saved} and exited. Run the same "
                     "command again to resume there (at any number of workers).")
            return status
        quick = seconds < PROGRESS_S
        repeated = quick and signature == last_signature
        label = signature[0]
        if job.min_workers is not None and label.startswith("worker:"):
            index = int(label.split(":")[1])
            slot = job.slots[index]
            failures = job.slot_failures[slot] = job.slot_failures.get(slot, 0) + 1
            if failures > restarts or repeated:
                why = (f"failed {failures} time(s), more than --restarts {restarts} allows" if failures > restarts
                       else "failed as in its previous run, with no progress in between")
                if len(job.slots) - 1 < job.min_workers:
                    _say(f"{label} {why}, and the job cannot go below {job.min_workers} worker(s); giving up.")
                    return status
                old = len(job.slots)
                del job.slots[index]
                job.workers = len(job.slots)
                job.resizes.append({"from": old, "to": job.workers, "task": label, "why": why,
                                    "attempt": attempt + 1})
                what = (f"{label} {why}: restarting the job with the remaining {job.workers} worker(s) "
                        f"(at least {job.min_workers}), resuming from its last checkpoint")
                last_signature = None  # another size: another job
            else:
                what = f"restarting the job ({label}: failure {failures} of the {restarts} allowed)"
                last_signature = signature
        else:
            if restarts_used >= restarts:
                _say(f"the job failed {restarts + 1} time(s); giving up.")
                return status
            if repeated:
                _say(_same_failure(signature, "a restart would fail the same way, so the job stops here"))
                return status
            restarts_used += 1
            last_signature = signature
            what = f"restarting the job (restart {restarts_used} of {restarts})"
        quick_in_a_row = quick_in_a_row + 1 if quick else 0
        wait = _backoff(quick_in_a_row)
        if job.deadline is not None and time.monotonic() + wait > job.deadline:
            _say("the job did not finish within the timeout; not restarting it.")
            return EXIT_TIMEOUT
        _say(f"{what} in {wait:g} s.")
        time.sleep(wait)
        attempt += 1


# ---------------------------------------------------------------------------
# --private-network: the job in a network namespace of its own.
# ---------------------------------------------------------------------------

# The launcher sets it to its pid when it re-executes itself in a new network
# namespace (exec keeps the pid): the launcher that finds its own pid there is
# the re-executed one, and runs the job instead of re-executing again.
PRIVATE_NETWORK_MARKER = "TFDIST_PRIVATE_NETWORK"
_NAMESPACE = ("--user", "--map-root-user", "--net")
_FIREWALL_FIX = (
    "Run without --private-network and confine the job's ports with a firewall instead "
    '(docs/operations.md, "Network exposure").'
)


class NoPrivateNetwork(Exception):
    """Why this host cannot give a job a network namespace of its own."""


def private_network_tools() -> tuple[str, str]:
    """Paths of `unshare` and `ip`, once a user and network namespace was made with them.

    Raises:
        NoPrivateNetwork: either is missing, or the kernel does not let this
            user make the namespace; the message says which.
    """
    if not sys.platform.startswith("linux"):
        raise NoPrivateNetwork(f"network namespaces exist on Linux only (this is {sys.platform})")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise NoPrivateNetwork("`unshare` (util-linux) was not found on PATH")
    # `ip` is in /usr/sbin or /sbin, off the PATH of users on some distributions.
    ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
    if ip is None:
        raise NoPrivateNetwork("`ip` (iproute2) was not found on PATH, /usr/sbin or /sbin")
    for probe, what in (
        ([unshare, *_NAMESPACE, "true"], "this system does not let this user make user and network namespaces"),
        ([unshare, *_NAMESPACE, "--", ip, "link", "set", "lo", "up"], "the loopback of a new network namespace "
                                                                       "cannot be brought up"),
    ):
        try:
            done = subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NoPrivateNetwork(f"{what} (`{' '.join(probe[1:])}`: {e})") from None
        if done.returncode != 0:
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            detail = lines[-1] if lines else f"exit status {done.returncode}"
            shown = " ".join(["unshare", *probe[1:]]).replace(ip, "ip")
            raise NoPrivateNetwork(f"{what} (`{shown}` failed: {detail})")
    return unshare, ip


def _launcher_flags(args) -> list[str]:
    """The `tfdist launch` flags that parse back to `args` (every flag `add_arguments` defines)."""
    import argparse

    class Recorder:  # keeps the actions `add_argument` returns
        def __init__(self):
            self.parser, self.actions = argparse.ArgumentParser(add_help=False), []

        def add_argument(self, *names, **kwargs):
            self.actions.append(self.parser.add_argument(*names, **kwargs))

    recorder = Recorder()
    add_arguments(recorder)
    flags: list[str] = []
    for action in recorder.actions:
        value = getattr(args, action.dest, None)
        if value is None or value is False:
            continue
        flags += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    return flags


def _in_private_network() -> bool:
    """Whether this launcher is the one `_enter_private_network` re-executed (and forgets the marker)."""
    if os.environ.get(PRIVATE_NETWORK_MARKER) != str(os.getpid()):
        return False
    del os.environ[PRIVATE_NETWORK_MARKER]  # not passed on to the tasks
    return True


def _enter_private_network(args, command: list[str]) -> int:
    """Re-executes this launcher, same pid, in a new user and network namespace with loopback up.

    `unshare --user --map-root-user --net -- sh -c 'ip link set lo up && exec "$@"' sh
    python -m tfdist.cli launch FLAGS -- COMMAND`, without `--fork`: every
    exec keeps this process, so signals to the launcher still reach it and it
    still owns its tasks. Returns 2, after a usage error, only when it cannot.
    """
    try:
        unshare, ip = private_network_tools()
        if not sys.executable:
            raise NoPrivateNetwork("the path of this Python interpreter is unknown (sys.executable is empty)")
    except NoPrivateNetwork as e:
        _say(f"--private-network: {e}. {_FIREWALL_FIX}")
        return 2
    argv = [
        unshare, *_NAMESPACE, "--", shutil.which("sh") or "/bin/sh", "-c",
        f'{shlex.quote(ip)} link set lo up && exec "$@"', "sh",
        sys.executable, "-m", "tfdist.cli", "launch", *_launcher_flags(args), "--", *command,
    ]
    env = {**os.environ, PRIVATE_NETWORK_MARKER: str(os.getpid())}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(unshare, argv, env)
    except OSError as e:
        _say(f"--private-network: cannot run {unshare}: {e.strerror or e}. {_FIREWALL_FIX}")
    return 2


def devices_per_worker_environment(k: int, environ=None) -> dict:
    """The variables `--devices-per-worker K` sets for every task.

    `TFDIST_DEVICES_PER_WORKER=K` (the multi_worker strategy's default for
    `devices_per_worker`), and `TFDIST_LOCAL_DEVICES=K` so that `import
    tfdist` splits the task's CPU into K logical devices, unless the variable
    is already set or the host shows GPUs (`CUDA_VISIBLE_DEVICES` non-empty,
    or /dev/nvidia0), whose devices are the worker's replicas.
    """
    environ = os.environ if environ is None else environ
    out = {"TFDIST_DEVICES_PER_WORKER": str(k)}
    gpus = environ.get("CUDA_VISIBLE_DEVICES", "").strip() not in ("", "-1") or os.path.exists("/dev/nvidia0")
    if not environ.get("TFDIST_LOCAL_DEVICES") and not gpus:
        out["TFDIST_LOCAL_DEVICES"] = str(k)
    return out


@dataclasses.dataclass(frozen=True)
class WorkerCount:
    """`--workers N` (a fixed size) or `--workers MIN:MAX` (a job that may shrink to MIN)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> WorkerCount:
        import argparse

        parts = text.split(":")
        if len(parts) > 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise argparse.ArgumentTypeError(
                f"expected a number of workers N or a range MIN:MAX (e.g. 2:4). Received: {text!r}")
        low, high = (int(parts[0]), int(parts[-1]))
        if len(parts) == 2 and not 1 <= low <= high:
            raise argparse.ArgumentTypeError(
                f"expected MIN:MAX with 1 <= MIN <= MAX (e.g. 2:4). Received: {text!r}")
        return cls(low, high)

    def __str__(self) -> str:
        return str(self.high) if self.low == self.high else f"{self.low}:{self.high}"


def add_arguments(p) -> None:
    """The flags of `tfdist launch` (`p` is an `argparse` parser; more may be added after these)."""
    p.add_argument("--workers", type=WorkerCount.parse, required=True, metavar="N|MIN:MAX",
                   help="number of worker processes; MIN:MAX starts MAX and, when a worker fails more than "
                        "--restarts allows, restarts the job with the others while MIN remain, resuming from "
                        "its last checkpoint")
    p.add_argument("--chief", action="store_true", help="add a chief process (else worker:0 is the chief)")
    p.add_argument("--ps", type=int, default=0, help="number of parameter-server processes (default 0)")
    p.add_argument("--evaluator", action="store_true", help="add an evaluator process")
    p.add_argument(
        "--restarts", type=int, default=0,
        help="restart the whole job up to K times on failure (waiting 1 s, doubling up to 30 s; stopping "
             "early when a failure repeats with no progress); with --ps, restart a failed worker in place",
    )
    p.add_argument("--timeout", type=float, default=None, help="stop the job after S seconds (exit 124)")
    p.add_argument("--grace-period", type=float, default=None, metavar="S",
                   help="seconds each task gets, after the launcher receives SIGINT, SIGTERM or SIGHUP, to save "
                        f"at its next step boundary and exit (sets TFDIST_GRACE_PERIOD; default {GRACE_PERIOD_S:g}); "
                        f"SIGKILL follows {STOP_GRACE_S:g} s later")
    p.add_argument("--startup-timeout", type=float, default=None, metavar="S",
                   help="seconds each task waits at start-up for the others to answer before it fails, "
                        "naming them (sets TFDIST_STARTUP_TIMEOUT; default 300)")
    p.add_argument("--all-progress", action="store_true",
                   help="show every task's progress bars (default: only the chief's)")
    p.add_argument("--tf-logs", action="store_true",
                   help="keep TensorFlow's start-up messages (default: dropped)")
    p.add_argument("--private-network", action="store_true",
                   help="run the job in a network namespace of its own (Linux, unprivileged user namespaces): "
                        "its TensorFlow servers, which listen on every interface, are reachable only from its "
                        "own processes; the job has no network but its loopback")
    p.add_argument("--devices-per-worker", type=int, default=None, metavar="K",
                   help="replicas per worker: each task splits its CPU into K logical devices (sets "
                        "TFDIST_LOCAL_DEVICES, unless set or GPUs are visible) and its multi_worker strategy "
                        "trains on K of them (sets TFDIST_DEVICES_PER_WORKER)")
    p.add_argument("--timeline", default=None, metavar="FILE",
                   help="record each worker's steps, phases and collectives and merge them into one Chrome trace "
                        "(docs/performance.md)")
    p.usage = (
        "tfdist launch --workers N|MIN:MAX [--chief] [--ps M] [--evaluator] [--restarts K] [--timeout S] "
        "[--grace-period S] [--startup-timeout S] [--all-progress] [--tf-logs] [--private-network] "
        "[--devices-per-worker K] [--timeline FILE] -- python train.py ARGS"
    )
    p.epilog = "Signals, preemption, restarts, jobs that change size and network exposure: docs/operations.md"


def main(args) -> int:
    """Runs `tfdist launch` from parsed arguments (`args.rest` holds the command)."""
    command = list(args.rest)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        _say("no command given. Usage: tfdist launch --workers 2 -- python train.py")
        return 2
    startup = getattr(args, "startup_timeout", None)
    env = None
    if startup is not None:
        if not startup > 0:
            _say(f"--startup-timeout must be a number of seconds > 0. Received: --startup-timeout {startup:g}")
            return 2
        env = {"TFDIST_STARTUP_TIMEOUT": f"{startup:g}"}
    per_worker = getattr(args, "devices_per_worker", None)
    if per_worker is not None:
        if per_worker < 1:
            _say(f"--devices-per-worker must be an integer >= 1. Received: --devices-per-worker {per_worker}")
            return 2
        env = dict(env or {}, **devices_per_worker_environment(per_worker))
    count = args.workers if isinstance(args.workers, WorkerCount) else WorkerCount(args.workers, args.workers)
    grace = getattr(args, "grace_period", None)
    if grace is not None and not grace > 0:
        _say(f"--grace-period must be a number of seconds > 0. Received: --grace-period {grace:g}")
        return 2
    try:
        if getattr(args, "private_network", False) and not _in_private_network():
            # Usage errors first, in this process, not after re-executing it.
            _check_arguments(command, count.high, args.chief, args.ps, args.evaluator, args.restarts,
                             args.timeout)
            _check_elastic(count.high, count.low, args.ps, grace)
            return _enter_private_network(args, command)

        def run(env):
            return run_job(command, count.high, chief=args.chief, ps=args.ps, evaluator=args.evaluator,
                           restarts=args.restarts, timeout=args.timeout, env=env,
                           all_progress=getattr(args, "all_progress", False),
                           tf_logs=getattr(args, "tf_logs", False),
                           grace_period=grace, min_workers=count.low if count.low != count.high else None)

        timeline = getattr(args, "timeline", None)
        if timeline:  # each task records, the launcher merges (tfdist.report.timeline)
            from tfdist.report.timeline import recording

            with recording(timeline, env) as recorded_env:
                return run(recorded_env)
        return run(env)
    except ValueError as e:
        _say(str(e).replace("Argument 'workers'", "--workers").replace("Argument 'ps'", "--ps")
             .replace("Argument 'restarts'", "--restarts").replace("Argument 'timeout'", "--timeout")
             .replace("Argument 'grace_period'", "--grace-period")
             .replace("Argument 'min_workers'", "--workers MIN:MAX's MIN")
             .replace("pass workers >= 1 or chief=True", "pass --workers 1 or more, or --chief")
             .replace("seconds > 0 or None", "seconds > 0 (leave --timeout out for no limit)"))
        return 2

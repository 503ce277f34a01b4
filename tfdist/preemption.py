"""Preemption: a stop signal to any task makes every worker save at the next step boundary and exit.

Cluster managers stop a job by signalling its processes and killing them a
grace period later: Kubernetes sends SIGTERM to the containers of a pod it
evicts and SIGKILL `terminationGracePeriodSeconds` (30 s) later; Slurm sends
SIGTERM to the tasks of a job it preempts, requeues or cancels and SIGKILL
`KillWait` (30 s) later; `tfdist launch` forwards its SIGTERM and SIGINT to
every task. A TensorFlow process dies of the first SIGTERM (it trains on if a
`MultiWorkerMirroredStrategy` installed TensorFlow's own handler), and what
it learned since the last checkpoint is lost.

Under a tfdist strategy, while `fit` runs with a `keras.callbacks.BackupAndRestore`
(`tfdist.checkpointing` starts a `PreemptionWatch` for it), SIGTERM or SIGINT
to any task of the job makes every worker finish its step, save the backup at
the same step boundary, print one line saying where, and exit with status 0
(`exit_code`); `fit` with the same backup folder (the same command run again,
at any number of workers) resumes at the step after it.

Across workers the step is agreed through TensorFlow's coordination service
(its key-value store, the one `tf.distribute.experimental.PreemptionCheckpointHandler`
uses, with the same protocol): the signalled task, at its next step boundary
after `s` finished host calls, proposes `s + 1` and waits until every worker has
seen the proposal (a watcher thread on each worker reads it and acknowledges);
no worker can finish call `s + 1` before then, as the call's collectives need
the proposer. Every worker saves after call `s + 1`. A worker signalled at the
same time (SIGTERM from the launcher to every task) finds the proposal taken
and follows it. In a single process the save comes at the next boundary.

TensorFlow's handler itself is not used: it probes the GCE metadata server
(up to 5 s), does nothing on GCE CPU VMs, and its keys, set once per process,
stop a second `fit` (or its cleanup at exit) from working.

The grace period bounds it: a process that has not saved `grace_period`
seconds after the signal (a peer is gone and a collective waits for it) says
so and exits with 128 + the signal's number, leaving the previous backup. A
second SIGINT (Ctrl-C twice) exits at once.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Callable, Optional

from tfdist import launch
from tfdist.options import Option

# The line every worker prints after saving, which `tfdist launch` reads:
# `tfdist: preempted (SIGTERM): worker:0 saved epoch 3, step 17 of 28 (optimizer step 73) to /runs/backup, ...`.
PREEMPTED_PREFIX = launch.PREEMPTED_PREFIX

GRACE_PERIOD = Option(
    name="grace_period",
    default=launch.GRACE_PERIOD_S,
    types=(int, float),
    expected="a number of seconds > 0",
    doc="seconds between a stop signal and the end of the process: the save at the next step boundary must "
        "finish within it (Kubernetes' and Slurm's default grace period is 30 s)",
    check=lambda v: v > 0,
    env="TFDIST_GRACE_PERIOD",
)

EXIT_CODE = Option(
    name="exit_code",
    default=0,
    types=(int,),
    expected="an integer exit status in 0..255",
    doc="the status a preempted worker exits with once it saved (0; a Kubernetes Job that must restart "
        "its pods sets another, see examples/kubernetes/)",
    check=lambda v: 0 <= v <= 255,
    env="TFDIST_PREEMPTION_EXIT_CODE",
)

SIGNALS = ("SIGTERM", "SIGINT")

# Set by `configure`; None: the options' defaults (environment, then built-in).
_configured: dict = {"grace_period": None, "exit_code": None}


def configure(grace_period: Optional[float] = None, exit_code: Optional[int] = None) -> None:
    """Sets this process's preemption settings, for every later `fit` (over the environment's).

    Args:
        grace_period: Optional float. Seconds from a stop signal to the end of
            the process (default 30 s, environment `TFDIST_GRACE_PERIOD`, set
            for every task by `tfdist launch --grace-period S`). `None` keeps
            the current setting.
        exit_code: Optional int. The status a worker exits with once it saved
            (default 0, environment `TFDIST_PREEMPTION_EXIT_CODE`). `None`
            keeps the current setting.

    Raises:
        tfdist.OptionError: a value is out of range; the message names it.

    Example:

    ```python
    tfdist.preemption.configure(grace_period=110)   # Slurm with KillWait=120
    ```
    """
    if grace_period is not None:
        _configured["grace_period"] = float(GRACE_PERIOD.validate(grace_period))
    if exit_code is not None:
        _configured["exit_code"] = EXIT_CODE.validate(exit_code)

# Acknowledgements are awaited at most this long per poll (seconds).
_POLL_S = 1.0
_STOP = 0  # written to the wake-up pipe to end the reader thread (no signal has number 0)

# Fits watched by this process: part of the coordination keys, so that each
# `fit` of a job (the same count on every worker) has keys of its own.
_fits = [0]


class PreemptionWatch:
    """Watches one `fit` for SIGTERM and SIGINT; at the agreed step boundary saves and exits.

    `tfdist.checkpointing` creates one for each `fit` of a model under a
    tfdist strategy that has a `keras.callbacks.BackupAndRestore`; use it
    directly only in a custom loop.

    Args:
        strategy: the model's tfdist strategy (its `cluster_config`, when it
            has one, names the job's workers).
        grace_period: Optional float. Seconds from the signal to the end of
            the process; default `configure`'s, else `GRACE_PERIOD` (30 s,
            environment `TFDIST_GRACE_PERIOD`, `tfdist launch --grace-period S`).
        exit_code: Optional int. Status of the process after the save;
            default `configure`'s, else 0 (environment
            `TFDIST_PREEMPTION_EXIT_CODE`).

    Example:

    ```python
    watch = PreemptionWatch(strategy)
    watch.start()
    try:
        for step in range(steps):
            train_step()
            watch.at_step_boundary(lambda: save_checkpoint(step))
    finally:
        watch.stop()
    ```
    """

    def __init__(self, strategy, grace_period: Optional[float] = None, exit_code: Optional[int] = None):
        grace_period = _configured["grace_period"] if grace_period is None else grace_period
        exit_code = _configured["exit_code"] if exit_code is None else exit_code
        self.grace_period = float(
            GRACE_PERIOD.resolve_default() if grace_period is None else GRACE_PERIOD.validate(grace_period)
        )
        self.exit_code = EXIT_CODE.resolve_default() if exit_code is None else EXIT_CODE.validate(exit_code)
        config = getattr(strategy, "cluster_config", None)
        in_cluster = config is not None and config.task_type in ("chief", "worker")
        self.workers = (
            [f"{job}:{i}" for job in ("chief", "worker") for i in range(len(config.cluster.get(job, ())))]
            if in_cluster else []
        )
        self.task = f"{config.task_type}:{config.task_id}" if in_cluster else "worker:0"
        self.is_chief = bool(getattr(strategy, "is_chief", True))
        self.coordinated = len(self.workers) > 1 and _tfc().coordination_service_enabled()
        self.calls = 0  # host calls finished in this fit: the same count on every worker
        self.signum: Optional[int] = None
        self.signalled_at: Optional[float] = None
        self.target: Optional[int] = None
        self._peer_target: Optional[int] = None
        self._previous: dict = {}
        self._previous_wakeup = -1
        self._pipe: Optional[tuple[int, int]] = None
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._keys = ""
        self.started = False

    # -- life cycle ----------------------------------------------------------

    def start(self) -> bool:
        """Installs the signal handlers (main thread only); returns whether it watches."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "set_wakeup_fd"):
            return False
        _fits[0] += 1
        self._keys = f"tfdist/preemption/fit{_fits[0]}"
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        for name in SIGNALS:
            sig = getattr(signal, name)
            # The Python handler only marks the signal; the C handler's byte on
            # the wake-up pipe reaches the reader thread even while the main
            # thread is inside a TensorFlow call.
            self._previous[sig] = signal.signal(sig, _ignore)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._spawn(self._read_signals, "tfdist-preemption-signals")
        if self.coordinated:
            self._spawn(self._watch_peers, "tfdist-preemption-peers")
        self.started = True
        return True

    def stop(self) -> None:
        """Restores the signal handlers and ends the watcher threads; safe to call twice."""
        if not self.started:
            return
        self.started = False
        self._stopped.set()
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_wakeup)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        read, write = self._pipe
        try:
            os.write(write, bytes([_STOP]))
        except OSError:
            pass
        for thread in self._threads:
            if thread.name == "tfdist-preemption-signals":
                thread.join(timeout=2.0)
        os.close(write)
        os.close(read)

    def _spawn(self, target: Callable, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the main thread, at each step boundary ------------------------------

    @property
    def preempted(self) -> bool:
        """Whether a stop signal reached this task or its job during this fit."""
        return self.signum is not None or self._peer_target is not None

    def at_step_boundary(self, save: Callable[[], str]) -> None:
        """Called after each host call; saves and exits once the job agreed this is the step.

        Args:
            save: callable. Writes the checkpoint and returns what the
                worker's line reports: the position and the place, e.g.
                `("epoch 3, step 17 of 28 (optimizer step 73)", "/runs/backup")`.
        """
        if not self.started:
            return
        self.calls += 1
        if self.target is None and self._peer_target is not None:
            self.target = self._peer_target
        if self.target is None and self.signum is not None:
            try:
                self.target = self._propose() if self.coordinated else self.calls
            except Exception as error:  # the job's coordination service is gone with a peer
                self._give_up(f"it could not agree on a step with the other workers ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); the job is ending anyway")
        if self.target is None or self.calls < self.target:
            return
        began = time.monotonic()
        position, place = save()
        cause = signal.Signals(self.signum).name if self.signum is not None else "stop signal to another task"
        after = f", {began - self.signalled_at:.2f} s after the signal" if self.signalled_at is not None else ""
        print(
            f"{PREEMPTED_PREFIX} ({cause}): {self.task} saved {position} to {place}{after} (the save took "
            f"{time.monotonic() - began:.2f} s); exiting with status {self.exit_code}. Run the same command again "
            "to resume there, at any number of workers.",
            flush=True,
        )
        self.stop()
        sys.exit(self.exit_code)

    def _propose(self) -> int:
        """This task's signal, in a job of several workers: the step every worker saves after."""
        proposed = self.calls + 1
        if not _tfc().insert_key_value(f"{self._keys}/step", str(proposed)):
            # Another task was signalled first; its proposal stands.
            value = None
            while value is None:
                value = _tfc().get_key_value(f"{self._keys}/step", _POLL_S)
            return int(value)
        for worker in self.workers:
            # Every worker must know the step before anyone can finish it.
            while _tfc().get_key_value(f"{self._keys}/ack/{worker}", _POLL_S) is None:
                pass  # bounded by the grace period (the reader thread ends the process)
        return proposed

    # -- threads -------------------------------------------------------------

    def _watch_peers(self) -> None:
        """Reads the job's agreed step (set by whichever task was signalled) and acknowledges it."""
        key = f"{self._keys}/step"
        while not self._stopped.is_set():
            try:
                value = _tfc().get_key_value(key, _POLL_S)
            except Exception:  # the job's coordination service went away: nothing to watch
                return
            if value is not None:
                self._peer_target = int(value)
                try:
                    _tfc().insert_key_value(f"{self._keys}/ack/{self.task}", "1")
                except Exception:
                    pass
                return

    def _read_signals(self) -> None:
        """Records the first stop signal and enforces the grace period from then on."""
        read = self._pipe[0]
        deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([read], [], [], timeout)
            if not ready:
                self._give_up(f"it did not reach a step boundary within the grace period ({self.grace_period:g} s; "
                              "a peer may be gone, or a step takes longer than that). Raise it with "
                              "TFDIST_GRACE_PERIOD (tfdist launch --grace-period S) and the cluster manager's "
                              "grace period")
                return
            data = os.read(read, 64)
            for signum in data:
                if signum == _STOP or self._stopped.is_set():
                    return
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue  # another handler's signal sharing the wake-up pipe
                if self.signum is None:
                    self.signum, self.signalled_at = signum, time.monotonic()
                    deadline = self.signalled_at + self.grace_period
                    print(
                        f"tfdist: {signal.Signals(signum).name} received by {self.task}: every worker saves at "
                        f"the next step boundary (grace period {self.grace_period:g} s).",
                        flush=True,
                    )
                elif signum == signal.SIGINT and self.signum == signal.SIGINT:
                    print("tfdist: SIGINT again: exiting now, without a checkpoint.", flush=True)
                    os._exit(128 + signal.SIGINT)

    def _give_up(self, why: str) -> None:
        """Ends the process without a checkpoint (from any thread): the previous backup stays."""
        print(
            f"tfdist: {self.task} stops on {signal.Signals(self.signum).name} without a checkpoint: {why}. The "
            f"previous backup stays; exiting with status {128 + self.signum}.",
            flush=True,
        )
        os._exit(128 + self.signum)


def _tfc():
    # TensorFlow is loaded only where a watch runs: `tfdist launch` reads this
    # module's constants without it.
    from tfdist._compat import tf as tfc

    return tfc


def _ignore(signum, frame) -> None:
    # The wake-up pipe carries the signal to the reader thread.
    return None

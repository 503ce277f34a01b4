"""StepRecorder: times every host call of a Keras train function and profiles a few to split them into phases.

Keras's `fit` calls `model.train_function(iterator)` once per host call (one
step, or `steps_per_execution` steps). The recorder wraps that function:

* every call: its wall-clock start and end (`time.time_ns`, the clock the
  profiler uses) and the examples it ran on this process (the change of
  Keras's `loss` metric's count, which every train step adds its batch's rows
  to; read from this process's replicas only, so no collective runs);
* a window of calls (`profile_calls`, after `skip_calls` that trace and warm
  up, and again at the start of each `period_calls`) split into phases: in
  one process by TensorFlow's profiler (`tfdist.report.trace`); in a task of
  a multi-process job, where that profiler corrupts the heap
  (`PROFILER_IN_JOBS`), by timed ablations of the step measured once by every
  task one call before the window (`tfdist.report.ablation`);
* with a timeline directory (`tfdist launch --timeline`): this task's trace
  file, and a progress record (the last call begun) that names the workers
  which had not arrived when a collective times out.

The same recorder serves `tfdist.callbacks.StepReport`, `tfdist launch
--timeline` and `tfdist tune` (`from_environment`, installed by the Keras
integration where `make_train_function` builds a tfdist model's function).
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from typing import Callable, Optional

import tensorflow as tf

from tfdist import checkpointing
from tfdist._compat import keras as kc
from tfdist._compat import tf as tfc
from tfdist.report import trace
from tfdist.report.timeline import TIMELINE_DIR_ENV  # where each task of `tfdist launch --timeline` writes

TIMELINE_CALLS_ENV = "TFDIST_TIMELINE_STEPS"
# Environment of one `tfdist tune` trial: where the chief writes its rate, and how many calls it times.
TUNE_TRIAL_ENV = "TFDIST_TUNE_TRIAL"
TUNE_CALLS_ENV = "TFDIST_TUNE_STEPS"
# Use TensorFlow's profiler in a task of a multi-process job too (see PROFILER_IN_JOBS).
PROFILE_ALL_TASKS_ENV = "TFDIST_PROFILE_ALL_TASKS"
PROFILER_IN_JOBS = (
    "TensorFlow 2.21's profiler corrupts the heap of a task of a multi-process job: the task that is not "
    "the first crashes when the profiler stops (SIGSEGV/SIGABRT in tsl::profiler::SplitEventTracker::"
    "FindStartAndMerge, TraceMeRecorder::Consume; its collectives' activities start and end on different "
    "threads) in about half of the 2-worker jobs measured, and the first one later (a SIGSEGV in "
    "get_graph_debug_info when a collective timed out, 1 job in 2 with the profiler on, none in 6 without)"
)

DEFAULT_SKIP_CALLS = 2
DEFAULT_PROFILE_CALLS = 5
DEFAULT_TIMELINE_CALLS = 10


@dataclasses.dataclass
class Call:
    """One host call: wall-clock nanoseconds, steps, examples on this process, and its place."""

    index: int
    start_ns: int
    end_ns: int
    steps: int
    samples: Optional[int]
    epoch: int
    profiled: bool = False
    warmup: bool = False


def task_of_this_process() -> tuple[Optional[str], int, int]:
    """`(task name, index among the workers, workers)` from TF_CONFIG, or `(None, 0, 1)` without one."""
    raw = os.environ.get("TF_CONFIG", "")
    if not raw:
        return None, 0, 1
    try:
        config = json.loads(raw)
        job, index = config["task"]["type"], int(config["task"]["index"])
        cluster = config.get("cluster", {})
    except (ValueError, KeyError, TypeError):
        return None, 0, 1
    workers = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
    position = index + (len(cluster.get("chief", [])) if job == "worker" else 0)
    return f"{job}:{index}", position, max(workers, 1)


def _loss_count_parts(model) -> list:
    """This process's parts of the `loss` metric's count variable (one per local replica), or [].

    Keras's `train_step` (and tfdist's) adds each batch's rows to it; a custom
    `train_step` updates it as it likes (once per step, or not at all): [] then.
    """
    if kc.has_custom_train_step(model):
        return []
    metrics = getattr(model, "metrics", None) or []
    loss = next((m for m in metrics if getattr(m, "name", None) == "loss" and hasattr(m, "count")), None)
    if loss is None:
        return []
    variable = kc.tf_variable(loss.count)
    if isinstance(variable, tf.distribute.DistributedValues):
        return list(variable.values)
    return [variable]


class _ProgressBoard:
    """Each task's last host call begun, in a small file per task of a timeline directory."""

    _FORMAT = "<qq"  # call index, wall-clock ns

    def __init__(self, directory: str, task: str):
        self.directory = directory
        self.task = task
        self.path = os.path.join(directory, f"{task.replace(':', '-')}.progress")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def began(self, call: int) -> None:
        os.pwrite(self._fd, struct.pack(self._FORMAT, call, time.time_ns()), 0)

    def peers(self) -> dict[str, tuple[int, int]]:
        """`{task: (last call begun, when)}` of every other task that has begun one."""
        out = {}
        for path in glob.glob(os.path.join(self.directory, "*.progress")):
            if os.path.abspath(path) == os.path.abspath(self.path):
                continue
            with open(path, "rb") as f:
                raw = f.read(struct.calcsize(self._FORMAT))
            if len(raw) == struct.calcsize(self._FORMAT):
                task = os.path.basename(path)[: -len(".progress")].replace("-", ":")
                out[task] = struct.unpack(self._FORMAT, raw)
        return out

    def close(self) -> None:
        os.close(self._fd)


def late_workers_message(call: int, peers: dict[str, tuple[int, int]], now_ns: int) -> str:
    """The sentence naming the tasks that had not begun host call `call` (from the progress board)."""
    late = {task: record for task, record in peers.items() if record[0] < call}
    if not late:
        return (f"Every other task had begun host call {call} ({', '.join(sorted(peers)) or 'none recorded'}): "
                "the collective waited on a task inside the step (its input, compute or another collective).")
    named = ", ".join(
        f"{task} (last began host call {record[0]}, {(now_ns - record[1]) / 1e9:.1f} s before)"
        for task, record in sorted(late.items())
    )
    return f"Tasks that had not arrived at host call {call} when this collective timed out: {named}."


class StepRecorder:
    """A wrapper of one model's train function that times each host call and splits a window of them into phases.

    Args:
        model: the Keras model whose `train_function` is wrapped.
        skip_calls: int. Calls not timed at the start (the first traces the
            function). Default 2.
        profile_calls: int. Calls per profiled window (0: no profiling). Default 5.
        period_calls: Optional int. Profile a window again every this many calls.
        timeline_dir: Optional str. Where this task writes its timeline and
            progress record (`tfdist launch --timeline`).

    `mode` is "profiler" in one process, "ablation" in a task of a job of
    several (`TFDIST_PROFILE_ALL_TASKS=1`: "profiler" there too).

    Example:

    ```python
    recorder = StepRecorder(model)
    model.train_function = recorder.wrap(model.make_train_function())
    ```
    """

    def __init__(self, model, skip_calls: int = DEFAULT_SKIP_CALLS, profile_calls: int = DEFAULT_PROFILE_CALLS,
                 period_calls: Optional[int] = None, timeline_dir: Optional[str] = None):
        self.model = model
        self.skip_calls = max(int(skip_calls), 0)
        self.profile_calls = max(int(profile_calls), 0)
        self.period_calls = period_calls
        self.calls: list[Call] = []
        self.windows: list[dict] = []  # one per analysed call: {"call", "start_ns", "end_ns", "phases", "runs"}
        self.collectives: list[tuple[str, int, int, int]] = []  # (op, arrival ns, end ns, call)
        self.profile_error: Optional[str] = None
        self.element_spec = None
        self.cost_s = 0.0  # seconds spent by the recorder itself (profiler start/stop/read, count reads)
        self.epoch = 0
        self.task, self.worker_index, self.workers = task_of_this_process()
        self.timeline_dir = timeline_dir
        self.board = _ProgressBoard(timeline_dir, self.task or "worker:0") if timeline_dir else None
        # TensorFlow's profiler is not safe in a task of a multi-process job (PROFILER_IN_JOBS):
        # there the window's calls are split with timed ablations of the step (`tfdist.report.ablation`).
        self.mode = "ablation" if self.workers > 1 and os.environ.get(PROFILE_ALL_TASKS_ENV) != "1" else "profiler"
        self.ablation: Optional[dict] = None
        self.count_parts = None
        self._last_count = 0
        self._profiling: Optional[dict] = None  # {"logdir", "calls": [indices]}
        self._pending: list[tuple[str, list[int]]] = []  # stopped profiles not yet analysed: (logdir, calls)
        self._timeline_written = False
        self.finished = False

    # -- the wrapper -------------------------------------------------------

    def wrap(self, function: Callable) -> Callable:
        """`function` (a Keras train function) with every call recorded."""

        def recorded(iterator):
            if self.finished:
                return function(iterator)
            return self._call(function, iterator)

        recorded.tfdist_recorder = self
        recorded.wrapped = function
        if hasattr(function, "traced_graphs"):  # what tools and tests read of tfdist's host function
            recorded.traced_graphs = function.traced_graphs
        return recorded

    def _wants_profile(self, index: int) -> bool:
        if not self.profile_calls or self.profile_error or self.mode != "profiler":
            return False
        offset = index - self.skip_calls
        if offset < 0:
            return False
        if self.period_calls:
            offset %= max(self.period_calls, self.profile_calls + 1)
        return offset == 0

    def _call(self, function, iterator):
        index = len(self.calls)
        if self.element_spec is None:
            self.element_spec = getattr(iterator, "element_spec", None) or getattr(iterator, "spec", None)
        if self._profiling is None and self._wants_profile(index):
            self._start_profile()
        # Every task at the same call (the exchange alone is a collective), one call before the window:
        # the tasks leave the ablation together, and their steps' own pace resumes by the window.
        at = self.skip_calls - 1 if self.skip_calls >= 2 else self.skip_calls
        if self.mode == "ablation" and self.profile_calls and index == at and self.ablation is None:
            self._measure_ablation()
        if self.board is not None:
            self.board.began(index)
        before = self._read_count()
        if before is not None and before < self._last_count and self.calls:
            self.epoch += 1  # Keras reset its metrics: a new epoch
        start = time.time_ns()
        try:
            logs = function(iterator)
        except tf.errors.DeadlineExceededError as error:
            self._stop_profile()
            raise self._name_late_workers(error, index) from error
        end = time.time_ns()
        after = self._read_count()
        samples = None if after is None or before is None else after - before
        self._last_count = after or 0
        steps = getattr(self.model, "steps_per_execution", 1)
        steps = steps if isinstance(steps, int) and steps > 0 else 1
        self.calls.append(Call(index, start, end, steps, samples, self.epoch,
                               profiled=self._profiling is not None, warmup=index < self.skip_calls))
        if self._profiling is not None:
            self._profiling["calls"].append(index)
            # The window's calls and one more, whose start closes the window's last call: stopped then,
            # so the profiler's own stop is in no analysed call.
            if len(self._profiling["calls"]) > self.profile_calls:
                self._profiling["calls"].pop()
                self._stop_profile()
        if self.mode == "ablation" and self.ablation and not self.windows \
                and index >= self.skip_calls + self.profile_calls:
            self._split_by_ablation()
        if self._pending and (self.timeline_dir or not self.profile_calls):
            self.analyse()
        if self.timeline_dir and not self._timeline_written and not self._pending and self._profiling is None \
                and index >= self.skip_calls + self.profile_calls:
            self.write_timeline()  # a task that was not profiled: its host calls only
        return logs

    def _read_count(self) -> Optional[int]:
        """Keras's `loss` metric's count summed over this process's replicas (examples so far this epoch)."""
        began = time.perf_counter()
        if self.count_parts is None:
            self.count_parts = _loss_count_parts(self.model)
        if not self.count_parts:
            return None
        count = int(round(sum(float(p.numpy()) for p in self.count_parts)))
        self.cost_s += time.perf_counter() - began
        return count

    def note_steps(self, steps: int) -> None:
        """Sets the last call's steps (Keras's `on_train_batch_end` knows them: `end - begin + 1`)."""
        if self.calls and steps > 0:
            self.calls[-1].steps = steps

    def note_epoch_end(self) -> None:
        """Marks an epoch boundary (`on_epoch_end`): the next call starts the next epoch."""
        self.epoch += 1
        self._last_count = 0

    @property
    def local_replicas(self) -> int:
        """Replicas of this process (its parts of the metric variables; 1 without them)."""
        return max(len(self.count_parts or [None]), 1)

    # -- timed ablations (tasks of a multi-process job) --------------------

    def _measure_ablation(self) -> None:
        from tfdist.report import ablation

        began = time.perf_counter()
        counted = [c.samples / c.steps for c in self.calls if c.samples]
        if not counted:
            self.profile_error = ("no step was split: the examples per step are unknown (Keras's loss metric "
                                  "counts none; a custom train_step)")
            return
        per_replica = max(int(round(counted[-1] / self.local_replicas)), 1)
        try:
            self.ablation = ablation.measure(self.model, per_replica, self.element_spec,
                                             in_strategy_scope=tf.distribute.has_strategy())
        except Exception as error:  # a model the ablations cannot run apart from its step
            self.profile_error = f"the step's timed ablations failed: {type(error).__name__}: {error}"[:400]
        self.cost_s += time.perf_counter() - began

    def _split_by_ablation(self) -> None:
        """Each window call: forward-backward and update as timed alone, the rest of the call the exchange."""
        by_index = {c.index: c for c in self.calls}
        compute = self.ablation["compute"] or 0.0
        update = self.ablation["update"] or 0.0
        for i in range(self.skip_calls, self.skip_calls + self.profile_calls):
            call, following = by_index.get(i), by_index.get(i + 1)
            if call is None:
                continue
            end = following.start_ns if following is not None and following.epoch == call.epoch else call.end_ns
            c_ns = int(compute * 1e9 * call.steps)
            u_ns = int(update * 1e9 * call.steps)
            in_call = call.end_ns - call.start_ns
            c_ns, u_ns = min(c_ns, in_call), min(u_ns, max(in_call - c_ns, 0))
            arrive, leave = call.start_ns + c_ns, call.end_ns - u_ns
            runs = [(call.start_ns, arrive, "compute"), (arrive, leave, "exchange"), (leave, call.end_ns, "update"),
                    (call.end_ns, end, "other")]
            runs = [r for r in runs if r[1] > r[0]]
            phases = dict.fromkeys(trace.PHASES, 0)
            for start, stop, phase in runs:
                phases[phase] += stop - start
            self.windows.append({"call": i, "start_ns": call.start_ns, "end_ns": end, "phases": phases, "runs": runs})
            # The step's exchange as one collective: this task arrives when its forward-backward is done.
            self.collectives.append(("exchange (estimated)", arrive, leave, i))
        if self.timeline_dir and not self._timeline_written:
            self.write_timeline()

    # -- profiling ---------------------------------------------------------

    def _start_profile(self) -> None:
        began = time.perf_counter()
        logdir = tempfile.mkdtemp(prefix="tfdist_profile_")
        try:
            tf.profiler.experimental.start(logdir)
        except (tf.errors.AlreadyExistsError, tf.errors.UnavailableError) as error:
            shutil.rmtree(logdir, ignore_errors=True)
            self.profile_error = (f"TensorFlow's profiler was already running in this process ({error.message}); "
                                  "the phases need it for a few steps. Profile elsewhere (TensorBoard's "
                                  "profile_batch) or drop the StepReport for that run.")
            return
        self._profiling = {"logdir": logdir, "calls": []}
        self.cost_s += time.perf_counter() - began

    def _stop_profile(self) -> None:
        if self._profiling is None:
            return
        began = time.perf_counter()
        try:
            tf.profiler.experimental.stop()
        except tf.errors.UnavailableError:
            pass
        self._pending.append((self._profiling["logdir"], self._profiling["calls"]))
        self._profiling = None
        self.cost_s += time.perf_counter() - began

    def update_scopes(self) -> list[str]:
        optimizer = getattr(self.model, "optimizer", None)
        scopes = []
        while optimizer is not None and getattr(optimizer, "name", None):
            scopes.append(optimizer.name)
            optimizer = getattr(optimizer, "inner_optimizer", None)
        return scopes

    def analyse(self) -> None:
        """Reads the stopped profiles and splits their calls into phases (at most once per profile)."""
        began = time.perf_counter()
        by_index = {c.index: c for c in self.calls}
        gaps = self.median_gap_ns()
        for logdir, indices in self._pending:
            files = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
            if not files or not indices:
                shutil.rmtree(logdir, ignore_errors=True)
                continue
            events = trace.intervals(tfc.read_xspace(files[0]), self.update_scopes())
            shutil.rmtree(logdir, ignore_errors=True)
            bounds = []
            for i in indices:
                call = by_index[i]
                following = by_index.get(i + 1)
                if following is not None and following.epoch == call.epoch:
                    bounds.append((call.start_ns, following.start_ns))
                else:
                    bounds.append((call.start_ns, call.end_ns + int(gaps)))
            for i, bound, split in zip(indices, bounds, trace.split(events, bounds)):
                self.windows.append({"call": i, "start_ns": bound[0], "end_ns": bound[1], **split})
            first, last = bounds[0][0], bounds[-1][1]
            for c in trace.collectives(events):
                if first <= c.start_ns < last:
                    call = next(i for i, b in zip(indices, bounds) if b[0] <= c.start_ns < b[1])
                    self.collectives.append((c.name.rsplit(":", 1)[-1], c.start_ns, c.end_ns, call))
        self._pending = []
        self.cost_s += time.perf_counter() - began
        if self.timeline_dir and self.windows and not self._timeline_written:
            self.write_timeline()

    def finish(self) -> None:
        """Ends a window still open (fit ended inside it) and analyses what was recorded."""
        self._stop_profile()
        if self._pending:
            self.analyse()
        if self.mode == "ablation" and self.ablation and not self.windows:
            self._split_by_ablation()

    def median_gap_ns(self) -> float:
        """The median time between one call's end and the next call's start within an epoch (Keras's host work)."""
        gaps = [b.start_ns - a.end_ns for a, b in zip(self.calls, self.calls[1:]) if a.epoch == b.epoch]
        return statistics.median(gaps) if gaps else 0.0

    # -- a collective that timed out ------------------------------------

    def _name_late_workers(self, error, call: int):
        if self.board is None:
            return error
        message = f"{error.message}\n{late_workers_message(call, self.board.peers(), time.time_ns())}"
        return type(error)(getattr(error, "node_def", None), getattr(error, "op", None), message)

    # -- the timeline file -------------------------------------------------

    def write_timeline(self) -> str:
        """Writes this task's steps, phases and collectives to the timeline directory; returns the path.

        The host calls of the timeline's window (`skip_calls` to `skip_calls + profile_calls`), and
        where this task was profiled their phases and collectives.
        """
        task = self.task or "worker:0"
        window = range(self.skip_calls, self.skip_calls + self.profile_calls)
        payload = {
            "task": task,
            "worker_index": self.worker_index,
            "pid": os.getpid(),
            "clock": "time.time_ns",
            "profiled": bool(self.windows) and self.mode == "profiler",
            "split": self.mode,
            "not_profiled_because": None if self.windows else self.profile_error,
            "calls": [[c.index, c.start_ns, c.end_ns, c.steps] for c in self.calls if c.index in window],
            "runs": [[w["call"], s, e, p] for w in self.windows for s, e, p in w["runs"]],
            "collectives": [list(c) for c in self.collectives],
        }
        path = os.path.join(self.timeline_dir, f"{task.replace(':', '-')}.json")
        def dump(temporary):
            with open(temporary, "w") as f:
                json.dump(payload, f)

        checkpointing.write_atomically(path, dump)
        self._timeline_written = True
        return path


def _trial_wrapper(recorder: StepRecorder, function: Callable, path: str, calls: int) -> Callable:
    """A `tfdist tune` trial: times `calls` calls after the warm-up, writes the rate (chief), and ends the process."""
    wrapped = recorder.wrap(function)

    def trial(iterator):
        logs = wrapped(iterator)
        timed = [c for c in recorder.calls if not c.warmup]
        if len(timed) >= calls:
            seconds = (timed[-1].end_ns - timed[0].start_ns) / 1e9
            samples = [c.samples for c in timed]
            local = sum(samples) if all(s is not None for s in samples) else None
            replicas = recorder.model.distribute_strategy.num_replicas_in_sync
            local_replicas = recorder.local_replicas
            steps = sum(c.steps for c in timed)
            options = getattr(recorder.model.distribute_strategy, "options", None)
            if recorder.worker_index == 0:
                with open(path, "w") as f:
                    json.dump({
                        "options": options.as_dict() if hasattr(options, "as_dict") else None,
                        "samples_per_s": None if local is None else local * replicas / local_replicas / seconds,
                        "steps_per_s": steps / seconds, "steps": steps, "seconds": seconds,
                    }, f)
            # Every worker reaches this same call, so none is left waiting in a collective.
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return logs

    trial.tfdist_recorder = recorder
    return trial


def from_environment(model, function: Callable) -> Callable:
    """`function` recorded as `tfdist launch --timeline` or a `tfdist tune` trial asks (environment), else itself.

    Called where a tfdist model's train function is built
    (`tfdist.keras_integration`); without `TFDIST_TIMELINE_DIR` or
    `TFDIST_TUNE_TRIAL` in the environment it returns `function` unchanged.
    """
    trial = os.environ.get(TUNE_TRIAL_ENV)
    if trial:
        recorder = StepRecorder(model, profile_calls=0)
        return _trial_wrapper(recorder, function, trial, int(os.environ.get(TUNE_CALLS_ENV, "20")))
    directory = os.environ.get(TIMELINE_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return function
    calls = int(os.environ.get(TIMELINE_CALLS_ENV, str(DEFAULT_TIMELINE_CALLS)))
    recorder = StepRecorder(model, profile_calls=calls, timeline_dir=directory)
    atexit.register(recorder.finish)
    return recorder.wrap(function)

"""`tfdist launch --timeline FILE`: every worker's steps, phases and collectives on one clock, in one Chrome trace.

Each task of the job records a window of its steps (`tfdist.report.recorder`,
enabled by the environment variable `TFDIST_TIMELINE_DIR` that `recording`
sets) and writes `<job>-<index>.json` there. `merge` reads them and writes one
trace in Chrome's trace-event format (load it at chrome://tracing or
https://ui.perfetto.dev):

* one process per task (`pid` = its position in the job, named `worker:0`, ...),
  with three tracks: `steps` (each host call), `phases` (input, compute,
  exchange, update, other, as the step report splits them) and
  `collectives`;
* each collective as this task saw it: `wait for peers` from the moment this
  task arrived until the last task arrived (absent on the last one: the late
  worker is the one without a wait), then the collective itself until it
  ended here; its arguments name the last task to arrive and by how much.

Where the tasks were split by TensorFlow's profiler (`TFDIST_PROFILE_ALL_TASKS=1`)
each collective op is in the trace as recorded. By default a multi-process
job is not profiled (TensorFlow 2.21's profiler corrupts its tasks' heap:
`tfdist.report.recorder.PROFILER_IN_JOBS`) and each task's step is split by
timed ablations (`tfdist.report.ablation`): the step's exchange appears as one
collective per host call that the task reaches when its forward-backward pass
(timed alone) is done, marked `"arrival": "estimated ..."`, and that ends when
its update (timed alone) begins. The host calls themselves are measured on
every task. A straggler that starts its calls late (Python between steps)
or computes slower is then named; one slowed inside the step by its input
is not told apart from the exchange.

Clocks: each task records `time.time_ns()` on its own host. The end of a
collective is nearly simultaneous on every task (each finishes when the last
piece of the sum reaches it: one message apart), so each task's offset to the
first is the median, over every collective both recorded, of the difference
of their end times (of their host calls' end times where a task was split by
ablations, not profiled), and every event is shifted by it. The offsets are written in the
trace (`otherData.clock_offsets_ms`).

This module imports no TensorFlow: the launcher runs it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Iterator, Optional

TIMELINE_DIR_ENV = "TFDIST_TIMELINE_DIR"  # the same as tfdist.report.recorder's
_TRACKS = {"steps": 1, "phases": 2, "collectives": 3}


def read_tasks(directory: str) -> list[dict]:
    """The per-task files a job wrote to `directory`, ordered by the task's position in the job."""
    tasks = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            tasks.append(json.load(f))
    return sorted(tasks, key=lambda t: t["worker_index"])


def _instances(task: dict) -> dict[tuple[int, int], tuple[str, int, int]]:
    """`{(call, k): (op, arrival, end)}`: the k-th collective this task reached in each call."""
    out: dict[tuple[int, int], tuple[str, int, int]] = {}
    seen: dict[int, int] = {}
    for op, start, end, call in sorted(task["collectives"], key=lambda c: (c[3], c[1])):
        k = seen.get(call, 0)
        seen[call] = k + 1
        out[(call, k)] = (op, start, end)
    return out


def clock_offsets(tasks: list[dict]) -> dict[str, float]:
    """Each task's clock minus the first task's, in ns.

    The median difference of the end times of the collectives both recorded
    (profiled); where one of them was not profiled, of their host calls' end
    times (a call ends a little after its last collective, alike on every
    task: the update and the metrics' read).
    """
    if not tasks:
        return {}

    def recorded(task):  # collectives recorded by the profiler, not estimated by ablations
        return _instances(task) if task.get("split", "profiler") == "profiler" else {}

    reference = recorded(tasks[0])
    reference_calls = {c[0]: c for c in tasks[0]["calls"]}
    offsets = {tasks[0]["task"]: 0.0}
    for task in tasks[1:]:
        mine = recorded(task)
        diffs = [mine[key][2] - reference[key][2] for key in mine.keys() & reference.keys()]
        if not diffs:
            diffs = [c[2] - reference_calls[c[0]][2] for c in task["calls"] if c[0] in reference_calls]
        offsets[task["task"]] = float(statistics.median(diffs)) if diffs else 0.0
    return offsets


def _estimated_instances(task: dict, profiled: dict, offsets: dict) -> dict[tuple[int, int], tuple[str, int, int]]:
    """Collectives of a task that was not profiled, from a profiled task's: same op, same time into the call.

    Every task runs the same program, so the k-th collective of call i is
    reached the same time after the call's start (its arrival estimated
    from its own call start), and ends when the profiled task's does.
    """
    starts = {c[0]: c[1] for c in task["calls"]}
    profiled_starts = {c[0]: c[1] for c in profiled["calls"]}
    shift = offsets[task["task"]] - offsets[profiled["task"]]
    out = {}
    for (call, k), (op, arrival, end) in _instances(profiled).items():
        if call in starts and call in profiled_starts:
            out[(call, k)] = (op, starts[call] + (arrival - profiled_starts[call]), end + shift)
    return out


def merge(directory: str, path: str) -> dict:
    """Merges the task files in `directory` into one Chrome trace at `path`; returns the trace.

    Args:
        directory: where the tasks wrote (`TFDIST_TIMELINE_DIR`).
        path: the trace file to write (JSON).

    Raises:
        FileNotFoundError: no task wrote a timeline (the job ran no profiled
            step, or it was not a Keras `fit` under a tfdist strategy).

    Example:

    ```python
    trace = merge("/tmp/job-timeline", "timeline.json")
    len(trace["traceEvents"])
    ```
    """
    tasks = read_tasks(directory)
    if not tasks:
        raise FileNotFoundError(
            f"No task wrote a timeline to {directory}: the job ran no profiled step (tfdist records host calls "
            f"3 to 12 of a Keras fit under a tfdist strategy; set TFDIST_TIMELINE_STEPS for more or fewer)."
        )
    offsets = clock_offsets(tasks)
    origin = min(c[1] - offsets[t["task"]] for t in tasks for c in t["calls"]) if any(t["calls"] for t in tasks) else 0

    def us(ns: float, task: dict) -> float:
        return (ns - offsets[task["task"]] - origin) / 1000.0

    events: list[dict] = []
    for task in tasks:
        pid = task["worker_index"]
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": task["task"]}})
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        for name, tid in _TRACKS.items():
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
        for index, start, end, steps in task["calls"]:
            events.append({"ph": "X", "pid": pid, "tid": _TRACKS["steps"], "name": f"host call {index}",
                           "ts": us(start, task), "dur": (end - start) / 1000.0, "args": {"steps": steps}})
        for call, start, end, phase in task["runs"]:
            events.append({"ph": "X", "pid": pid, "tid": _TRACKS["phases"], "name": phase, "cat": "phase",
                           "ts": us(start, task), "dur": (end - start) / 1000.0, "args": {"call": call}})
    # Collectives: every task's arrival, aligned, so each shows how long it waited for the last.
    profiled = next((t for t in tasks if t["collectives"]), None)
    instances = [_instances(t) if t["collectives"] or profiled is None else _estimated_instances(t, profiled, offsets)
                 for t in tasks]
    estimated = {t["task"] for t in tasks if t.get("split") == "ablation" or (not t["collectives"] and profiled)}
    keys = sorted(set().union(*[i.keys() for i in instances]))
    for key in keys:
        arrivals = {t["task"]: inst[key][1] - offsets[t["task"]] for t, inst in zip(tasks, instances) if key in inst}
        last_task = max(arrivals, key=arrivals.get)
        last = arrivals[last_task]
        first = min(arrivals.values())
        for task, inst in zip(tasks, instances):
            if key not in inst:
                continue
            op, start, end = inst[key]
            pid, arrived = task["worker_index"], start - offsets[task["task"]]
            args = {"call": key[0], "collective": key[1], "last_to_arrive": last_task,
                    "arrival_spread_ms": (last - first) / 1e6, "arrived_after_first_ms": (arrived - first) / 1e6,
                    "arrival": ("estimated: the host call's start plus the forward-backward pass timed alone"
                                if task.get("split") == "ablation" else
                                "estimated: the host call's start plus the profiled task's time to this collective"
                                if task["task"] in estimated else "recorded")}
            if last > arrived:
                events.append({"ph": "X", "pid": pid, "tid": _TRACKS["collectives"], "name": "wait for peers",
                               "cat": "collective", "ts": us(start, task), "dur": (last - arrived) / 1000.0,
                               "args": args})
            begin = max(start, last + offsets[task["task"]])
            events.append({"ph": "X", "pid": pid, "tid": _TRACKS["collectives"], "name": op, "cat": "collective",
                           "ts": us(begin, task), "dur": max(end - begin, 0) / 1000.0, "args": args})
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "tfdist launch --timeline",
            "tasks": [t["task"] for t in tasks],
            "clock_offsets_ms": {task: offset / 1e6 for task, offset in offsets.items()},
            "clock_alignment": ("median difference of the collectives' end times (of the host calls' end "
                                "times for a task not profiled), against the first task"),
            "not_profiled": {t["task"]: t.get("not_profiled_because") for t in tasks if not t.get("profiled", True)},
        },
    }
    directory_out = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory_out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace


@contextlib.contextmanager
def recording(path: str, env: Optional[dict] = None) -> Iterator[dict]:
    """A temporary timeline directory for one job: yields the environment its tasks need, merges into `path` after.

    Example:

    ```python
    with recording("timeline.json") as env:
        run_job(["python", "train.py"], workers=2, env=env)
    ```
    """
    directory = tempfile.mkdtemp(prefix="tfdist_timeline_")
    try:
        yield {**(env or {}), TIMELINE_DIR_ENV: directory}
        try:
            trace = merge(directory, path)
        except FileNotFoundError as error:
            print(f"tfdist launch: --timeline: {error}", file=sys.stderr, flush=True)
            return
        offsets = ", ".join(f"{t} {o:+.3f} ms" for t, o in trace["otherData"]["clock_offsets_ms"].items())
        print(f"tfdist launch: timeline of {len(trace['otherData']['tasks'])} task(s) written to {path} "
              f"(clock offsets {offsets})", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

"""Where a step's time goes, read from TensorFlow's profiler: each instant of a step given to one phase.

`tf.profiler.experimental.start/stop` records every TensorFlow op a process
runs (executor threads, the collective runtime's threads, tf.data's threads;
on a GPU also each kernel on its stream) as an interval with its op's name and
type. `intervals` sorts them into the phases of a training step:

* `input`: the step waiting for its next batch — tf.data's consumer side
  (`IteratorGetNextOp::DoCompute`, `IteratorGetNextAsOptionalOp::DoCompute`,
  a multi-device iterator's `GetNextFromShard<i>`), and the iterator ops
  themselves; host-to-device copies on a GPU. The pipeline's producer threads
  (map functions, prefetch) are not counted: they only cost the step what it
  waits for them.
* `exchange`: collective ops (`CollectiveReduceV2`, `CollectiveGatherV2`, ...,
  NCCL) from the moment this process reaches them until they finish, so a
  collective that waits for a late peer counts its wait here.
* `update`: ops under the optimizer's name scope (Keras and tfdist apply the
  update inside `name_scope(optimizer.name)`).
* `compute`: every other op of the step (forward, backward, loss, metrics,
  tfdist's bucket packing).

`split` then walks each step's window `[start, next start)` and gives every
instant to the first phase active in the order compute, update, exchange,
input; an instant with none is `other` (Python, Keras's callbacks, function
dispatch, the gap between host calls). So an exchange running beside backprop
costs nothing (it is hidden), and the phases sum to the window exactly.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

PHASES = ("input", "compute", "exchange", "update", "other")
# The order an instant is given in when several phases are active at once.
PRIORITY = ("compute", "update", "exchange", "input")

_INPUT_EVENT = re.compile(r"^Iterator\w*Op::DoCompute$|^GetNextFromShard\d*$")
_INPUT_OP = re.compile(r"^(Iterator|MultiDeviceIterator|AnonymousIterator)\w*$")
_EXCHANGE_OP = re.compile(r"^(Collective|Nccl)\w*$")
# Ops the step runs that are none of its work: the executor's bookkeeping of a function call.
_NOT_WORK = {"_Send", "_Recv", "_HostSend", "_HostRecv", "NoOp", "Placeholder", "_Arg", "_Retval"}


@dataclasses.dataclass(frozen=True)
class Interval:
    """One recorded op or wait: `[start_ns, end_ns)` on this process's wall clock (`time.time_ns`)."""

    start_ns: int
    end_ns: int
    phase: str
    name: str


def _op_type(name: str, display: str) -> str | None:
    """The op type of a TensorFlow op event (`"scope/op:Type"`), or None for any other event."""
    if not display or "::" in name or not name.endswith(":" + display):
        return None
    return display


def _is_update(name: str, scopes: Sequence[str]) -> bool:
    segments = name.split(":", 1)[0].split("/")
    for segment in segments:
        for scope in scopes:
            if segment == scope or (segment.startswith(scope + "_") and segment[len(scope) + 1:].isdigit()):
                return True
    return False


def classify(name: str, display: str, update_scopes: Sequence[str] = ()) -> str | None:
    """The phase of one host event (`name`, and its `display` name: the op type of an op), or None.

    Example:

    ```python
    classify("cond/sgd/update_0/AssignSubVariableOp:AssignSubVariableOp", "AssignSubVariableOp", ["sgd"])
    # 'update'
    ```
    """
    if _INPUT_EVENT.match(name):
        return "input"
    op = _op_type(name, display)
    if op is None or op in _NOT_WORK:
        return None
    if _EXCHANGE_OP.match(op):
        return "exchange"
    if _INPUT_OP.match(op) or op.startswith("Optional"):
        return "input"
    if _is_update(name, update_scopes):
        return "update"
    return "compute"


def _classify_kernel(name: str, tf_op: str, update_scopes: Sequence[str]) -> str:
    """The phase of a kernel on a device stream (GPU, TPU), by the op that launched it or its name."""
    lower = name.lower()
    if "nccl" in lower:
        return "exchange"
    if "memcpyhtod" in lower.replace(" ", "") or "memcpy h2d" in lower:
        return "input"
    if tf_op:
        display = tf_op.rsplit(":", 1)[-1]
        phase = classify(tf_op, display, update_scopes)
        if phase is not None:
            return phase
    return "compute"


def intervals(space, update_scopes: Sequence[str] = ()) -> list[Interval]:
    """Every event of a profile (`tfdist._compat.tf.read_xspace`) that belongs to a phase, as `Interval`s.

    Args:
        space: an `XSpace` message.
        update_scopes: name scopes of the optimizer's update (its `name`, and
            an inner optimizer's for a `LossScaleOptimizer`).
    """
    out: list[Interval] = []
    # TensorFlow writes line timestamps relative to the profile's start (normalised at export); the
    # "Task Environment" plane keeps that start on the wall clock.
    start_ns = 0
    for plane in space.planes:
        for stat in plane.stats:
            if plane.stat_metadata[stat.metadata_id].name == "profile_start_time":
                start_ns = stat.uint64_value or stat.int64_value
    for plane in space.planes:
        events = plane.event_metadata
        on_device = plane.name.startswith("/device:")
        tf_op_stat = next((k for k, m in plane.stat_metadata.items() if m.name == "tf_op"), None)
        for line in plane.lines:
            if on_device and not line.name.lower().startswith("stream"):
                continue  # derived lines ("XLA Ops", "Steps") repeat the streams' kernels
            # Already on the wall clock (a later TensorFlow that does not normalise) or relative to the start.
            # tf.data's threads run the input pipeline's own ops (a map function, a py_function's
            # sleep) ahead of the step: only the consumer's wait (`...Op::DoCompute`) is the step's.
            pipeline = line.name.startswith("tf_data")
            base_ps = (line.timestamp_ns + (start_ns if line.timestamp_ns < 10**15 else 0)) * 1000
            for event in line.events:
                meta = events[event.metadata_id]
                if on_device:
                    tf_op = ""
                    for stat in list(event.stats) + list(meta.stats):
                        if stat.metadata_id == tf_op_stat:
                            tf_op = stat.str_value or plane.stat_metadata[stat.ref_value].name
                    phase = _classify_kernel(meta.name, tf_op, update_scopes)
                else:
                    phase = classify(meta.name, meta.display_name, update_scopes)
                    if pipeline and not _INPUT_EVENT.match(meta.name):
                        phase = None
                if phase is None or event.duration_ps <= 0:
                    continue
                start = (base_ps + event.offset_ps) // 1000
                out.append(Interval(start, start + event.duration_ps // 1000, phase, meta.name))
    out.sort(key=lambda i: (i.start_ns, i.end_ns))
    return out


def split(events: Sequence[Interval], windows: Sequence[tuple[int, int]]) -> list[dict]:
    """Each window's nanoseconds per phase, and its runs of one phase.

    Args:
        events: `Interval`s sorted by start (`intervals`).
        windows: `(start_ns, end_ns)` per step or host call, in order, not overlapping.

    Returns:
        One dict per window: `{"phases": {phase: ns}, "runs": [(start_ns, end_ns, phase), ...]}`;
        the phases sum to the window's length.
    """
    results = []
    first = 0
    for w_start, w_end in windows:
        # Every event before `first` ended before this window (windows come in order).
        while first < len(events) and events[first].end_ns <= w_start:
            first += 1
        # Boundaries where the set of active phases changes, within the window.
        changes: list[tuple[int, int, str]] = []
        # Events are sorted by start; one that started before the window may still be running.
        for event in events[first:]:
            if event.start_ns >= w_end:
                break
            start, end = max(event.start_ns, w_start), min(event.end_ns, w_end)
            if end > start:
                changes.append((start, 1, event.phase))
                changes.append((end, -1, event.phase))
        changes.sort()
        active = dict.fromkeys(PRIORITY, 0)
        totals = dict.fromkeys(PHASES, 0)
        runs: list[tuple[int, int, str]] = []
        cursor = w_start
        for at, delta, phase in changes + [(w_end, 0, "")]:
            if at > cursor:
                current = next((p for p in PRIORITY if active[p] > 0), "other")
                totals[current] += at - cursor
                if runs and runs[-1][2] == current and runs[-1][1] == cursor:
                    runs[-1] = (runs[-1][0], at, current)
                else:
                    runs.append((cursor, at, current))
                cursor = at
            if phase:
                active[phase] += delta
        results.append({"phases": totals, "runs": runs})
    return results


def collectives(events: Iterable[Interval]) -> list[Interval]:
    """The exchange intervals that are collective ops (not a kernel's pieces), in order of arrival."""
    return sorted(
        (e for e in events if e.phase == "exchange" and _EXCHANGE_OP.match(e.name.rsplit(":", 1)[-1])),
        key=lambda e: e.start_ns,
    )

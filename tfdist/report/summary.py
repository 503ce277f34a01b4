"""The step report: a recorder's calls and phases turned into the numbers a reader asks for, and a table."""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from typing import Optional

import keras
import tensorflow as tf

from tfdist.report import flops as flops_lib
from tfdist.report.recorder import StepRecorder
from tfdist.report.trace import PHASES

FLOPS_METHOD = ("TensorFlow profiler float_ops (tf.compat.v1.profiler, float_operation) on the traced "
                "forward and backward pass of one batch, Einsum added")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _step_seconds(recorder: StepRecorder, calls) -> list[tuple[float, object]]:
    """Seconds per step of each call: start to the next call's start within an epoch, else end + the median gap."""
    gap = recorder.median_gap_ns()
    following = {c.index: n for c, n in zip(recorder.calls, recorder.calls[1:])}
    out = []
    for call in calls:
        nxt = following.get(call.index)
        if nxt is not None and nxt.epoch == call.epoch:
            span = nxt.start_ns - call.start_ns
        else:
            span = call.end_ns - call.start_ns + gap
        out.append((span / 1e9 / call.steps, call))
    return out


def _strategy_facts(model) -> dict:
    """The strategy's name, the job's replicas and this process's devices (`extended.worker_devices`)."""
    strategy = model.distribute_strategy
    try:
        devices = list(strategy.extended.worker_devices)
    except (RuntimeError, AttributeError):  # the default strategy (plain Keras) has none
        devices = []
    if not devices:
        gpus = tf.config.list_logical_devices("GPU")
        devices = [gpus[0].name if gpus else "/device:CPU:0"]
    name = getattr(strategy, "name", None)
    if not isinstance(name, str):
        default = type(strategy).__name__ == "_DefaultDistributionStrategy"
        name = "none (plain Keras)" if default else type(strategy).__name__
    return {"strategy": name, "replicas": strategy.num_replicas_in_sync, "devices": devices}


def _compute_dtype(model) -> str:
    policy = getattr(model, "dtype_policy", None)
    dtype = getattr(policy, "compute_dtype", None) or keras.config.floatx()
    return str(dtype)


def summarize(recorder: StepRecorder, calls=None, batch_size: Optional[int] = None,
              flops_cache: Optional[dict] = None) -> dict:
    """The report of `calls` (default: every call `recorder` timed) as a dict (see `StepReport.result`).

    Args:
        recorder: the `StepRecorder` that ran.
        calls: the `Call`s to report on (a period of `StepReport(every=...)`).
        batch_size: the global batch, where Keras's `loss` metric does not count examples.
        flops_cache: a dict kept between reports of one fit (the FLOPs are traced once).
    """
    began = time.perf_counter()
    model = recorder.model
    calls = list(recorder.calls if calls is None else calls)
    facts = _strategy_facts(model)
    local_replicas = min(recorder.local_replicas if recorder.count_parts else len(facts["devices"]),
                         facts["replicas"])
    measured = [c for c in calls if not c.warmup and not c.profiled]
    note = None
    if not measured:
        measured = [c for c in calls if not c.warmup] or calls
        note = "every timed call was profiled or warming up: the step times include the profiler's cost"
    per_step = _step_seconds(recorder, measured)
    steps = [s for s, _ in per_step]
    result: dict = {"task": recorder.task, **facts, "local_replicas": local_replicas,
                    "workers": recorder.workers, "steps_timed": sum(c.steps for c in measured)}
    if not steps:
        return {**result, "samples_per_s": None, "step_s": None, "phases_s": None, "note": "no step was run"}
    median = statistics.median(steps)
    result["step_s"] = {"median": median, "p90": _percentile(steps, 0.9), "mean": statistics.fmean(steps)}
    # Measured on every task, profiled or not: the host's time between one call's end and the next's start.
    result["between_calls_s"] = statistics.median(
        s - (c.end_ns - c.start_ns) / 1e9 / c.steps for s, c in per_step)

    # Examples: this process's replicas' rows per step (Keras's loss metric), scaled to the job's replicas.
    counted = [c.samples / c.steps for c in measured if c.samples is not None]
    if counted:
        samples_per_step = statistics.median(counted) * facts["replicas"] / local_replicas
        source = "Keras's loss metric's count"
    elif batch_size:
        samples_per_step, source = float(batch_size), "StepReport(batch_size=...)"
    else:
        samples_per_step, source = None, None
    result["samples_per_step"] = samples_per_step
    result["samples_source"] = source
    total_seconds = sum(s * c.steps for s, c in per_step)
    total_samples = (sum(c.samples for c in measured) * facts["replicas"] / local_replicas
                     if counted and len(counted) == len(measured) else
                     (samples_per_step * sum(c.steps for c in measured) if samples_per_step else None))
    result["samples_per_s"] = total_samples / total_seconds if total_samples else None

    # Phases: the profiled calls' fractions of their windows, applied to the median step.
    indices = {c.index for c in calls}
    windows = [w for w in recorder.windows if w["call"] in indices]
    if windows:
        span = sum(w["end_ns"] - w["start_ns"] for w in windows)
        by_call = {c.index: c for c in recorder.calls}
        profiled_steps = sum(by_call[w["call"]].steps for w in windows)
        fractions = {p: sum(w["phases"][p] for w in windows) / span for p in PHASES}
        result["phases_s"] = {p: median * fractions[p] for p in PHASES}
        result["phase_fractions"] = fractions
        result["profiled_steps"] = profiled_steps
        result["profiled_step_s"] = span / 1e9 / profiled_steps
        if recorder.mode == "profiler":
            result["phases_method"] = ("TensorFlow profiler trace of the profiled steps, each instant given to "
                                       "compute, update, exchange, input (first active), else other; fractions "
                                       "applied to the median unprofiled step")
        else:
            ablation = recorder.ablation or {}
            result["phases_method"] = (
                "timed ablations (a task of a multi-process job, where TensorFlow's profiler is not safe): compute "
                "and update as timed alone, the rest of each host call exchange (waiting for peers, and any input "
                "wait, included), the time between calls other")
            result["ablation_s"] = {k: ablation.get(k) for k in ("compute", "update", "exchange_alone")}
            if ablation.get("exchange_alone") is not None:
                result["exchange_wait_s"] = max(result["phases_s"]["exchange"] - ablation["exchange_alone"], 0.0)
    else:
        result["phases_s"] = None
        result["phases_method"] = recorder.profile_error or "no step was profiled (too few steps)"

    # FLOPs and MFU.
    cache = flops_cache if flops_cache is not None else {}
    local_batch = None if samples_per_step is None else samples_per_step * local_replicas / facts["replicas"]
    key = ("flops", None if local_batch is None else round(local_batch))
    if key not in cache:
        try:
            cache[key] = (None if local_batch is None else
                          flops_lib.training_flops(model, round(local_batch), recorder.element_spec), None)
        except Exception as error:  # a model whose graph cannot be traced outside the step
            cache[key] = (None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    local_flops, flops_error = cache[key]
    result["flops_per_step"] = None if local_flops is None else local_flops * facts["replicas"] / local_replicas
    result["flops_method"] = FLOPS_METHOD if local_flops is not None else (flops_error or "input shapes unknown")
    dtype = _compute_dtype(model)
    if "peak" not in cache:
        cache["peak"] = flops_lib.device_peak(facts["devices"][0], dtype)
    peak, peak_label = cache["peak"]
    result["peak_flops_per_s"] = peak
    result["peak"] = f"{peak_label} (per device)"
    if local_flops is not None:
        achieved = local_flops / median
        result["achieved_flops_per_s"] = achieved * facts["replicas"] / local_replicas
        result["mfu"] = achieved / (peak * local_replicas)
    else:
        result["achieved_flops_per_s"] = result["mfu"] = None

    # Memory: TensorFlow's allocator peak per local device (GPU/TPU); the process's peak RSS beside it.
    from tfdist.memory import measured_peak

    result["peak_memory_bytes"] = {d: measured_peak(_local_name(d)) for d in facts["devices"]}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["host_peak_rss_bytes"] = rss * (1 if sys.platform == "darwin" else 1024)
    if note:
        result["note"] = note
    recorder.cost_s += time.perf_counter() - began
    result["report_cost_s"] = recorder.cost_s
    return result


def _local_name(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(job=None, replica=None, task=None).to_string()


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def format_table(result: dict, title: str = "Step report") -> str:
    """The report as the table `StepReport` prints."""
    who = result.get("task") or "this process"
    lines = [f"{title} — {who}: {result.get('strategy')}, {result.get('replicas')} replica(s) "
             f"({result.get('local_replicas')} here), {result.get('steps_timed')} steps timed"]
    if result.get("samples_per_s"):
        lines.append(f"  samples/s      {result['samples_per_s']:>12,.0f}   (whole job)")
    step = result.get("step_s")
    if step:
        lines.append(f"  step           {1e3 * step['median']:>9.2f} ms   median; p90 {1e3 * step['p90']:.2f} ms")
    phases = result.get("phases_s")
    if phases:
        for p in PHASES:
            share = phases[p] / step["median"] if step and step["median"] else 0.0
            lines.append(f"    {p:<12} {1e3 * phases[p]:>9.2f} ms   {100 * share:5.1f}%")
        how = ("profiled" if str(result.get("phases_method", "")).startswith("TensorFlow profiler")
               else "split by timed ablations:")
        lines.append(f"    ({how} {result['profiled_steps']} steps at {1e3 * result['profiled_step_s']:.2f} ms)")
        if result.get("ablation_s"):
            alone = result["ablation_s"]
            shown = ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.2f} ms" for k, v in alone.items() if v is not None)
            lines.append(f"    (timed alone: {shown}; the exchange's wait for peers "
                         f"{1e3 * (result.get('exchange_wait_s') or 0.0):.2f} ms)")
    else:
        lines.append(f"    phases: {result.get('phases_method')}")
    if step:
        lines.append(f"  between calls  {1e3 * result['between_calls_s']:>9.2f} ms   per step (Python, Keras callbacks: "
                     "measured on every task)")
    if result.get("flops_per_step"):
        lines.append(f"  FLOPs/step     {_si(result['flops_per_step'], 'FLOP'):>12}   (all replicas)")
        lines.append(f"  MFU            {100 * result['mfu']:>11.1f}%   of {result['peak']}")
    else:
        lines.append(f"  FLOPs/step     unknown: {result.get('flops_method')}")
    memory = result.get("peak_memory_bytes") or {}
    shown = [f"{d}: {_si(b, 'B')}" for d, b in memory.items() if b is not None]
    lines.append("  peak memory    " + (", ".join(shown) if shown else
                                       f"not reported by TensorFlow for {', '.join(memory) or 'these devices'}; "
                                       f"process peak RSS {_si(result['host_peak_rss_bytes'], 'B')}"))
    if result.get("note"):
        lines.append(f"  note: {result['note']}")
    return "\n".join(lines)

"""Keras callbacks of tfdist: `StepReport`, where a training step's time goes."""

from __future__ import annotations

import json
import os
from typing import Optional

import keras

from tfdist.report import recorder as recorder_lib
from tfdist.report import summary


def _path_for_task(path: str, task: Optional[str], index: int) -> str:
    """`path` for the chief (or one process); `<stem>.<job>-<i><ext>` for the other tasks; `{task}` is replaced."""
    name = (task or "worker:0").replace(":", "-")
    if "{task}" in path:
        return path.replace("{task}", name)
    if task is None or index == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{name}{ext}"


class StepReport(keras.callbacks.Callback):
    """A Keras callback that reports where the training step's time goes, per worker.

    Works in `fit` under any tfdist strategy and for plain Keras (where the
    exchange is zero). It times every host call of the train function, has
    TensorFlow's profiler record a few steps after the first calls (which
    trace), and splits them into phases: `input` (waiting for the next
    batch), `compute` (forward and backward), `exchange` (gradient
    communication not hidden behind compute, a late peer's wait included),
    `update` (the optimizer) and `other` (Python, Keras, dispatch). It counts
    the model's training FLOPs from the traced forward-backward graph and
    gives the model FLOPs utilisation against the device's peak (a vendor
    table for GPUs and TPUs, a measured matmul on CPUs; named in the report).
    How each number is measured, and what the report costs: docs/performance.md.

    At the end of `fit` (and every `every` steps) each worker prints a table
    and, with `path`, writes the report as JSON: the chief (or the only
    process) to `path`, the others to `<stem>.worker-<i><ext>` (or wherever
    `{task}` in `path` says).

    After `fit`, `result` is a dict: `samples_per_s` (the whole job's),
    `step_s` (`median`, `p90`, `mean`), `phases_s` (the median step split into
    `input`, `compute`, `exchange`, `update`, `other`; they sum to
    `step_s["median"]`), `flops_per_step` (all replicas), `mfu`, `peak` (the
    peak used, named), `replicas`, `peak_memory_bytes` (per local device; None
    where TensorFlow keeps no statistics: CPUs), and how each was measured.
    With `every`, `periods` lists the report of each period.

    Args:
        every: Optional int. Also report every this many steps (each period
            profiles its own first steps). Default None: at the end only.
        path: Optional str. Where to write the JSON report.
        batch_size: Optional int. The global batch size, for models whose
            train step does not update Keras's `loss` metric (which the report
            counts examples with). Default None.
        profile_steps: int. Host calls recorded by the profiler per report
            (default 5).
        warmup_steps: int. Host calls at the start that are neither timed nor
            profiled (the first traces the step). Default 2.
        verbose: int. 1 prints the table (default), 0 does not.

    Example:

    ```python
    report = tfdist.callbacks.StepReport(path="report.json")
    model.fit(dataset, epochs=2, callbacks=[report])
    report.result["phases_s"]["exchange"]   # seconds of the median step spent exchanging
    ```
    """

    def __init__(self, every: Optional[int] = None, path: Optional[str] = None, batch_size: Optional[int] = None,
                 profile_steps: int = recorder_lib.DEFAULT_PROFILE_CALLS,
                 warmup_steps: int = recorder_lib.DEFAULT_SKIP_CALLS, verbose: int = 1):
        super().__init__()
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"Argument 'every' must be None or an integer >= 1 (steps). Received: every={every!r}")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"Argument 'path' must be None or a file path. Received: path={path!r}")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"Argument 'batch_size' must be None or an integer >= 1. Received: batch_size={batch_size!r}")
        for name, value in (("profile_steps", profile_steps), ("warmup_steps", warmup_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Argument '{name}' must be an integer >= 0. Received: {name}={value!r}")
        self.every = every
        self.path = None if path is None else os.fspath(path)
        self.batch_size = batch_size
        self.profile_steps = profile_steps
        self.warmup_steps = warmup_steps
        self.verbose = verbose
        self.result: Optional[dict] = None
        self.periods: list[dict] = []
        self.recorder: Optional[recorder_lib.StepRecorder] = None
        self._restore = None
        self._flops: dict = {}
        self._period_start = 0
        self._steps_in_period = 0
        self._begin = 0
        self._fit_start = 0

    def on_train_begin(self, logs=None):
        model = self.model
        function = model.train_function
        existing = getattr(function, "tfdist_recorder", None)
        self.periods, self._period_start, self._fit_start, self._steps_in_period = [], 0, 0, 0
        if existing is not None:
            # `tfdist launch --timeline` already records this function: read its recorder.
            self.recorder = existing
            self._period_start = self._fit_start = len(existing.calls)
            return
        steps_per_call = getattr(model, "steps_per_execution", 1)
        steps_per_call = steps_per_call if isinstance(steps_per_call, int) and steps_per_call > 0 else 1
        period = None if self.every is None else max(self.every // steps_per_call, 1)
        self.recorder = recorder_lib.StepRecorder(model, skip_calls=self.warmup_steps,
                                                  profile_calls=self.profile_steps, period_calls=period)
        self._restore = function
        model.train_function = self.recorder.wrap(function)

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        steps = batch - self._begin + 1
        self.recorder.note_steps(steps)
        self._steps_in_period += steps
        if self.every is not None and self._steps_in_period >= self.every:
            self._report_period()

    def on_epoch_end(self, epoch, logs=None):
        self.recorder.note_epoch_end()

    def _report_period(self) -> None:
        self.recorder.finish()
        calls = self.recorder.calls[self._period_start:]
        if not calls:
            return
        report = summary.summarize(self.recorder, calls, self.batch_size, self._flops)
        report["first_step_call"] = calls[0].index
        self.periods.append(report)
        if self.verbose:
            print(summary.format_table(report, title=f"Step report, steps of period {len(self.periods)}"),
                  flush=True)
        self._period_start = len(self.recorder.calls)
        self._steps_in_period = 0

    def on_train_end(self, logs=None):
        recorder = self.recorder
        if self._restore is not None:
            self.model.train_function = self._restore
            self._restore = None
        recorder.finish()
        self.result = summary.summarize(recorder, recorder.calls[self._fit_start:], self.batch_size, self._flops)
        if self.periods:
            self.result["periods"] = self.periods
        if self.verbose:
            print(summary.format_table(self.result), flush=True)
        if self.path:
            target = _path_for_task(self.path, recorder.task, recorder.worker_index)
            directory = os.path.dirname(os.path.abspath(target))
            os.makedirs(directory, exist_ok=True)
            with open(target, "w") as f:
                json.dump(self.result, f, indent=2, default=str)

"""`train_and_evaluate`: one script, every TF_CONFIG role (chief, worker, ps, evaluator, local)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import tensorflow as tf

from tfdist.estimator.estimator import Estimator, checkpoint_global_step, logger
from tfdist.estimator.exporter import Exporter
from tfdist.estimator.run_config import resolve_strategy

# The chief waits this long (seconds) for a live evaluator to finish the final
# evaluation, so that `tfdist launch` (which stops the evaluator when training
# ends) does not cut it off. Environment override TFDIST_FINAL_EVAL_WAIT_SECS.
FINAL_EVAL_WAIT_SECS = 120.0
# An evaluator whose heartbeat file is older than this is taken as gone.
HEARTBEAT_STALE_SECS = 30.0
TRAINING_DONE_FILE = "training_done.json"
EVALUATED_FILE = "evaluated.json"
HEARTBEAT_FILE = "evaluator_heartbeat"


class TrainSpec(NamedTuple):
    """What `train_and_evaluate` trains on and for how long.

    Args:
        input_fn: the training `input_fn` (see `Estimator.train`).
        max_steps: Optional int. Train until this global step; `None` trains
            until the data ends. Default `None`.
        hooks: not supported; must be empty. Default `()`.

    Example:

    ```python
    train_spec = TrainSpec(train_input_fn, max_steps=1000)
    ```
    """

    input_fn: Callable
    max_steps: int | None = None
    hooks: Sequence = ()


class EvalSpec(NamedTuple):
    """How `train_and_evaluate` evaluates, and when.

    Args:
        input_fn: the evaluation `input_fn`.
        steps: Optional int. Batches per evaluation; `None` evaluates until the
            data ends. Default 100 (TF1's).
        name: Optional str. Evaluation name (results in `model_dir/eval_<name>`).
        hooks: not supported; must be empty. Default `()`.
        exporters: Optional `Exporter` or list of them, run after each
            evaluation. Default `None`.
        start_delay_secs: int. The evaluator waits this long before its first
            evaluation. Default 0 (TF1: 120).
        throttle_secs: int. At least this many seconds between two
            evaluations (a newer checkpoint is evaluated only after it);
            the final checkpoint is always evaluated. Default 600.

    Example:

    ```python
    eval_spec = EvalSpec(eval_input_fn, steps=None, throttle_secs=30,
                         exporters=[FinalExporter("digits", serving_input_receiver_fn)])
    ```
    """

    input_fn: Callable
    steps: int | None = 100
    name: str | None = None
    hooks: Sequence = ()
    exporters: Any = None
    start_delay_secs: int = 0
    throttle_secs: int = 600


def _exporters(eval_spec: EvalSpec) -> list[Exporter]:
    exporters = eval_spec.exporters
    if exporters is None:
        return []
    if isinstance(exporters, Exporter):
        return [exporters]
    exporters = list(exporters)
    for e in exporters:
        if not isinstance(e, Exporter):
            raise TypeError(f"EvalSpec exporters must be tfdist.estimator exporters (FinalExporter, "
                            f"LatestExporter). Received: {type(e).__name__}")
    names = [e.name for e in exporters]
    if len(set(names)) != len(names):
        raise ValueError(f"EvalSpec exporters need distinct names. Received: {names}")
    return exporters


def _check(estimator, train_spec, eval_spec) -> None:
    if not isinstance(estimator, Estimator):
        raise TypeError(f"train_and_evaluate needs a tfdist.estimator.Estimator. Received: {type(estimator).__name__}")
    if not isinstance(train_spec, TrainSpec):
        raise TypeError(f"train_and_evaluate needs a TrainSpec. Received: {type(train_spec).__name__}")
    if not isinstance(eval_spec, EvalSpec):
        raise TypeError(f"train_and_evaluate needs an EvalSpec. Received: {type(eval_spec).__name__}")
    if train_spec.hooks or eval_spec.hooks:
        raise ValueError("TrainSpec/EvalSpec hooks are not supported (TF1 SessionRunHooks need a Session).")


class _Evaluation:
    """Evaluates a checkpoint, runs the exporters and records the result."""

    def __init__(self, estimator: Estimator, eval_spec: EvalSpec):
        self.estimator = estimator
        self.spec = eval_spec
        self.exporters = _exporters(eval_spec)
        self.last_result: dict | None = None
        self.last_path: str | None = None
        self.exported: set[tuple[str, str]] = set()
        self.export_results: list[str] = []

    def __call__(self, checkpoint_path: str, final: bool) -> dict:
        if checkpoint_path == self.last_path and self.last_result is not None:
            result = self.last_result  # already evaluated: only the final exports remain
        else:
            result = self.estimator.evaluate(self.spec.input_fn, steps=self.spec.steps,
                                             checkpoint_path=checkpoint_path, name=self.spec.name)
        self.last_path = checkpoint_path
        for exporter in self.exporters:
            if (exporter.name, checkpoint_path) in self.exported:
                continue  # the final call for a checkpoint already evaluated and exported
            base = os.path.join(self.estimator.model_dir, "export", exporter.name)
            path = exporter.export(self.estimator, base, checkpoint_path, result, final)
            if path:
                self.exported.add((exporter.name, checkpoint_path))
                self.export_results.append(path)
                logger.info("Exported %s: %s", exporter.name, path)
        self.last_result = result
        eval_dir = self.estimator.eval_dir(self.spec.name)
        os.makedirs(eval_dir, exist_ok=True)
        _write_json(os.path.join(eval_dir, EVALUATED_FILE),
                    {"global_step": result["global_step"], "checkpoint": checkpoint_path})
        return result


def _write_json(path: str, data: dict) -> None:
    temp = f"{path}.tmp{os.getpid()}"
    with open(temp, "w") as f:
        json.dump(data, f)
    os.replace(temp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def train_and_evaluate(estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec):
    """Trains and evaluates as this process's TF_CONFIG role says.

    * no TF_CONFIG (local): trains, evaluating after a checkpoint is saved when
      `throttle_secs` have passed since the last evaluation, and once more at
      the end;
    * `chief` and `worker`: train with `RunConfig.train_distribute` (the chief
      writes checkpoints and summaries); the chief then waits up to
      `FINAL_EVAL_WAIT_SECS` for a running evaluator to finish the final one;
    * `ps`: serves variables until the job is stopped (a parameter-server
      strategy blocks here; otherwise a `tf.distribute.Server` is started);
    * `evaluator`: evaluates each new checkpoint in `model_dir` (at most once
      per `throttle_secs`) and runs the exporters, and exits after the final
      checkpoint (global step `max_steps`, or the last one the chief wrote).

    Args:
        estimator: the `Estimator`.
        train_spec: a `TrainSpec`.
        eval_spec: an `EvalSpec`.

    Returns:
        `(eval_result, export_results)`: the last evaluation's dict (`None` on
        roles that do not evaluate) and the list of exported paths.

    Example:

    ```python
    train_and_evaluate(estimator, TrainSpec(train_input_fn, max_steps=1000),
                       EvalSpec(eval_input_fn, steps=None, throttle_secs=30))
    ```
    """
    _check(estimator, train_spec, eval_spec)
    role = estimator.config.task_type
    if role is None:
        return _run_local(estimator, train_spec, eval_spec)
    if role in ("chief", "worker", "master"):
        return _run_trainer(estimator, train_spec)
    if role == "ps":
        return _run_ps(estimator)
    if role == "evaluator":
        return _run_evaluator(estimator, train_spec, eval_spec)
    raise ValueError(f"TF_CONFIG task type must be one of 'chief', 'worker', 'ps', 'evaluator'. "
                     f"Received: {role!r}")


def _run_local(estimator, train_spec, eval_spec):
    evaluation = _Evaluation(estimator, eval_spec)
    last_eval = [time.monotonic()]

    def after_save(step, path):
        if time.monotonic() - last_eval[0] >= eval_spec.throttle_secs:
            evaluation(path, final=False)
            last_eval[0] = time.monotonic()

    estimator.train(train_spec.input_fn, max_steps=train_spec.max_steps, saving_listeners=[after_save])
    final = estimator.latest_checkpoint()
    evaluation(final, final=True)
    return evaluation.last_result, evaluation.export_results


def _run_trainer(estimator, train_spec):
    model_dir = estimator.model_dir
    chief = estimator.config.is_chief
    if chief:
        try:
            os.remove(os.path.join(model_dir, TRAINING_DONE_FILE))
        except FileNotFoundError:
            pass
    estimator.train(train_spec.input_fn, max_steps=train_spec.max_steps)
    if not chief:
        return None, []
    final = estimator.latest_checkpoint()
    step = checkpoint_global_step(final)
    _write_json(os.path.join(model_dir, TRAINING_DONE_FILE), {"global_step": step, "checkpoint": final})
    _wait_for_final_evaluation(estimator, step)
    return None, []


def _wait_for_final_evaluation(estimator, step: int) -> None:
    wait = float(os.environ.get("TFDIST_FINAL_EVAL_WAIT_SECS", FINAL_EVAL_WAIT_SECS))
    deadline = time.monotonic() + wait
    announced = False
    while time.monotonic() < deadline:
        beats = [os.path.join(root, HEARTBEAT_FILE) for root, _, files in os.walk(estimator.model_dir)
                 if HEARTBEAT_FILE in files]
        live = [b for b in beats if time.time() - os.path.getmtime(b) < HEARTBEAT_STALE_SECS]
        if not live:
            return
        done = [_read_json(os.path.join(os.path.dirname(b), EVALUATED_FILE)) for b in live]
        if all(d and d.get("global_step", -1) >= step for d in done):
            logger.info("The evaluator has evaluated the final checkpoint (global step %d).", step)
            return
        if not announced:
            logger.info("Waiting up to %.0f s for the evaluator to evaluate the final checkpoint "
                        "(global step %d).", wait, step)
            announced = True
        time.sleep(0.5)
    logger.warning("The evaluator did not evaluate the final checkpoint within %.0f s.", wait)


def _run_ps(estimator):
    config = estimator.config
    strategy = resolve_strategy(config.train_distribute)  # a parameter-server strategy serves here
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return None, []
    server = tf.distribute.Server(tf.train.ClusterSpec(config.cluster), job_name="ps",
                                  task_index=config.task_id, protocol="grpc", start=True)
    logger.info("Parameter server ps:%d serving.", config.task_id)
    server.join()
    return None, []


def _run_evaluator(estimator, train_spec, eval_spec):
    evaluation = _Evaluation(estimator, eval_spec)
    eval_dir = estimator.eval_dir(eval_spec.name)
    os.makedirs(eval_dir, exist_ok=True)
    heartbeat = os.path.join(eval_dir, HEARTBEAT_FILE)

    stop = threading.Event()

    def beat():
        # A thread, so that a long evaluation still shows the evaluator alive.
        while not stop.is_set():
            with open(heartbeat, "w") as f:
                f.write(str(os.getpid()))
            stop.wait(HEARTBEAT_STALE_SECS / 6)

    threading.Thread(target=beat, daemon=True).start()
    if eval_spec.start_delay_secs:
        time.sleep(eval_spec.start_delay_secs)
    last_path, last_time = None, -float("inf")
    try:
        while True:
            path = estimator.latest_checkpoint()
            done = _read_json(os.path.join(estimator.model_dir, TRAINING_DONE_FILE))
            if path is not None and path != last_path:
                step = checkpoint_global_step(path)
                final = (train_spec.max_steps is not None and step >= train_spec.max_steps) or (
                    done is not None and step >= done.get("global_step", float("inf")))
                if final or time.monotonic() - last_time >= eval_spec.throttle_secs:
                    evaluation(path, final=final)
                    last_path, last_time = path, time.monotonic()
                    if final:
                        logger.info("Evaluated the final checkpoint (global step %d); evaluator exits.", step)
                        return evaluation.last_result, evaluation.export_results
            time.sleep(0.5)
    finally:
        stop.set()
        try:
            os.remove(heartbeat)
        except FileNotFoundError:
            pass

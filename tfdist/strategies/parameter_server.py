"""Asynchronous parameter-server training: variables on ps tasks, steps scheduled on workers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import zipfile
from typing import Any

import tensorflow as tf

from tfdist import keras_integration
from tfdist import options as options_lib
from tfdist.strategies.base import TfdistStrategy

_PARTITIONER_SPEC = re.compile(r"^(num_shards|max_shard_bytes|min_shard_bytes):([1-9][0-9]*)$")


def _partitioner_ok(value: Any) -> bool:
    if isinstance(value, str):
        return bool(_PARTITIONER_SPEC.match(value))
    return callable(value)


VARIABLE_PARTITIONER = options_lib.Option(
    name="variable_partitioner",
    default=None,
    types=(str, tf.distribute.experimental.partitioners.Partitioner),
    expected=(
        "'num_shards:N' (every variable in N shards), 'max_shard_bytes:B' (shards of at most "
        "B bytes), 'min_shard_bytes:B' (shards of at least B bytes), or a "
        "tf.distribute.experimental.partitioners.Partitioner"
    ),
    doc=(
        "How variables are split along their first axis across ps tasks; size-based specs use at "
        "most one shard per ps task. Default: no partitioning."
    ),
    check=_partitioner_ok,
)

CLUSTER_RESOLVER = options_lib.Option(
    name="cluster_resolver",
    default=None,
    types=(tf.distribute.cluster_resolver.ClusterResolver,),
    expected="a tf.distribute.cluster_resolver.ClusterResolver",
    doc="Where the cluster comes from; default: TF_CONFIG.",
)

JOIN = options_lib.Option(
    name="join",
    default=True,
    types=(bool,),
    expected="True or False",
    doc=(
        "On worker and ps tasks, serve until the job ends and then exit the process (default); "
        "False returns a serving handle instead, for scripts that manage the server themselves."
    ),
)


def _cluster_error(message: str) -> ValueError:
    """`tfdist.cluster.ClusterConfigError` when that module exists, else `ValueError`."""
    try:
        from tfdist.cluster import ClusterConfigError
    except ImportError:
        return ValueError(message)
    return ClusterConfigError(message)


def _resolve_cluster(cluster_resolver) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The cluster, validated for parameter-server training before any server starts."""
    if cluster_resolver is None:
        raw = os.environ.get("TF_CONFIG", "")
        if not raw.strip():
            raise _cluster_error(
                "Strategy 'parameter_server' needs a cluster with a chief, workers and ps tasks. "
                "Set TF_CONFIG in every process (tfdist launch --chief --workers 2 --ps 1 -- "
                "python train.py does it for a local job) or pass cluster_resolver=. "
                "Received: TF_CONFIG unset"
            )
        try:
            from tfdist.cluster import parse_tf_config
        except ImportError:
            try:
                json.loads(raw)
            except ValueError as e:
                raise _cluster_error(f"TF_CONFIG is not valid JSON: {e}. Received: TF_CONFIG={raw!r}") from None
        else:
            parse_tf_config(raw)  # One place validates TF_CONFIG's shape; it raises ClusterConfigError.
        cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    jobs = cluster_resolver.cluster_spec().as_dict()
    received = f"Received: cluster jobs {sorted(jobs)}"
    if not jobs.get("ps"):
        raise _cluster_error(
            "Strategy 'parameter_server' needs a 'ps' job with at least one task to hold the "
            f"variables. {received}. Add ps tasks to TF_CONFIG's cluster "
            "(tfdist launch --ps 1 ...), or use strategy 'multi_worker' for synchronous "
            "training without parameter servers."
        )
    if not jobs.get("worker"):
        raise _cluster_error(
            "Strategy 'parameter_server' needs a 'worker' job with at least one task to run the "
            f"training steps. {received}. Add worker tasks to TF_CONFIG's cluster (tfdist launch --workers 2 ...)."
        )
    chief = jobs.get("chief")
    if not chief or len(chief) != 1:
        raise _cluster_error(
            "Strategy 'parameter_server' needs a 'chief' job with exactly one task: the "
            f"coordinator that builds the model and runs model.fit. {received}"
            + (f" with {len(chief)} chief tasks" if chief else "")
            + ". Add one chief to TF_CONFIG's cluster (tfdist launch --chief ...)."
        )
    task_type = cluster_resolver.task_type
    if task_type not in ("chief", "worker", "ps", "evaluator"):
        raise _cluster_error(
            "Strategy 'parameter_server' runs tasks of type 'chief', 'worker', 'ps' or "
            f"'evaluator'. Received: task type {task_type!r}"
        )
    return cluster_resolver


def _partitioner_from_spec(spec, num_ps: int):
    if spec is None or not isinstance(spec, str):
        return spec
    kind, value = _PARTITIONER_SPEC.match(spec).groups()
    partitioners = tf.distribute.experimental.partitioners
    if kind == "num_shards":
        return partitioners.FixedShardsPartitioner(int(value))
    if kind == "max_shard_bytes":
        return partitioners.MaxSizePartitioner(int(value), max_shards=num_ps)
    return partitioners.MinSizePartitioner(int(value), max_shards=num_ps)


class ServingTask:
    """A worker or ps task's running server, returned by `ParameterServerStrategy(join=False)`.

    Such a process serves the chief: it cannot build or fit models. `join()`
    serves until the job ends and exits the process.

    Attributes:
        task_type: str. `"worker"` or `"ps"`.
        task_id: int. The task's index.
        server: the running `tf.distribute.Server`.
    """

    def __init__(self, resolver, server):
        self.task_type = resolver.task_type
        self.task_id = resolver.task_id
        self.server = server
        self._chief = resolver.cluster_spec().as_dict()["chief"][0]

    def _not_here(self, what: str):
        return ValueError(
            f"{what} was called in the {self.task_type!r} task {self.task_id} of a parameter-server "
            "job. Only the chief builds, compiles and fits the model; worker and ps tasks serve it. "
            "Let tfdist.get_strategy('parameter_server') block on these tasks (join=True, the "
            "default), which runs the model code on the chief only."
        )

    def scope(self):
        raise self._not_here("strategy.scope()")

    def join(self) -> None:
        """Serves until the chief is gone (the job ended) or SIGTERM, then exits the process with 0."""
        serve_until_job_ends(self._chief)

    def __repr__(self) -> str:
        return f"<tfdist ServingTask {self.task_type}:{self.task_id} target={self.server.target!r}>"


class EvaluatorTask:
    """The sidecar evaluator of a parameter-server job, returned by `get_strategy` on that task.

    The evaluator is outside the training cluster (`tfdist launch --evaluator`
    starts one): it evaluates the checkpoints the chief writes, on its own
    data, while training goes on. Its `scope()` is the default (local) scope,
    so the script builds and compiles the same model as on the chief, then
    calls `evaluate_checkpoints` instead of `fit`.

    Attributes:
        task_type: str. `"evaluator"`.
        task_id: int. The task's index.

    Example:

    ```python
    strategy = tfdist.get_strategy("parameter_server")
    with strategy.scope():
        model = build_model()
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if strategy.task_type == "evaluator":
        strategy.evaluate_checkpoints(model, val_ds, "/ckpt/model.weights.h5")  # exits at job end
    model.fit(train_fn, epochs=10, steps_per_epoch=100,
              callbacks=[keras.callbacks.ModelCheckpoint("/ckpt/model.weights.h5", save_weights_only=True)])
    ```
    """

    def __init__(self, resolver):
        self.task_type = resolver.task_type
        self.task_id = resolver.task_id
        self._chief = resolver.cluster_spec().as_dict()["chief"][0]

    def scope(self):
        return tf.distribute.get_strategy().scope()

    def evaluate_checkpoints(
        self,
        model,
        data,
        checkpoint: str,
        steps: int | None = None,
        poll_seconds: float = 1.0,
        max_evaluations: int | None = None,
    ) -> list[dict]:
        """Evaluates `checkpoint` every time it changes, until the job ends.

        Args:
            model: a compiled Keras model with the chief's architecture.
            data: what `model.evaluate` takes as `x` (a dataset, or a tuple
                `(x, y)` of arrays).
            checkpoint: str. The weights file the chief's `ModelCheckpoint`
                writes (`.weights.h5`, `save_weights_only=True`) or a whole
                model file (`.keras`).
            steps: Optional int. Evaluation steps; default all of `data`.
            poll_seconds: float. How often to look for a new checkpoint.
            max_evaluations: Optional int. Return after this many evaluations
                instead of serving until the chief is gone (then the process
                exits with status 0, as worker and ps tasks do).

        Returns:
            The logs of each evaluation (when `max_evaluations` is reached).
        """
        x, y = data if isinstance(data, tuple) else (data, None)
        results, last, seen_chief = [], None, False
        while True:
            stamp = os.stat(checkpoint).st_mtime_ns if os.path.exists(checkpoint) else None
            if stamp is not None and stamp != last:
                try:
                    if checkpoint.endswith(".keras"):
                        import keras

                        model.set_weights(keras.models.load_model(checkpoint).get_weights())
                    else:
                        model.load_weights(checkpoint)
                except (OSError, ValueError, zipfile.BadZipFile):
                    # The chief is writing it (h5py holds a lock, a zip is incomplete): next poll.
                    time.sleep(poll_seconds)
                    continue
                last = stamp
                logs = model.evaluate(x, y, steps=steps, verbose=0, return_dict=True)
                print(
                    f"evaluator: {os.path.basename(checkpoint)} "
                    + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()),
                    flush=True,
                )
                results.append(logs)
                if max_evaluations is not None and len(results) >= max_evaluations:
                    return results
            if max_evaluations is None:
                if _chief_reachable(self._chief):
                    seen_chief = True
                elif seen_chief:
                    _exit_process()
            time.sleep(poll_seconds)

    def __repr__(self) -> str:
        return f"<tfdist EvaluatorTask evaluator:{self.task_id}>"


def _exit_process() -> None:
    """Exits with status 0 without interpreter shutdown, which a running TF server can hang."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _chief_reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def serve_until_job_ends(chief_address: str, poll_seconds: float = 0.5, gone_after: int = 4) -> None:
    """Blocks while the job runs; exits the process with status 0 when it ends.

    The job has ended when the chief, having been reachable, stops accepting
    connections for `gone_after` polls in a row, or when the process gets
    SIGTERM (what `tfdist launch` and Kubernetes send). A TensorFlow server
    cannot be stopped in-process, so the process exits.
    """

    def leave(*_):
        _exit_process()

    signal.signal(signal.SIGTERM, leave)
    seen, missing = False, 0
    while True:
        if _chief_reachable(chief_address):
            seen, missing = True, 0
        elif seen:
            missing += 1
            if missing >= gone_after:
                leave()
        time.sleep(poll_seconds)


class ParameterServerStrategy(TfdistStrategy, tf.distribute.experimental.ParameterServerStrategy):
    """Trains asynchronously: variables on ps tasks, steps scheduled on workers.

    One script serves every task of the job (from TF_CONFIG). On the chief,
    the strategy connects to the cluster and Keras `model.fit` schedules
    training steps on the workers with a `ClusterCoordinator`; each worker
    computes gradients on its own data and applies them to the variables on
    the ps tasks without waiting for the others. On worker and ps tasks,
    creating the strategy starts the task's server and blocks until the job
    ends, then exits the process, so only the chief runs the model code.

    Args:
        variable_partitioner: Optional. How variables are split across ps
            tasks along their first axis: `"num_shards:N"`,
            `"max_shard_bytes:B"`, `"min_shard_bytes:B"` (the size-based
            specs use at most one shard per ps task) or a
            `tf.distribute.experimental.partitioners.Partitioner`. Default
            `None`: every variable whole, placed round-robin on ps tasks.
        cluster_resolver: Optional `ClusterResolver`. Default: TF_CONFIG.
        join: bool. On worker and ps tasks, block and exit when the job ends
            (default `True`); `False` returns a `ServingTask` instead.
        **options: step options (see `tfdist.options.STEP_OPTIONS`).

    Example:

    ```python
    # the same script on every task; TF_CONFIG says which one this is
    strategy = tfdist.get_strategy("parameter_server", variable_partitioner="num_shards:2")
    with strategy.scope():          # chief only: other tasks never get here
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3, steps_per_epoch=100)
    ```
    """

    name = "parameter_server"
    PARAMS = {
        "variable_partitioner": VARIABLE_PARTITIONER,
        "cluster_resolver": CLUSTER_RESOLVER,
        "join": JOIN,
    }
    gradient_path = "parameter_server"

    def __new__(cls, variable_partitioner=None, cluster_resolver=None, join=True, **options):
        # Validate everything before a server starts or the process blocks.
        params, _ = options_lib.split_options(
            cls.name,
            cls.PARAMS,
            {"variable_partitioner": variable_partitioner, "cluster_resolver": cluster_resolver, "join": join, **options},
        )
        resolver = _resolve_cluster(params.get("cluster_resolver"))
        if resolver.task_type in ("worker", "ps"):
            server = tf.distribute.Server(
                resolver.cluster_spec(),
                job_name=resolver.task_type,
                task_index=resolver.task_id,
                protocol=resolver.rpc_layer or "grpc",
                start=True,
            )
            task = ServingTask(resolver, server)
            if params.get("join", True):
                task.join()
            return task
        if resolver.task_type == "evaluator":
            return EvaluatorTask(resolver)
        instance = super().__new__(cls)
        instance._tfdist_resolver = resolver
        return instance

    @classmethod
    def demo_kwargs(cls):
        # Needs a cluster of separate processes (`tfdist launch`); the local demo has none.
        return None

    def __init__(self, variable_partitioner=None, cluster_resolver=None, join=True, **options):
        params = self._tfdist_init(
            {
                "variable_partitioner": variable_partitioner,
                "cluster_resolver": cluster_resolver,
                "join": join,
                **options,
            }
        )
        resolver = self._tfdist_resolver
        num_ps = len(resolver.cluster_spec().as_dict()["ps"])
        partitioner = _partitioner_from_spec(params.get("variable_partitioner"), num_ps)
        super().__init__(resolver, variable_partitioner=partitioner)
        self._tfdist_params.pop("cluster_resolver", None)
        self._tfdist_params.pop("join", None)
        keras_integration.colocate_slots_with_shards(self)
        keras_integration.install_parameter_server_fit()
        # The coordinator is one per strategy; tf-keras's fit finds the same one.
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)
        from tfdist.engine import parameter_server  # noqa: F401  (registers the gradient path)

    @property
    def task_type(self) -> str:
        return self._tfdist_resolver.task_type

    @property
    def cluster(self) -> dict:
        """The cluster as a dict of job name to task addresses."""
        return self._tfdist_resolver.cluster_spec().as_dict()

    @property
    def num_workers(self) -> int:
        return len(self._tfdist_resolver.cluster_spec().as_dict()["worker"])

    @property
    def num_ps(self) -> int:
        return len(self._tfdist_resolver.cluster_spec().as_dict()["ps"])

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._tfdist_params.items() if v is not None)
        return (
            f"<tfdist {type(self).__name__} name={self.name!r} workers={self.num_workers} "
            f"ps={self.num_ps}{', ' + params if params else ''}>"
        )

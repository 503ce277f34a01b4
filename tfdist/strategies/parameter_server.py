"""Asynchronous parameter-server training: variables on ps tasks, steps scheduled on workers."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
import zipfile
from typing import Any

import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import options as options_lib
from tfdist._compat import tf as tfc
from tfdist.engine import parameter_server as ps_engine
from tfdist.strategies.base import TfdistStrategy, run_creation_hooks

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


def _resolve_cluster(cluster_resolver) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The cluster, validated for parameter-server training before any server starts.

    A cluster needs worker and ps tasks. Its coordinator is the `chief` task,
    or, as in TensorFlow's `ParameterServerStrategy`, the current process
    when `cluster_resolver` names no task (`task_type=None`): TensorFlow then
    connects it to the cluster as the chief. A TF_CONFIG job is every one of
    its processes, so it must list its chief. Every error names where the
    cluster came from (`cluster_lib.ClusterSource`) and how to fix it there.
    """
    source = cluster_lib.ClusterSource.of(cluster_resolver)
    if cluster_resolver is None:
        raw = os.environ.get("TF_CONFIG", "")
        if not raw.strip():
            raise cluster_lib.ClusterConfigError(
                "Strategy 'parameter_server' needs a cluster of worker and ps tasks. Set TF_CONFIG "
                "in every process, with a chief to coordinate (tfdist launch --chief --workers 2 "
                "--ps 1 -- python train.py does it for a local job), or pass cluster_resolver= a "
                "ClusterResolver of the worker and ps tasks to coordinate them from this process. "
                "Received: TF_CONFIG unset"
            )
        cluster_lib.parse_tf_config(raw)  # One place validates TF_CONFIG's shape.
        cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    else:
        spec = cluster_resolver.cluster_spec().as_dict()
        if cluster_resolver.task_type is None:
            cluster_lib.validate_jobs(spec, source.label)
        elif cluster_resolver.task_type == "chief" and "chief" not in spec:
            raise cluster_lib.ClusterConfigError(
                "Strategy 'parameter_server' got a resolver whose task is 'chief', but its cluster has "
                f"no 'chief' job. Received: task_type='chief' and cluster jobs {sorted(spec)} from "
                f"{source.label}. To coordinate from this process, outside the cluster, leave the "
                "resolver's task_type None, e.g. SimpleClusterResolver(cluster_spec, rpc_layer='grpc'); "
                f"or {source.add_job('chief')}."
            )
        else:
            cluster_lib.ClusterConfig.create(
                spec, cluster_resolver.task_type, cluster_resolver.task_id,
                cluster_resolver.rpc_layer or "grpc", source=source.label,
            )
    jobs = cluster_resolver.cluster_spec().as_dict()
    received = f"Received: cluster jobs {sorted(jobs)} from {source.label}"
    if not jobs.get("ps"):
        raise cluster_lib.ClusterConfigError(
            "Strategy 'parameter_server' needs a 'ps' job with at least one task to hold the "
            f"variables. {received}. To fix it, {source.add_job('ps')}; or use strategy "
            "'multi_worker' for synchronous training without parameter servers."
        )
    if not jobs.get("worker"):
        raise cluster_lib.ClusterConfigError(
            "Strategy 'parameter_server' needs a 'worker' job with at least one task to run the "
            f"training steps. {received}. To fix it, {source.add_job('worker')}."
        )
    if jobs.get("chief"):
        return cluster_resolver
    if source.kind != "cluster_resolver":
        outside = (
            "; or coordinate from a process outside the cluster by passing it "
            "cluster_resolver=tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, "
            "rpc_layer='grpc')"
            if source.kind == "TF_CONFIG"
            else ""
        )
        raise cluster_lib.ClusterConfigError(
            f"Strategy 'parameter_server' needs a 'chief' job in {source.label}: the coordinator "
            "that builds the model and runs model.fit, and whose end the worker and ps tasks wait "
            f"for. {received}. To fix it, {source.add_job('chief')}{outside}."
        )
    if cluster_resolver.task_type == "evaluator":
        raise cluster_lib.ClusterConfigError(
            "Strategy 'parameter_server' runs a sidecar evaluator beside a 'chief' job only: it "
            "evaluates the chief's checkpoints and exits when the chief does. "
            f"{received} and task type 'evaluator'. To fix it, {source.add_job('chief')}; or "
            "call model.evaluate in the coordinating process."
        )
    # The coordinator is this process (task_type None); a worker or ps task
    # of such a cluster serves until it is stopped.
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


def _config_of(resolver) -> cluster_lib.ClusterConfig:
    """The resolver's cluster as a `ClusterConfig`; a coordinator outside it (no task) is `chief:0`."""
    spec = {job: tuple(addresses) for job, addresses in resolver.cluster_spec().as_dict().items()}
    return cluster_lib.ClusterConfig(spec, resolver.task_type or "chief", resolver.task_id or 0)


class ServingTask:
    """A worker or ps task's running server, returned by `ParameterServerStrategy(join=False)`.

    Such a process serves the chief: it cannot build or fit models. `join()`
    serves until the job ends and exits the process. In a cluster without a
    chief (its coordinator outside the cluster, given by `cluster_resolver=`)
    there is no chief to watch: the task serves until it gets SIGTERM.

    Attributes:
        task_type: str. `"worker"` or `"ps"`.
        task_id: int. The task's index.
        server: the running `tf.distribute.Server`.
    """

    def __init__(self, resolver, server):
        self.task_type = resolver.task_type
        self.task_id = resolver.task_id
        self.server = server
        self._chief = (resolver.cluster_spec().as_dict().get("chief") or [None])[0]

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
        """Serves until the chief is gone (the job ended) or SIGTERM, then exits the process with 0.

        Without a chief in the cluster, serves until SIGTERM.
        """
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


def serve_until_job_ends(chief_address: str | None, poll_seconds: float = 0.5, gone_after: int = 4) -> None:
    """Blocks while the job runs; exits the process with status 0 when it ends.

    The job has ended when the chief, having been reachable, stops accepting
    connections for `gone_after` polls in a row, or when the process gets
    SIGTERM (what `tfdist launch` and Kubernetes send). With no chief
    (`chief_address=None`: the coordinator is outside the cluster), only
    SIGTERM ends it. A TensorFlow server cannot be stopped in-process, so the
    process exits.
    """

    def leave(*_):
        _exit_process()

    signal.signal(signal.SIGTERM, leave)
    seen, missing = False, 0
    while True:
        if chief_address is None:
            time.sleep(poll_seconds)
            continue
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

    As with TensorFlow's own strategy, the coordinator may instead be the
    current process outside the cluster: pass a `cluster_resolver` of worker
    and ps jobs (no chief) that names no task, e.g. the
    `SimpleClusterResolver(cluster_spec, rpc_layer="grpc")` of TensorFlow's
    parameter-server tutorial, whose servers run in this process or others.

    Args:
        variable_partitioner: Optional. How variables are split across ps
            tasks along their first axis: `"num_shards:N"`,
            `"max_shard_bytes:B"`, `"min_shard_bytes:B"` (the size-based
            specs use at most one shard per ps task) or a
            `tf.distribute.experimental.partitioners.Partitioner`. Default
            `None`: every variable whole, placed round-robin on ps tasks.
        cluster_resolver: Optional `ClusterResolver`. Default: TF_CONFIG,
            which must list a chief. A resolver with `task_type=None` makes
            this process the coordinator; its cluster needs no chief.
        join: bool. On worker and ps tasks, block and exit when the job ends
            (default `True`); `False` returns a `ServingTask` instead.
        startup_timeout: Optional float. Seconds the chief waits for every
            worker and ps task to answer before it raises
            `tfdist.cluster.StartupTimeoutError` naming them; default 300
            (environment TFDIST_STARTUP_TIMEOUT).
        **options: step options (see `tfdist.options.STEP_OPTIONS`).

    Example:

    ```python
    # the same script on every task; TF_CONFIG says which one this is
    strategy = tfdist.get_strategy("parameter_server", variable_partitioner="num_shards:2")
    with strategy.scope():          # chief only: other tasks never get here
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3, steps_per_epoch=100)

    # or coordinate running worker and ps servers from this process (no chief)
    spec = tf.train.ClusterSpec({"worker": ["localhost:2222", "localhost:2223"], "ps": ["localhost:2224"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
    strategy = tfdist.get_strategy("parameter_server", cluster_resolver=resolver)
    ```
    """

    name = "parameter_server"
    PARAMS = {
        "variable_partitioner": VARIABLE_PARTITIONER,
        "cluster_resolver": CLUSTER_RESOLVER,
        "join": JOIN,
        "startup_timeout": options_lib.STARTUP_TIMEOUT,
    }
    gradient_path = ps_engine.PARAMETER_SERVER
    host_loop = ps_engine.COORDINATOR
    asynchronous = True

    def unsupported(self, feature: str, model=None) -> str | None:
        return ps_engine.unsupported_feature(feature, model)

    def __new__(cls, variable_partitioner=None, cluster_resolver=None, join=True, **options):
        # Validate everything before a server starts or the process blocks.
        params, _ = options_lib.split_options(
            cls.name,
            cls.PARAMS,
            {"variable_partitioner": variable_partitioner, "cluster_resolver": cluster_resolver, "join": join, **options},
        )
        resolver = _resolve_cluster(params.get("cluster_resolver"))
        config = _config_of(resolver)
        if resolver.task_type in ("worker", "ps"):
            cluster_lib.check_port_free(config, cluster_lib.ClusterSource.of(cluster_resolver).label)
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
        # TensorFlow's connection to the cluster blocks, holding the GIL, until every task answers.
        timeout = options_lib.seconds(
            options_lib.STARTUP_TIMEOUT, params.get("startup_timeout"), options_lib.DEFAULT_STARTUP_TIMEOUT_S
        )
        config = _config_of(resolver)
        serving = [(job, i) for job in ("ps", "worker") for i in range(len(config.cluster[job]))]
        waited = cluster_lib.wait_for_tasks(config, timeout, serving, hold_own_port=False,
                                            source=cluster_lib.ClusterSource.of(cluster_resolver).label)
        with cluster_lib.startup_deadline(max(timeout - waited, 30.0)):
            super().__init__(resolver, variable_partitioner=partitioner)
        cluster_lib.mark_serving(config)
        self._tfdist_params.pop("startup_timeout", None)
        self._tfdist_params.pop("cluster_resolver", None)
        self._tfdist_params.pop("join", None)
        tfc.colocate_slots_with_shards(self)
        run_creation_hooks("parameter_server", self)
        # The coordinator is one per strategy; tf-keras's fit finds the same one.
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)

    def spans_processes(self) -> bool:
        """Always: the variables live on ps tasks and the steps run on workers, other processes."""
        return True

    @property
    def task_type(self) -> str:
        """`"chief"`: this process coordinates (also when the resolver names no task; TensorFlow
        then connects it to the cluster as the chief)."""
        return self._tfdist_resolver.task_type or "chief"

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

"""Synchronous data parallelism over every device of every worker process of a job."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
from typing import Any, Optional, Union

import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import options as options_lib
from tfdist._compat import tf as tfc
from tfdist.strategies.base import TfdistStrategy, run_creation_hooks

CLUSTER = options_lib.Option(
    name="cluster",
    default=None,
    types=(str, dict, cluster_lib.ClusterConfig),
    expected=(
        "'tf_config' (read the TF_CONFIG environment variable), 'slurm' (this Slurm job "
        "step), 'kubernetes' (this pod of an Indexed Job), a TF_CONFIG dict, or a tfdist.cluster.ClusterConfig"
    ),
    doc="Where the job's description comes from; default TF_CONFIG (one local worker if unset).",
    check=lambda v: not isinstance(v, str) or v == "tf_config" or v in cluster_lib.NAMED_CLUSTERS,
)
CLUSTER_RESOLVER = options_lib.Option(
    name="cluster_resolver",
    default=None,
    types=(tf.distribute.cluster_resolver.ClusterResolver,),
    expected="a tf.distribute.cluster_resolver.ClusterResolver",
    doc="A TensorFlow cluster resolver to use instead of `cluster` (e.g. Kubernetes, GCE).",
)
AUTO_SHARD_POLICIES = ("auto", "file", "data", "off")
AUTO_SHARD = options_lib.Option(
    name="auto_shard",
    default="auto",
    types=(str,),
    expected=f"one of {', '.join(repr(p) for p in AUTO_SHARD_POLICIES)}",
    doc=(
        "How datasets are split across workers: 'file' (each worker reads its own files), "
        "'data' (each worker keeps its share of every global batch), 'auto' (by file when the "
        "dataset reads files, else by data) or 'off' (every worker reads everything)."
    ),
    check=lambda v: v in AUTO_SHARD_POLICIES,
)

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}
_SHARD_POLICIES = {
    "auto": tf.data.experimental.AutoShardPolicy.AUTO,
    "file": tf.data.experimental.AutoShardPolicy.FILE,
    "data": tf.data.experimental.AutoShardPolicy.DATA,
    "off": tf.data.experimental.AutoShardPolicy.OFF,
}


def _workers_disagree(error: Exception) -> bool:
    """Whether TensorFlow's `error` says two workers ran different collectives under one instance key.

    TensorFlow 2.21's messages: "Collective instance N expected type T and
    data_type D but got type T and data_type D2" (an all-reduce of float
    gradients met the int64 "has another batch" agreement of a worker whose
    input ended), and "Shape mismatch in the collective instance N" (buckets
    of different sizes).
    """
    text = str(error)
    return (
        isinstance(error, tf.errors.InternalError) and "Collective instance" in text and "data_type" in text
    ) or (isinstance(error, tf.errors.InvalidArgumentError) and "Shape mismatch in the collective instance" in text)


class MultiWorkerMirroredStrategy(TfdistStrategy, tf.distribute.MultiWorkerMirroredStrategy):
    """Replicates the model on every device of every worker and all-reduces gradients.

    Every worker process runs the same script. The job is read from TF_CONFIG
    (as written by `tfdist launch`, Kubernetes TFJob or your cluster manager),
    from the Slurm job step with `cluster="slurm"`, or from an explicit
    `cluster_resolver`; it is validated before any server starts
    (`tfdist.ClusterConfigError`). Gradients are summed across all replicas of
    all workers in fused buffers (`bucket_bytes`) by TensorFlow's collective
    runtime (ring over gRPC, NCCL between GPUs), and every replica applies the
    same update, so all workers hold identical weights.

    Input: datasets given to `fit` are split across workers by `auto_shard`
    and every global batch is split evenly over all replicas, so `batch_size`
    is the global batch of the whole job. Chief-only duties: under `fit`, the
    `ModelCheckpoint`, `TensorBoard` and `BackupAndRestore` callbacks of every
    worker but the chief write to a temporary directory that is removed at the
    end of training (TensorFlow's multi-worker rule: every worker saves, since
    saving may need all of them, but only the chief's copy is kept);
    `BackupAndRestore` restores every worker from the chief's backup.

    Without TF_CONFIG (and no other `cluster`), the strategy runs as a single
    local worker, so the same script also runs as one process.

    Args:
        cluster: Optional. `"tf_config"` (default behaviour), `"slurm"`,
            `"kubernetes"` (`tfdist.cluster.from_kubernetes`), a TF_CONFIG
            dict, or a `tfdist.cluster.ClusterConfig`.
        cluster_resolver: Optional `tf.distribute.cluster_resolver.ClusterResolver`
            to use instead of `cluster`.
        communication: str. `"auto"` (default), `"ring"` or `"nccl"`.
        collective_timeout: Optional float. Seconds a collective waits for
            its peers before the step fails; default 600 in a job of several
            workers (environment TFDIST_COLLECTIVE_TIMEOUT), none for one
            process; 0 turns it off.
        startup_timeout: Optional float. Seconds this process waits at
            start-up for the other tasks to answer before it raises
            `tfdist.cluster.StartupTimeoutError` naming them; default 300
            (environment TFDIST_STARTUP_TIMEOUT).
        hierarchical: bool. With several logical CPU devices on each of
            several workers (`devices_per_worker` K > 1), each gradient
            bucket is summed within the worker first, all-reduced across
            workers from the worker's first device only, and copied to its
            other devices: the ring has W members instead of W x K. Default
            True; False keeps TensorFlow's one ring through every device.
            GPU workers keep TensorFlow's collective over all their GPUs.
        devices_per_worker: Optional int. GPUs per worker to train on;
            default all of them, or one CPU replica on hosts without GPUs.
            On a worker without GPUs, K > 1 trains on its logical CPU
            devices `CPU:0` to `CPU:K-1` (split first: `tfdist.configure_local_devices(K)`,
            TFDIST_LOCAL_DEVICES, or `tfdist launch --devices-per-worker K`);
            environment default TFDIST_DEVICES_PER_WORKER.
        auto_shard: str. `"auto"` (default), `"file"`, `"data"` or `"off"`.
        **options: step options (see `tfdist.options.STEP_OPTIONS`).

    Example:

    ```python
    # train.py, started by `tfdist launch --workers 2 -- python train.py`
    strategy = tfdist.get_strategy("multi_worker")
    with strategy.scope():
        model = build_and_compile_model()
    model.fit(dataset, epochs=3, callbacks=[keras.callbacks.BackupAndRestore("/tmp/backup")])
    ```
    """

    name = "multi_worker"
    redirects_non_chief_writes = True
    PARAMS = {
        "cluster": CLUSTER,
        "cluster_resolver": CLUSTER_RESOLVER,
        "communication": options_lib.COMMUNICATION,
        "collective_timeout": options_lib.COLLECTIVE_TIMEOUT,
        "startup_timeout": options_lib.STARTUP_TIMEOUT,
        "devices_per_worker": options_lib.DEVICES_PER_WORKER,
        "hierarchical": options_lib.HIERARCHICAL,
        "auto_shard": AUTO_SHARD,
    }

    def __init__(
        self,
        cluster: Union[str, dict, cluster_lib.ClusterConfig, None] = None,
        cluster_resolver: Optional[tf.distribute.cluster_resolver.ClusterResolver] = None,
        communication: str = "auto",
        collective_timeout: Optional[float] = None,
        devices_per_worker: Optional[int] = None,
        auto_shard: str = "auto",
        startup_timeout: Optional[float] = None,
        hierarchical: bool = True,
        **options,
    ):
        params = self._tfdist_init(
            {
                "cluster": cluster,
                "cluster_resolver": cluster_resolver,
                "communication": communication,
                "collective_timeout": collective_timeout,
                "startup_timeout": startup_timeout,
                "devices_per_worker": devices_per_worker,
                "hierarchical": hierarchical,
                "auto_shard": auto_shard,
                **options,
            }
        )
        if cluster is not None and cluster_resolver is not None:
            raise ValueError(
                "Pass either 'cluster' or 'cluster_resolver', not both. "
                f"Received: cluster={cluster!r}, cluster_resolver={cluster_resolver!r}"
            )
        devices_per_worker = _devices_per_worker(devices_per_worker)
        num_gpus = _num_gpus(devices_per_worker, communication)
        self.cluster_config, resolver = _resolve(cluster, cluster_resolver, num_gpus)
        # A CPU worker with several logical devices trains on that many (TensorFlow gives it one).
        cpu_replicas = devices_per_worker if (devices_per_worker or 1) > 1 and not num_gpus else None
        self.auto_shard = params["auto_shard"]
        config = self.cluster_config
        in_cluster = config is not None and config.task_type != "evaluator"
        # Timeouts (docs/operations.md): a job of several workers never waits forever.
        self.startup_timeout = options_lib.seconds(
            options_lib.STARTUP_TIMEOUT, params["startup_timeout"], options_lib.DEFAULT_STARTUP_TIMEOUT_S
        )
        self.collective_timeout = options_lib.seconds(
            options_lib.COLLECTIVE_TIMEOUT, params["collective_timeout"],
            options_lib.DEFAULT_COLLECTIVE_TIMEOUT_S if in_cluster and config.num_workers > 1 else 0,
        ) or None
        comm = tf.distribute.experimental.CommunicationOptions(
            implementation=_IMPLEMENTATIONS[params["communication"]],
            timeout_seconds=self.collective_timeout,
        )
        tfc.isolate_collective_keys(self)
        if in_cluster:
            source = cluster_lib.ClusterSource.of(cluster_resolver).label
            waited = cluster_lib.wait_for_tasks(config, self.startup_timeout, source=source)
            with cluster_lib.startup_deadline(max(self.startup_timeout - waited, 30.0)), self._local_devices(
                cpu_replicas
            ):
                super().__init__(cluster_resolver=resolver, communication_options=comm)
            cluster_lib.mark_serving(config)
        else:
            with self._local_devices(cpu_replicas):
                super().__init__(cluster_resolver=resolver, communication_options=comm)
        # Non-trainable float state (BatchNorm's moving statistics) averaged over
        # every replica of every worker, as under mirrored: each worker would
        # otherwise keep the statistics of its own share, and the chief save those.
        tfc.configure_variable_creation(self)
        # Several CPU replicas on each of several workers: sum within the worker, then across
        # (docs/multi_worker.md, "Several devices per worker"). None: TensorFlow's one ring.
        self.hierarchical_exchange = (
            tfc.worker_leader_all_reduce(self)
            if params["hierarchical"] and cpu_replicas and self.num_workers > 1
            else None
        )
        run_creation_hooks("multi_worker", self)
        self._refuse_tf_keras_if_options_are_set()

    @classmethod
    def demo_kwargs(cls):
        # A multi-process strategy: `tfdist launch` runs it, not `tfdist demo`.
        return None

    @staticmethod
    def _local_devices(cpu_replicas: Optional[int]):
        return tfc.cpu_devices_per_worker(cpu_replicas) if cpu_replicas else contextlib.nullcontext()

    @property
    def is_chief(self) -> bool:
        """Whether this process keeps checkpoints and summaries (chief, else worker 0)."""
        return self.extended.should_checkpoint

    @property
    def num_workers(self) -> int:
        """Worker processes that train in the job (chief included); 1 without a cluster."""
        if self.cluster_config is None or self.cluster_config.task_type == "evaluator":
            return 1
        return self.cluster_config.num_workers

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits `dataset` across workers by the `auto_shard` policy, then over replicas."""
        dataset = _with_shard_policy(dataset, self.auto_shard)
        return super().experimental_distribute_dataset(dataset, options)

    def write_dir(self, path: Union[str, os.PathLike]) -> str:
        """Where this worker writes a file or directory meant to be written once, at `path`.

        The chief writes to `path`; every other worker to a fresh temporary
        directory (remove it with `remove_write_dir` when done). Every worker
        must still call the save: saving a model may run collectives.

        Example:

        ```python
        path = strategy.write_dir("/models/final.keras")
        model.save(path)
        strategy.remove_write_dir(path)
        ```
        """
        path = os.fspath(path)
        if self.is_chief:
            return path
        return os.path.join(_worker_temp_dir(self), os.path.basename(path.rstrip("/")) or "out")

    def explain_collective_error(self, error: Exception) -> Optional[Exception]:
        """The error to raise instead of TensorFlow's collective timeout, or `None` for any other error.

        TensorFlow says only `Collective has timed out during execution.`; the
        error returned (of the same type) names the option, its value, the
        job's tasks and what to do.
        """
        if self.num_workers > 1 and _workers_disagree(error):
            return type(error)(
                getattr(error, "node_def", None),
                getattr(error, "op", None),
                "The workers of the job reached different collectives at the same point of training: "
                "most often their inputs hold different numbers of batches (one worker's input ended "
                "while another's went on), else the workers run different models or step options "
                "(bucket_bytes, precision, accumulation_steps, sink_size must be the same on every "
                "worker). Give every worker the same number of batches: let tf.data shard one dataset "
                "(auto_shard 'auto' or 'data'), or repeat() it and pass steps_per_epoch; and run the same "
                "script with the same options everywhere. TensorFlow aborted this process's "
                "collectives: restart the job.\n"
                f"TensorFlow's error: {error}",
            )
        if not isinstance(error, tf.errors.DeadlineExceededError) or "Collective has timed out" not in str(error):
            return None
        config = self.cluster_config
        tasks = ", ".join(
            f"{cluster_lib.task_name(job, i)} at {address}"
            for job, addresses in (config.cluster.items() if config else ())
            for i, address in enumerate(addresses)
        )
        me = cluster_lib.task_name(config.task_type, config.task_id) if config else "this process"
        message = (
            f"A collective (all-reduce or broadcast) of {me} waited longer than collective_timeout="
            f"{self.collective_timeout:g} s for the other tasks of the job ({tasks}): one of them is stuck "
            "in Python, much slower, or gone without its TensorFlow runtime noticing; TensorFlow cannot "
            "tell which. Look at the other tasks' output. If a task legitimately takes longer between "
            "steps (the chief writing a large checkpoint, a slow first step), raise collective_timeout= "
            "(environment TFDIST_COLLECTIVE_TIMEOUT; 0 turns it off). TensorFlow aborted this process's "
            "collectives: restart the job (tfdist launch --restarts K).\n"
            f"TensorFlow's error: {error}"
        )
        return type(error)(getattr(error, "node_def", None), getattr(error, "op", None), message)

    def remove_write_dir(self, written: Union[str, os.PathLike]) -> None:
        """Removes what a non-chief worker wrote to the path `write_dir` gave it; no-op on the chief."""
        if self.is_chief:
            return
        temp = _worker_temp_dir(self)
        if os.path.abspath(os.fspath(written)).startswith(temp):
            shutil.rmtree(temp, ignore_errors=True)


def _worker_temp_dir(strategy) -> str:
    # tempfile.mkdtemp cannot clash between workers on one host. The pid in the
    # name lets the next process tell a killed worker's leftovers (issue 15).
    existing = getattr(strategy, "_tfdist_temp_dir", None)
    if existing is None or not os.path.isdir(existing):
        cfg = strategy.cluster_config
        label = f"{cfg.task_type}{cfg.task_id}" if cfg else "worker"
        remove_stale_write_dirs()
        existing = tempfile.mkdtemp(prefix=f"tfdist_{label}_{os.getpid()}_")
        _made_here.add(existing)
        # On any exit but SIGKILL; a killed worker's folder goes at the next start.
        atexit.register(shutil.rmtree, existing, True)
        strategy._tfdist_temp_dir = existing
    return existing


_made_here: set = set()
_WRITE_DIR = re.compile(r"^tfdist_(?:chief|worker|ps|evaluator)\d*_(\d+)_")


def remove_stale_write_dirs(parent: Optional[str] = None) -> list[str]:
    """Removes non-chief write directories (`write_dir`) left by processes no longer running.

    A worker killed by SIGKILL cannot remove its temporary directory; the next
    worker to make one on the same host (a restarted job) removes it. A
    directory whose pid runs is kept, unless that pid is this process's and
    the directory was not made here (the pid was reused).

    Args:
        parent: str or None. The folder to clean (default `tempfile.gettempdir()`).

    Returns:
        The paths removed, sorted.
    """
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        match = _WRITE_DIR.match(entry)
        path = os.path.join(parent, entry)
        if match is None or path in _made_here or not os.path.isdir(path):
            continue
        pid = int(match.group(1))
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue  # still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return sorted(removed)


def _with_shard_policy(dataset, policy: str):
    # "auto" leaves the dataset's own policy (Keras sets DATA for arrays).
    if policy == "auto" or not isinstance(dataset, tf.data.Dataset):
        return dataset
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = _SHARD_POLICIES[policy]
    return dataset.with_options(opts)


DEVICES_PER_WORKER_ENV = "TFDIST_DEVICES_PER_WORKER"


def _devices_per_worker(value: Optional[int]) -> Optional[int]:
    """`devices_per_worker`, else TFDIST_DEVICES_PER_WORKER (set by `tfdist launch --devices-per-worker`)."""
    if value is not None:
        return value
    raw = os.environ.get(DEVICES_PER_WORKER_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise options_lib.OptionError(
            f"Environment variable {DEVICES_PER_WORKER_ENV} must be an integer >= 1 (replicas per "
            f"worker), or unset. Received: {DEVICES_PER_WORKER_ENV}={raw!r}"
        )
    return int(raw)


def _num_gpus(devices_per_worker: Optional[int], communication: str) -> Optional[int]:
    gpus = len(tf.config.list_physical_devices("GPU"))
    if communication == "nccl" and not gpus:
        raise ValueError(
            "communication='nccl' needs GPUs, and this worker has none. Use communication='ring' "
            "(or 'auto'). Received: communication='nccl'"
        )
    if devices_per_worker is None:
        return gpus
    if gpus and devices_per_worker > gpus:
        raise ValueError(
            f"devices_per_worker={devices_per_worker} is more than this worker has: {gpus} GPU(s). "
            f"Use devices_per_worker <= {gpus}, or start more workers."
        )
    # From the configuration, not by listing the devices: that would initialise TensorFlow's
    # runtime before the strategy configures its collective ops.
    cpu = tf.config.list_physical_devices("CPU")[0]
    cpus = len(tf.config.get_logical_device_configuration(cpu) or [None])
    if not gpus and devices_per_worker > cpus:
        raise ValueError(
            f"devices_per_worker={devices_per_worker} needs {devices_per_worker} logical CPU devices in "
            f"each worker; this worker has {cpus}. Split its CPU first: tfdist.configure_local_devices("
            f"{devices_per_worker}) at the top of the script, TFDIST_LOCAL_DEVICES={devices_per_worker}, "
            f"or start the job with `tfdist launch --devices-per-worker {devices_per_worker}`."
        )
    return devices_per_worker if gpus else 0


def _resolve(cluster: Any, resolver, num_gpus: int):
    """Returns (ClusterConfig or None, a cluster resolver or None for local)."""
    if resolver is not None:
        spec = resolver.cluster_spec().as_dict()
        if not spec:
            return None, resolver
        config = cluster_lib.ClusterConfig.create(
            spec, resolver.task_type, resolver.task_id, resolver.rpc_layer or "grpc",
            source=f"cluster_resolver {type(resolver).__name__}",
        )
        return config, resolver
    if isinstance(cluster, str) and cluster in cluster_lib.NAMED_CLUSTERS:
        config = cluster_lib.NAMED_CLUSTERS[cluster]()
    elif isinstance(cluster, cluster_lib.ClusterConfig):
        config = cluster
    elif isinstance(cluster, dict):
        config = cluster_lib.parse_tf_config(cluster)
    elif os.environ.get("TF_CONFIG", "").strip():
        config = cluster_lib.parse_tf_config()
    elif cluster == "tf_config":
        config = cluster_lib.parse_tf_config()  # raises: TF_CONFIG is not set
    else:
        config = None
    if config is None or config.task_type == "evaluator":
        # One local worker; an evaluator evaluates on its own, outside the collective group.
        return config, tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({}), num_accelerators={"GPU": num_gpus} if num_gpus else {}
        )
    if config.task_type == "ps":
        raise cluster_lib.ClusterConfigError(
            "TF_CONFIG: field 'task.type' is 'ps', but the multi_worker strategy has no parameter "
            "servers; every task trains. Use tfdist.get_strategy('parameter_server') for jobs with "
            "ps tasks, or remove 'ps' from the cluster."
        )
    if "ps" in config.cluster:
        raise cluster_lib.ClusterConfigError(
            f"TF_CONFIG: field 'cluster.ps' lists {len(config.cluster['ps'])} parameter server(s), but "
            "the multi_worker strategy has none. Remove 'ps' from the cluster, or use "
            "tfdist.get_strategy('parameter_server')."
        )
    return config, config.cluster_resolver(num_gpus)

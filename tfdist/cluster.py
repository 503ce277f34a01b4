"""Where a process sits in a multi-process job: TF_CONFIG, Slurm or explicit, validated once.

Every multi-process strategy starts from a `ClusterConfig`: the addresses of
every task by job type (`chief`, `worker`, `ps`, `evaluator`) and which task
this process is. It is read from the `TF_CONFIG` environment variable (what
`tfdist launch`, Kubeflow's TFJob and most cluster managers set), from a Slurm
job step, from a Kubernetes Indexed Job, or given explicitly, and it is validated here, before any TensorFlow
server starts, so a typo in a port fails with the field and value named rather
than with a gRPC hang minutes later.

```python
config = tfdist.cluster.parse_tf_config()      # reads os.environ["TF_CONFIG"]
config.task_type, config.task_id, config.num_workers
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

# Job types TensorFlow's runtime knows. "evaluator" runs beside the job and is
# usually not listed in the cluster (its task still names it).
JOB_TYPES = ("chief", "worker", "ps", "evaluator")


class ClusterConfigError(ValueError):
    """The cluster description is invalid; the message names the field, the value and the fix."""


class StartupTimeoutError(TimeoutError):
    """Tasks of a multi-process job did not answer within `startup_timeout`; the message names them."""


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated description of a multi-process job and of this process in it.

    Args:
        cluster: dict mapping job type (`"chief"`, `"worker"`, `"ps"`,
            `"evaluator"`) to the list of `"host:port"` addresses of its tasks.
        task_type: str. This process's job type.
        task_id: int. This process's index within its job type.
        rpc_layer: str. Transport between tasks; default `"grpc"`.

    Build one with `parse_tf_config`, `from_slurm` or `ClusterConfig.create`,
    which validate; the constructor does not.

    Example:

    ```python
    config = tfdist.cluster.ClusterConfig.create(
        {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, task_type="worker", task_id=1
    )
    config.num_workers  # 2
    ```
    """

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_id: int
    rpc_layer: str = "grpc"

    @classmethod
    def create(
        cls,
        cluster: Mapping[str, Any],
        task_type: str,
        task_id: int,
        rpc_layer: str = "grpc",
        source: str = "cluster",
    ) -> ClusterConfig:
        """Validates and returns a `ClusterConfig`; raises `ClusterConfigError` naming the bad field."""
        return _validate({"cluster": cluster, "task": {"type": task_type, "index": task_id},
                          "rpc_layer": rpc_layer}, source)

    @property
    def num_workers(self) -> int:
        """Tasks that train synchronously: the chief (if any) plus the workers."""
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def is_chief(self) -> bool:
        """Whether this process does the job's single-writer duties (checkpoints, summaries).

        The chief is task `chief:0` if the cluster has a chief, else `worker:0`
        (TensorFlow's rule).
        """
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_id == 0

    @property
    def address(self) -> Optional[str]:
        """This task's `host:port`, or `None` for an evaluator outside the cluster."""
        addresses = self.cluster.get(self.task_type, ())
        return addresses[self.task_id] if self.task_id < len(addresses) else None

    def to_tf_config(self) -> dict:
        """The TF_CONFIG dict for this process (serialise with `json.dumps`)."""
        return {
            "cluster": {job: list(addrs) for job, addrs in self.cluster.items()},
            "task": {"type": self.task_type, "index": self.task_id},
            "rpc_layer": self.rpc_layer,
        }

    def cluster_resolver(self, num_gpus: Optional[int] = None):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver` for this config.

        Args:
            num_gpus: Optional int. GPUs this task uses; default: every GPU
                TensorFlow sees on this host.
        """
        import tensorflow as tf

        if num_gpus is None:
            num_gpus = len(tf.config.list_physical_devices("GPU"))
        spec = {job: list(addrs) for job, addrs in self.cluster.items()}
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec),
            task_type=self.task_type,
            task_id=self.task_id,
            num_accelerators={"GPU": num_gpus} if num_gpus else {},
            rpc_layer=self.rpc_layer,
        )


# `tfdist launch` sets this for every task it starts (tfdist/launch.py), beside TF_CONFIG.
_LAUNCH_VARIABLE = "TFDIST_RESTART_COUNT"

_LAUNCH_FLAGS = {"chief": "--chief", "worker": "--workers 2", "ps": "--ps 1", "evaluator": "--evaluator"}


@dataclasses.dataclass(frozen=True)
class ClusterSource:
    """How a job's cluster was given, so that an error names it and its advice fits it.

    Attributes:
        kind: str. `"cluster_resolver"` (a strategy's `cluster_resolver=`
            argument), `"TF_CONFIG"` (the environment variable, set by hand or
            by a cluster manager) or `"tfdist launch"` (the TF_CONFIG that
            `tfdist launch` set).
        resolver: str. The resolver's class name, for kind `"cluster_resolver"`.

    Example:

    ```python
    source = tfdist.cluster.ClusterSource.of(cluster_resolver=None)  # TF_CONFIG
    source.label          # 'TF_CONFIG'
    source.add_job("ps")  # how to add ps tasks, written for TF_CONFIG
    ```
    """

    kind: str
    resolver: str = ""

    @classmethod
    def of(cls, cluster_resolver=None) -> ClusterSource:
        """The source of the cluster a strategy was given: `cluster_resolver`, else the environment."""
        if cluster_resolver is not None:
            return cls("cluster_resolver", type(cluster_resolver).__name__)
        if _LAUNCH_VARIABLE in os.environ:
            return cls("tfdist launch")
        return cls("TF_CONFIG")

    @property
    def label(self) -> str:
        """The source as error messages name it, e.g. `cluster_resolver=SimpleClusterResolver`."""
        if self.kind == "cluster_resolver":
            return f"cluster_resolver={self.resolver}"
        if self.kind == "tfdist launch":
            return "the TF_CONFIG set by `tfdist launch`"
        return "TF_CONFIG"

    def add_job(self, job: str) -> str:
        """How to add tasks of type `job` to the cluster this way, as a clause of a sentence."""
        if self.kind == "tfdist launch":
            return (f"add {_LAUNCH_FLAGS[job]} to the `tfdist launch` command "
                    "(e.g. tfdist launch --chief --workers 2 --ps 1 -- python train.py)")
        if self.kind == "TF_CONFIG":
            return f"add a {job!r} job to the cluster in every process's TF_CONFIG, e.g. \"{job}\": [\"host:2222\"]"
        return (f"add a {job!r} job to the tf.train.ClusterSpec of the resolver passed as cluster_resolver=, "
                f"e.g. {{..., \"{job}\": [\"localhost:2224\"]}}")


def _fail(source: str, message: str) -> None:
    raise ClusterConfigError(f"{source}: {message}")


def _check_address(source: str, job: str, i: int, address: Any) -> tuple[str, int]:
    field = f"cluster.{job}[{i}]"
    if not isinstance(address, str) or not address:
        _fail(source, f"field '{field}' must be a 'host:port' string. Received: {field}={address!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        _fail(source, f"field '{field}' must be a 'host:port' string such as 'localhost:2222'. "
                      f"Received: {field}={address!r} (no port)")
    if not port.isdigit():
        _fail(source, f"field '{field}' has a port that is not a number: {port!r}. Expected "
                      f"'host:port' with a port in 1..65535, e.g. '{host}:2222'. Received: {field}={address!r}")
    if not 0 < int(port) < 65536:
        _fail(source, f"field '{field}' has port {port}, outside 1..65535. Received: {field}={address!r}")
    return host, int(port)


def validate_jobs(cluster: Any, source: str) -> dict[str, tuple[str, ...]]:
    """Validates a cluster's jobs and addresses; returns `{job: (address, ...)}`.

    Args:
        cluster: a mapping of job type to a list of `"host:port"` strings, as
            in TF_CONFIG's `cluster` or `tf.train.ClusterSpec.as_dict()`.
        source: str. How the cluster was given (`ClusterSource.label`), the
            prefix of every error message.

    Raises:
        ClusterConfigError: the cluster is empty, a job type is unknown, an
            address is not `host:port`, two tasks share an address, or there
            is more than one chief.
    """
    if not isinstance(cluster, Mapping) or not cluster:
        _fail(source, "field 'cluster' must be a non-empty object mapping job type to a list of "
                      f"'host:port' addresses. Received: cluster={cluster!r}")
    jobs: dict[str, tuple[str, ...]] = {}
    seen: dict[tuple[str, int], str] = {}
    for job, addresses in cluster.items():
        if job not in JOB_TYPES:
            _fail(source, f"field 'cluster' has unknown job type {job!r}. "
                          f"Valid job types: {', '.join(JOB_TYPES)}.")
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)) or not addresses:
            _fail(source, f"field 'cluster.{job}' must be a non-empty list of 'host:port' strings. "
                          f"Received: cluster.{job}={addresses!r}")
        for i, address in enumerate(addresses):
            host, port = _check_address(source, job, i, address)
            key = ("localhost" if host in ("127.0.0.1", "localhost") else host, port)
            if key in seen:
                _fail(source, f"fields '{seen[key]}' and 'cluster.{job}[{i}]' have the same address "
                              f"{address!r}; every task needs its own host:port.")
            seen[key] = f"cluster.{job}[{i}]"
        jobs[job] = tuple(addresses)
    if len(jobs.get("chief", ())) > 1:
        _fail(source, f"field 'cluster.chief' must have exactly one task. Received: {len(jobs['chief'])} "
                      f"tasks {list(jobs['chief'])}")
    return jobs


def _validate(data: Any, source: str) -> ClusterConfig:
    if not isinstance(data, Mapping):
        _fail(source, f"must be a JSON object with 'cluster' and 'task'. Received: {data!r}")
    if "cluster" not in data:
        _fail(source, "field 'cluster' is missing. Expected e.g. "
                      '{"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, '
                      '"task": {"type": "worker", "index": 0}}. '
                      f"Received fields: {sorted(data)}")
    if "task" not in data:
        _fail(source, "field 'task' is missing. Expected e.g. "
                      '"task": {"type": "worker", "index": 0} naming this process. '
                      f"Received fields: {sorted(data)}")
    cluster, task = data["cluster"], data["task"]
    jobs = validate_jobs(cluster, source)
    if not isinstance(task, Mapping):
        _fail(source, f"field 'task' must be an object with 'type' and 'index'. Received: task={task!r}")
    task_type = task.get("type")
    if task_type is None:
        _fail(source, f"field 'task.type' is missing. Expected one of {', '.join(JOB_TYPES)}. "
                      f"Received: task={dict(task)!r}")
    if task_type not in JOB_TYPES:
        _fail(source, f"field 'task.type' is an unknown job type {task_type!r}. "
                      f"Valid job types: {', '.join(JOB_TYPES)}.")
    task_id = task.get("index", 0)
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        _fail(source, f"field 'task.index' must be an integer >= 0. Received: task.index={task_id!r}")
    if task_type == "evaluator" and "evaluator" not in jobs:
        # TensorFlow's evaluator runs beside the cluster; there is one.
        if task_id != 0:
            _fail(source, f"field 'task.index' is out of range: an evaluator outside the cluster "
                          f"has index 0. Received: task.index={task_id}")
    elif task_type not in jobs:
        _fail(source, f"field 'task.type' is {task_type!r}, but the cluster has no {task_type!r} job. "
                      f"Jobs in the cluster: {', '.join(jobs)}.")
    elif task_id >= len(jobs[task_type]):
        _fail(source, f"field 'task.index' is out of range: job {task_type!r} has {len(jobs[task_type])} "
                      f"task(s), so the index must be 0..{len(jobs[task_type]) - 1}. "
                      f"Received: task.index={task_id}")
    if not jobs.get("chief") and not jobs.get("worker"):
        _fail(source, f"field 'cluster' has no 'chief' or 'worker' job; someone must train. "
                      f"Received jobs: {', '.join(jobs)}")
    rpc_layer = data.get("rpc_layer") or "grpc"
    if not isinstance(rpc_layer, str):
        _fail(source, f"field 'rpc_layer' must be a string such as 'grpc'. Received: rpc_layer={rpc_layer!r}")
    return ClusterConfig(cluster=jobs, task_type=task_type, task_id=task_id, rpc_layer=rpc_layer)


def parse_tf_config(raw: Union[str, Mapping[str, Any], None] = None) -> ClusterConfig:
    """Parses and validates a TF_CONFIG, by default the process's.

    Args:
        raw: the TF_CONFIG as a JSON string or a dict. Default `None` reads the
            environment variable `TF_CONFIG`.

    Returns:
        The validated `ClusterConfig`.

    Raises:
        ClusterConfigError: TF_CONFIG is unset or not valid JSON; `cluster` or
            `task` is missing; a job type is unknown; an address lacks a
            numeric port; two tasks share an address; or the task index is
            out of range. The message names the field and the value.

    Example:

    ```python
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
        "task": {"type": "worker", "index": 0},
    })
    config = tfdist.cluster.parse_tf_config()
    config.is_chief  # True
    ```
    """
    source = "TF_CONFIG"
    if raw is None:
        raw = os.environ.get("TF_CONFIG", "")
        if not raw.strip():
            _fail(source, "the environment variable TF_CONFIG is not set. Start the process with "
                          "`tfdist launch`, set TF_CONFIG to the job's JSON description, or pass "
                          "cluster_resolver= to the strategy.")
    if isinstance(raw, str):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            _fail(source, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}). "
                          f"Received: TF_CONFIG={raw!r}")
    else:
        data = raw
    return _validate(data, source)


# The first port of each node's tasks in a Slurm job step (`from_slurm`).
SLURM_PORT_BASE = 8888
SLURM_PORT_BASE_VARIABLE = "TFDIST_SLURM_PORT_BASE"


def from_slurm(jobs: Optional[Mapping[str, int]] = None, port_base: Optional[int] = None) -> ClusterConfig:
    """Reads this Slurm job step's tasks into a validated `ClusterConfig`.

    Uses TensorFlow's `SlurmClusterResolver` on the variables Slurm sets for
    every task (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_STEP_NODELIST`,
    `SLURM_STEP_TASKS_PER_NODE`): hosts sorted, tasks on one host on ports
    `port_base`, `port_base + 1`, ...

    Args:
        jobs: Optional dict of job type to task count; default every task a
            `worker`.
        port_base: Optional int. First port on each node; default the
            environment variable `TFDIST_SLURM_PORT_BASE` (sbatch passes the
            submitting shell's environment on), else 8888.

    Raises:
        ClusterConfigError: a Slurm variable is missing or the job does not
            fit the step's tasks.

    Example:

    ```python
    # in each task of `srun -n 2 python train.py`
    config = tfdist.cluster.from_slurm()
    ```
    """
    if port_base is None:
        raw = os.environ.get(SLURM_PORT_BASE_VARIABLE, "").strip()
        if raw and (not raw.isdigit() or not 0 < int(raw) < 65536):
            _fail("Slurm job step", f"environment variable {SLURM_PORT_BASE_VARIABLE} must be a port in 1..65535. "
                                    f"Received: {SLURM_PORT_BASE_VARIABLE}={raw!r}")
        port_base = int(raw) if raw else SLURM_PORT_BASE
    resolver = _slurm_resolver(jobs, port_base)
    spec = resolver.cluster_spec().as_dict()
    task_type, task_id = resolver.get_task_info()
    return ClusterConfig.create(spec, task_type, task_id, source="Slurm job step")


def _max_tasks_per_node(tasks_per_node: str) -> int:
    """The largest count in Slurm's compressed form, e.g. '2(x3),1' -> 2."""
    counts = [int(part.split("(")[0]) for part in tasks_per_node.split(",") if part.split("(")[0].isdigit()]
    return max(counts, default=1)


def _slurm_resolver(jobs, port_base):
    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))
    try:
        if gpus:
            return tf.distribute.cluster_resolver.SlurmClusterResolver(jobs=jobs, port_base=port_base)
        # On CPU nodes TensorFlow's resolver packs at most gpus_per_node //
        # gpus_per_task tasks per node (and asks nvidia-smi for the GPU count),
        # so give it one pseudo-GPU per task and do not touch CUDA_VISIBLE_DEVICES.
        per_node = _max_tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1"))
        return tf.distribute.cluster_resolver.SlurmClusterResolver(
            jobs=jobs, port_base=port_base, gpus_per_node=per_node, gpus_per_task=1, auto_set_gpu=False
        )
    except (RuntimeError, KeyError, ValueError) as e:
        raise ClusterConfigError(
            f"Slurm job step: cannot read the job from the Slurm environment ({str(e).rstrip('.')}). Run the script "
            "with `srun` inside an allocation (sbatch/salloc), which sets SLURM_PROCID, "
            "SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE."
        ) from None


# ---------------------------------------------------------------------------
# Kubernetes: an Indexed Job whose pods a headless Service names.
# ---------------------------------------------------------------------------

KUBERNETES_PORT = 2222


def from_kubernetes(environ: Optional[Mapping[str, str]] = None) -> ClusterConfig:
    """This pod's place in a Kubernetes Indexed Job, read from what the Job and its manifest give the pod.

    An Indexed Job (`completionMode: Indexed`, `completions` = `parallelism`
    = the number of workers) gives pod `i` the environment variable
    `JOB_COMPLETION_INDEX=i` and the hostname `<job name>-<i>`; with
    `subdomain: <service>` in the pod template and a headless Service of
    that name (`clusterIP: None`, `publishNotReadyAddresses: true`), pod `j`
    is reachable at `<job name>-<j>.<service>`. Every pod is a worker; pod 0
    is the chief. No operator (Kubeflow's TFJob) is needed.
    examples/kubernetes/ has the manifests.

    Read from the environment:

    * `JOB_COMPLETION_INDEX` (set by Kubernetes): this pod's index;
    * `TFDIST_NUM_WORKERS` (set in the manifest): the job's pods;
    * `TFDIST_SERVICE` (set in the manifest): the headless Service;
    * `TFDIST_JOB_NAME` (optional): the Job's name; default `HOSTNAME`
      (`<job name>-<index>`) without its `-<index>`;
    * `TFDIST_NAMESPACE` (optional): appended to the addresses, for DNS
      resolvers that do not search the pod's own namespace;
    * `TFDIST_PORT` (optional): every pod's port, default 2222.

    Args:
        environ: Optional mapping to read instead of `os.environ`.

    Raises:
        ClusterConfigError: a variable is missing or invalid; the message
            names it and the manifest field that sets it.

    Example:

    ```python
    strategy = tfdist.get_strategy("multi_worker", cluster="kubernetes")
    # or: cluster=tfdist.cluster.from_kubernetes()
    ```
    """
    env = os.environ if environ is None else environ
    source = "Kubernetes Indexed Job"
    manifest = "examples/kubernetes/job.yaml"

    def integer(name: str, how: str, low: int) -> int:
        raw = env.get(name)
        if raw is None or not raw.strip():
            _fail(source, f"the environment variable {name} is not set; {how} (see {manifest}).")
        if not raw.strip().isdigit() or int(raw) < low:
            _fail(source, f"the environment variable {name} must be an integer >= {low}. Received: {name}={raw!r}")
        return int(raw)

    index = integer("JOB_COMPLETION_INDEX", "Kubernetes sets it in the pods of a Job with "
                    "`completionMode: Indexed`: run the script in such a Job", 0)
    workers = integer("TFDIST_NUM_WORKERS", "set it in the pod template's env to the Job's `completions` "
                      "(= `parallelism`)", 1)
    if index >= workers:
        _fail(source, f"JOB_COMPLETION_INDEX={index} is out of range for TFDIST_NUM_WORKERS={workers}: set "
                      "TFDIST_NUM_WORKERS to the Job's `completions` (= `parallelism`).")
    service = (env.get("TFDIST_SERVICE") or "").strip()
    if not service:
        _fail(source, "the environment variable TFDIST_SERVICE is not set; set it in the pod template's env to "
                      f"the name of the headless Service that is the pods' `subdomain` (see {manifest}).")
    job_name = (env.get("TFDIST_JOB_NAME") or "").strip()
    if not job_name:
        hostname = (env.get("HOSTNAME") or "").strip()
        suffix = f"-{index}"
        if not hostname.endswith(suffix) or len(hostname) == len(suffix):
            _fail(source, f"cannot tell the Job's name: HOSTNAME={hostname!r} is not '<job name>{suffix}', as "
                          "Kubernetes names an Indexed Job's pod. Set TFDIST_JOB_NAME in the pod template's env.")
        job_name = hostname[: -len(suffix)]
    port = integer("TFDIST_PORT", "", 1) if env.get("TFDIST_PORT") else KUBERNETES_PORT
    namespace = (env.get("TFDIST_NAMESPACE") or "").strip()
    domain = f"{service}.{namespace}" if namespace else service
    addresses = [f"{job_name}-{i}.{domain}:{port}" for i in range(workers)]
    return ClusterConfig.create({"worker": addresses}, "worker", index, source=source)


# The clusters a strategy's `cluster=` option names, and how each is read.
NAMED_CLUSTERS = {"slurm": from_slurm, "kubernetes": from_kubernetes}


# ---------------------------------------------------------------------------
# Start-up: this task's port, and waiting for the other tasks (issue 15).
# ---------------------------------------------------------------------------

_FLAG_HINT = "startup_timeout= (tfdist launch --startup-timeout S, environment TFDIST_STARTUP_TIMEOUT)"


def task_name(job: str, index: int) -> str:
    """A task as messages name it, e.g. `worker:1`."""
    return f"{job}:{index}"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _listen(port: int) -> socket.socket:
    """A socket listening on `port` of every interface, as TensorFlow's gRPC server binds it."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address: tuple = ("::", port)
    except OSError:  # no IPv6 on this host
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("", port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def _port_in_use(config: ClusterConfig, port: int, source: str) -> ClusterConfigError:
    me = task_name(config.task_type, config.task_id)
    return ClusterConfigError(
        f"{source}: port {port} of this task ({me}, address {config.address!r}) is already in use "
        "by another process, so its TensorFlow server cannot start. Stop the process that holds it "
        f"(`ss -ltnp 'sport = :{port}'` shows it), or give {me} a free port in every process's "
        "TF_CONFIG (`tfdist launch` picks free ports itself)."
    )


def check_port_free(config: ClusterConfig, source: str = "TF_CONFIG") -> None:
    """Raises `ClusterConfigError` naming this task's port if another process already listens on it.

    TensorFlow's own error for it is `UnknownError: Could not start gRPC
    server`, without the port.
    """
    if config.address is None or config.address in _SERVING:
        return
    port = _split(config.address)[1]
    try:
        _listen(port).close()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise _port_in_use(config, port, source) from None
        raise


def _probe(address: str, timeout: float) -> Optional[str]:
    """None if `address` accepts a TCP connection, else why not, in a few words."""
    try:
        host, port = _split(address)
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except socket.gaierror:
        return "host not found"
    except ConnectionRefusedError:
        return "connection refused"
    except (socket.timeout, TimeoutError):
        return "no answer"
    except OSError as e:
        return e.strerror or type(e).__name__


# Addresses whose TensorFlow server this process started (`mark_serving`).
_SERVING: set = set()


def mark_serving(config: ClusterConfig) -> None:
    """Records that this process now serves `config`'s task (its server started)."""
    if config.address is not None:
        _SERVING.add(config.address)


def wait_for_tasks(
    config: ClusterConfig,
    timeout: float,
    tasks: Optional[Sequence[tuple[str, int]]] = None,
    hold_own_port: bool = True,
    source: str = "TF_CONFIG",
    poll_seconds: float = 0.25,
) -> float:
    """Waits until every other task of the job accepts a connection; returns the seconds it took.

    TensorFlow's start-up of a multi-process job blocks in C++, holding the
    GIL, with no timeout of its own that covers a task that never starts: it
    waited over 11 minutes and ignored SIGTERM and Ctrl-C (issue 15). This
    wait runs first, in Python, so a signal ends it, and it ends in an error
    naming the tasks that did not answer. With `hold_own_port`, this task
    listens on its own port meanwhile, so that peers waiting the same way see
    it (and so that a port already taken is named at once); the socket is
    closed before TensorFlow's server binds the port.

    Args:
        config: this process's `ClusterConfig`.
        timeout: float. Seconds to wait before giving up.
        tasks: Optional list of `(job, index)` to wait for; default every
            other task of the cluster.
        hold_own_port: bool. Listen on this task's port while waiting.
        source: str. Where the cluster came from, the prefix of messages.
        poll_seconds: float. Pause between rounds of connection attempts.

    Raises:
        StartupTimeoutError: some task did not answer within `timeout`; the
            message names each with its address and what its address did.
        ClusterConfigError: this task's port is in use by another process.

    Example:

    ```python
    config = tfdist.cluster.parse_tf_config()
    tfdist.cluster.wait_for_tasks(config, timeout=60)
    ```
    """
    start = time.monotonic()
    if config.address is not None and config.address in _SERVING:
        # This process already runs the task's server (an earlier strategy of
        # the same job): its port is its own, and its peers answered then.
        return 0.0
    if tasks is None:
        me = (config.task_type, config.task_id)
        tasks = [(job, i) for job, addrs in config.cluster.items() for i in range(len(addrs)) if (job, i) != me]
    pending = {task_name(job, i): config.cluster[job][i] for job, i in tasks}
    listener = None
    if hold_own_port and config.address is not None:
        port = _split(config.address)[1]
        try:
            listener = _listen(port)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _port_in_use(config, port, source) from None
            raise
    why: dict[str, str] = {}
    # Ctrl-C while waiting ends the process at once, by the signal, as SIGTERM
    # does: nothing has started that needs cleaning up, and Python's own
    # unwinding through TensorFlow's exit handlers took over 10 s on a loaded host.
    previous_sigint = None
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous_sigint = signal.signal(signal.SIGINT, _die_by_signal)
    try:
        while pending:
            for name, address in list(pending.items()):
                left = timeout - (time.monotonic() - start)
                reason = _probe(address, timeout=max(0.05, min(1.0, left)))
                if reason is None:
                    del pending[name]
                else:
                    why[name] = reason
            if not pending:
                break
            if time.monotonic() - start >= timeout:
                me = task_name(config.task_type, config.task_id)
                missing = "; ".join(f"{name} at {address} ({why[name]})" for name, address in pending.items())
                raise StartupTimeoutError(
                    f"{source}: {me} waited {timeout:g} s (startup_timeout) for the other tasks of the "
                    f"job, and {len(pending)} of {len(tasks)} never answered: {missing}. Start every "
                    "task of the job (each runs the same script with its own TF_CONFIG), check their "
                    f"addresses, or wait longer with {_FLAG_HINT}."
                )
            time.sleep(poll_seconds)
    finally:
        if previous_sigint is not None:
            signal.signal(signal.SIGINT, previous_sigint)
        if listener is not None:
            listener.close()
    return time.monotonic() - start


def _die_by_signal(signum, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def startup_deadline(seconds: float) -> Iterator[None]:
    """Ends the process if the block (TensorFlow's blocking start-up) runs longer than `seconds`.

    TensorFlow's start-up call holds the GIL, so no Python code, signal
    handler included, runs until it returns. Inside the block Ctrl-C
    (SIGINT) ends the process at once (its default action), and after
    `seconds` a C thread of `faulthandler` prints `Timeout (h:mm:ss)!` and
    the Python stack (the TensorFlow call that blocked) to stderr and exits
    the process with status 1.
    """
    armed = False
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
        armed = True
    except (AttributeError, OSError, ValueError, RuntimeError):  # no stderr file descriptor (a notebook)
        armed = False
    previous = None
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

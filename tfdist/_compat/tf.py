"""TensorFlow private APIs, behind named functions: the only module that reaches into TensorFlow.

Each function names the private API it uses and the TensorFlow versions it was
verified on; workarounds name their upstream issue (or quote the upstream
error) and have a test that fails without them. Imports no other tfdist module.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import tensorflow as tf


def configure_variable_creation(strategy, on_read_devices=None) -> None:
    """Adjusts how `strategy` creates variables for Keras 3 layers and metrics.

    Four upstream gaps, all fixed at variable creation so no step code changes:

    1. Layer state is not kept in sync (no upstream fix as of Keras 3.15): Keras
       3 creates non-trainable layer state such as BatchNormalization's moving
       mean and variance with `aggregation="none"`. Under MirroredStrategy (and
       MultiWorkerMirroredStrategy, across workers) each replica then keeps its
       own moving averages of its own share of the batch, so the copies drift
       apart and a checkpoint holds replica 0's (the chief's);
       under CentralStorageStrategy the update fails outright ("You must
       specify an aggregation method to update a AggregatingVariable in
       Replica Context"). tf-keras created such state with MEAN aggregation;
       tfdist does the same for non-trainable floating-point variables created
       with aggregation NONE, so every replica holds the mean update.
    2. With `on_read_devices` (CentralStorageStrategy), keras-team/keras#21054:
       Keras 3 implements `Variable.assign_add` as `assign(self + value)`, and
       CentralStorageStrategy wraps metric state in an `AggregatingVariable`
       that SUMs what every replica assigns, so each update becomes
       `N * old + sum(updates)` and metrics grow without bound (accuracy 0.137
       where one device gives 0.122 on the bundled digits). Such ON_READ state
       is instead created per compute device (a `SyncOnReadVariable`, as
       MirroredStrategy does): local updates, summed when read.
    3. With `on_read_devices` (CentralStorageStrategy): a model with `Dropout`
       (or any layer drawing random numbers) fails in `fit` with the same "You
       must specify an aggregation method to update a AggregatingVariable"
       error (no upstream issue for CentralStorageStrategy that we know of).
       Since the fix of keras-team/keras#20611 (Dropout failing under
       MirroredStrategy in Keras 3.7; proposed in keras-team/keras#20612),
       Keras creates `SeedGenerator`'s int64 state with `aggregation="none"`,
       like `tf.random.Generator`: under MirroredStrategy each replica then
       advances its own copy, identically; the single copy
       CentralStorageStrategy keeps cannot be assigned from a replica without
       an aggregation, and MEAN is refused for integers. Non-trainable,
       non-floating state created with aggregation NONE (seed generators,
       integer counters) gets ONLY_FIRST_REPLICA there: every replica reads
       the same state, and replica 0's update is written once per step, so a
       seed generator advances exactly as on one device and as each copy does
       under MirroredStrategy (a replica-dependent update keeps replica 0's,
       as a MirroredStrategy checkpoint does). MirroredStrategy keeps NONE:
       its copies already advance together without a cross-device write.

    4. A variable first created while a `tf.function` traces (Keras builds a
       model's and an optimizer's variables at their first use, and
       TensorFlow's `distribute/custom_training` tutorial first calls them
       inside `strategy.run` in a traced step) is "lifted" by TensorFlow:
       created outside the function and initialised by the function's first
       call under a `cond`, whose branch fails under MirroredStrategy ("You
       must feed a value for placeholder tensor 'cond/else/_1/cond/
       Placeholder_1'"; stock `tf.distribute.MirroredStrategy` alike; no
       upstream fix as of TensorFlow 2.21). A variable whose initial value is
       a callable (Keras's initializers) is created and initialised at
       once, outside the function (`tf.init_scope`), as building first would;
       one whose initial value reads the traced function's tensors is left to
       TensorFlow.

    Verified on TensorFlow 2.16 to 2.21 with Keras 3.10 to 3.15 (items 3 and 4 on
    TensorFlow 2.21 with Keras 3.15).
    """
    from tensorflow.python.distribute import distribute_utils

    extended = strategy.extended
    original = extended._create_variable

    def create_variable(next_creator, **kwargs):
        if tf.inside_function() and callable(kwargs.get("initial_value")):
            # (4) A variable first created while a function traces is created
            # and initialised now, outside it.
            try:
                with tf.init_scope():
                    return create(next_creator, **kwargs)
            except (TypeError, ValueError, tf.errors.InvalidArgumentError):
                pass  # an initial value that reads the traced function's tensors: TensorFlow's own way
        return create(next_creator, **kwargs)

    def create(next_creator, **kwargs):
        synchronization = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        if on_read_devices and synchronization == tf.VariableSynchronization.ON_READ:
            return _create_per_device(strategy, on_read_devices, next_creator, distribute_utils, **kwargs)
        if (
            not kwargs.get("trainable", True)
            and synchronization != tf.VariableSynchronization.ON_READ
            and kwargs.get("aggregation", tf.VariableAggregation.NONE) == tf.VariableAggregation.NONE
        ):
            aggregation = _state_aggregation(_creation_dtype(kwargs), single_copy=bool(on_read_devices))
            if aggregation is not None:
                kwargs["aggregation"] = aggregation
        return original(next_creator, **kwargs)

    extended._create_variable = create_variable


def _creation_dtype(kwargs):
    """The dtype of the variable `kwargs` create, or None when only the initializer knows it."""
    dtype = kwargs.get("dtype")
    if dtype is None and not callable(kwargs.get("initial_value")):
        dtype = getattr(kwargs.get("initial_value"), "dtype", None)
    return None if dtype is None else tf.as_dtype(dtype)


def _state_aggregation(dtype, single_copy: bool):
    """Aggregation for non-trainable state created with NONE, or None to keep NONE.

    Floating-point state is averaged over replicas (BatchNorm's moving
    statistics). Other state — integer seed-generator state, counters, or a
    dtype not known at creation — only needs a replica-context write where
    there is a single copy (`single_copy`, CentralStorageStrategy), where
    replica 0's value is written (a seed generator's is every replica's).
    """
    if dtype is not None and dtype.is_floating:
        return tf.VariableAggregation.MEAN
    if single_copy:
        return tf.VariableAggregation.ONLY_FIRST_REPLICA
    return None


def _create_per_device(strategy, devices, next_creator, distribute_utils, **kwargs):
    kwargs.pop("colocate_with", None)

    def per_device_creator(**kw):
        values = []
        for i, device in enumerate(devices):
            with tf.device(device):
                if i > 0:
                    kw["name"] = "{}/replica_{}/".format(values[0].name.split(":")[0], i)
                values.append(next_creator(**kw))
        return values

    return distribute_utils.create_mirrored_variable(
        strategy,
        per_device_creator,
        distribute_utils.VARIABLE_CLASS_MAPPING,
        distribute_utils.VARIABLE_POLICY_MAPPING,
        **kwargs,
    )


_next_collective_key_base = [0]


def isolate_collective_keys(strategy) -> None:
    """Gives `strategy` collective group keys no other strategy in the process uses.

    Upstream (tensorflow/tensorflow#61314, #62790): every MirroredStrategy and
    MultiWorkerMirroredStrategy starts its collective group keys at 1, so a
    second strategy over a different device set in the same process (a
    notebook, a test suite, a hyper-parameter loop) joins the first one's group
    and fails with "Device ... is joining a group with size 4, but that group
    has size 2". Call before the strategy's `__init__`; processes of one
    multi-worker job create their strategies in the same order, so their keys
    still agree. Verified on TensorFlow 2.16 to 2.21.
    """
    _next_collective_key_base[0] += 100_000
    strategy._collective_key_base = _next_collective_key_base[0]


def colocate_slots_with_shards(strategy) -> None:
    """Makes optimizer slots of a partitioned variable partitioned alike, shard by shard.

    Upstream: Keras 3's TensorFlow optimizer creates each slot inside
    `strategy.extended.colocate_vars_with(variable)`; for a `ShardedVariable`,
    ParameterServerStrategy does not partition the slot and colocates it with
    nothing, so Adam's moments of a partitioned embedding land on the chief
    ("/job:chief/.../CPU:0") and every step ships them across the network. Here
    each slot of a sharded variable is itself a `ShardedVariable` whose shard i
    lives with shard i of the variable. Verified on TensorFlow 2.16 to 2.21.
    """
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    extended = strategy.extended
    original = extended._create_variable

    def create_variable(next_creator, **kwargs):
        reference = kwargs.get("colocate_with")
        if not isinstance(reference, ShardedVariable):
            return original(next_creator, **kwargs)
        initial = kwargs.pop("initial_value")
        full = initial() if callable(initial) else initial
        full = tf.convert_to_tensor(full, dtype=kwargs.get("dtype"))
        name = kwargs.get("name")
        parts, offset = [], 0
        for i, shard in enumerate(reference.variables):
            rows = int(shard.shape[0])
            part_kwargs = dict(kwargs)
            part_kwargs["colocate_with"] = shard
            part_kwargs["initial_value"] = full[offset : offset + rows]
            part_kwargs["shape"] = full[offset : offset + rows].shape
            if name is not None:
                part_kwargs["name"] = f"{name}/part_{i}"
            parts.append(original(next_creator, **part_kwargs))
            offset += rows
        return ShardedVariable(parts)

    extended._create_variable = create_variable


# Collective ops stay outside XLA: each replica's XLA computation is a separate
# launch on CPU, so they cannot be compiled into it.
_NOT_XLA_OPS = frozenset(
    {
        "CollectiveReduce",
        "CollectiveReduceV2",
        "CollectiveReduceV3",
        "CollectiveGather",
        "CollectiveGatherV2",
        "CollectiveBcastSend",
        "CollectiveBcastRecv",
        "CollectiveBcastSendV2",
        "CollectiveBcastRecvV2",
        "CollectiveAllToAllV2",
        "CollectiveAllToAllV3",
        "CollectiveReduceScatterV2",
        "NcclAllReduce",
        "Placeholder",
    }
)


@contextlib.contextmanager
def xla_compiled_ops(skip=None):
    """Marks the ops created in the block for XLA compilation (no-op when eager).

    `skip`: optional callable `(graph, index) -> bool`; the op at `index` in
    `graph.get_operations()` stays unmarked when it returns True (a custom
    `train_step`'s reduction and update, created inside the block).

    Upstream (TF 2.21 / Keras 3.15): `model.compile(jit_compile=True)` under a
    2-device MirroredStrategy fails with InvalidArgumentError, because Keras
    wraps the whole train step — the optimizer's gradient all-reduce, a
    `merge_call`, included — in `tf.function(jit_compile=True)`. tfdist sets
    `_XlaCompile` on the ops of each replica's forward and backward pass
    instead: what `tf.xla.experimental.jit_scope` does, but per op, because
    MirroredStrategy's replica threads interleave at a collective (synchronized
    BatchNorm) and would leak a graph-wide scope to each other. TensorFlow's
    clustering pass then compiles the marked ops of each device with XLA
    (`_XlaCompile`/`_XlaRun` in the executed graph) and leaves collectives, and
    any op XLA has no kernel for, outside. Verified on TensorFlow 2.16 to 2.21.
    """
    if tf.executing_eagerly():
        yield
        return
    from tensorflow.core.framework import attr_value_pb2

    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    try:
        yield
    finally:
        for index, op in enumerate(graph.get_operations()[before:], start=before):
            if op.type in _NOT_XLA_OPS or (skip is not None and skip(graph, index)):
                continue
            op._set_attr("_XlaCompile", attr_value_pb2.AttrValue(b=True))
            op._set_attr("_XlaScope", attr_value_pb2.AttrValue(s=b"tfdist_replica_step"))


def distribute_dataset(strategy, dataset, options, distribute):
    """`distribute(dataset, options)`, working around a TensorFlow bug for central storage.

    Upstream (TensorFlow 2.4 to 2.21, no issue filed that we know of):
    `CentralStorageStrategy.experimental_distribute_dataset` reads
    `options.experimental_replication_moden` (a typo) whenever `options` is
    given, so any `tf.distribute.InputOptions` fail with `AttributeError`. Its
    override only rejects `InputReplicationMode.PER_REPLICA`; this does the
    same check and calls the base `Strategy.experimental_distribute_dataset`.
    Verified on TensorFlow 2.21.

    Args:
        strategy: the strategy distributing the dataset.
        dataset: the `tf.data.Dataset`.
        options: `tf.distribute.InputOptions` or `None`.
        distribute: the strategy's own `experimental_distribute_dataset`.
    """
    central = tf.distribute.experimental.CentralStorageStrategy
    if options is None or not isinstance(strategy, central):
        return distribute(dataset, options)
    if options.experimental_replication_mode == tf.distribute.InputReplicationMode.PER_REPLICA:
        raise NotImplementedError(
            "InputReplicationMode.PER_REPLICA is only supported in "
            "`distribute_datasets_from_function`."
        )
    return tf.distribute.Strategy.experimental_distribute_dataset(strategy, dataset, options)


def in_multi_worker_mode(strategy) -> bool:
    """Whether `strategy` spans several workers (`StrategyExtended._in_multi_worker_mode`, TF 2.4 to 2.21)."""
    return bool(strategy.extended._in_multi_worker_mode())


def update_replica_id():
    """Inside `strategy.extended.update`'s function: the replica being updated (a Python int)."""
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib.get_update_replica_id()


def trackable_list(items: Sequence):
    """A list TensorFlow checkpoints as a trackable list, as Keras's own lists are."""
    from tensorflow.python.trackable import data_structures

    return data_structures.ListWrapper(list(items))


def canonical_checkpoint_value(read_fn, write_fn, shape):
    """A trackable that checkpoints as a plain variable of `shape`, read and written by callables.

    `tf.train.Checkpoint` saves it under `.ATTRIBUTES/VARIABLE_VALUE`, the key
    a `tf.Variable` uses, so a sharded optimizer's checkpoint has the keys
    and shapes of a single-device one and either restores the other.
    """
    from tensorflow.python.trackable import base as trackable_base

    class CanonicalValue(trackable_base.Trackable):
        def _serialize_to_tensors(self):
            return {trackable_base.VARIABLE_VALUE_KEY: read_fn()}

        def _restore_from_tensors(self, restored_tensors):
            value = restored_tensors[trackable_base.VARIABLE_VALUE_KEY]
            if tuple(value.shape) != tuple(shape):
                raise ValueError(
                    f"Checkpointed optimizer state has shape {tuple(value.shape)}; this model's "
                    f"needs {tuple(shape)}. The checkpoint belongs to a different model."
                )
            return write_fn(value)

    return CanonicalValue()


def refuse_tf_keras_variables(strategy, message: str) -> None:
    """Makes `strategy` raise `NotImplementedError(message)` when tf-keras creates a variable in its scope.

    tf-keras drives `tf.distribute` strategies itself and would silently
    train as plain mirrored replicas, ignoring the strategy's own step.
    """
    import sys

    original = strategy.extended._create_variable

    def create_variable(next_creator, **kwargs):
        frame = sys._getframe(1)
        for _ in range(40):
            if frame is None:
                break
            if frame.f_globals.get("__name__", "").startswith("tf_keras."):
                raise NotImplementedError(message)
            frame = frame.f_back
        return original(next_creator, **kwargs)

    strategy.extended._create_variable = create_variable


def replica_id_in_sync_group(strategy, local_replica: int) -> int:
    """The job-wide replica id of this worker's `local_replica`-th device.

    `distribute_lib.get_update_replica_id()` (and the order of
    `experimental_local_results`) count this worker's replicas only;
    `replica_id_in_sync_group` counts every replica of every worker
    (`worker index * local replicas + local id` under
    MultiWorkerMirroredStrategy, the local id under MirroredStrategy). The
    mapping is TensorFlow's private `_get_replica_id_in_sync_group`, verified
    on TensorFlow 2.21.
    """
    return int(strategy.extended._get_replica_id_in_sync_group(local_replica))


def dataset_graph_def(dataset) -> bytes:
    """The serialized `GraphDef` of a `tf.data.Dataset` (its private `_as_serialized_graph`)."""
    return dataset._as_serialized_graph().numpy()


def dataset_inputs(dataset) -> list:
    """The datasets `dataset` reads from: TensorFlow's private `Dataset._inputs()`, verified on 2.21.

    Where TensorFlow lacks it (or a dataset does not implement it), `[]`:
    callers then look at the last transformation only.
    """
    inputs = getattr(dataset, "_inputs", None)
    try:
        return list(inputs()) if callable(inputs) else []
    except NotImplementedError:
        return []


def shard_trainable_variables(strategy, devices: Sequence[str]) -> None:
    """Makes `strategy` (a MirroredStrategy) hold each trainable variable as shards over `devices`.

    For the sharded optimizer's stage 3: a trainable floating-point variable
    of rank >= 1 created in the scope becomes a `ShardedVariable` of
    `min(len(devices), rows)` parts split along axis 0 (rows as even as
    they come), part i a plain variable on `devices[i]`; reading it in a
    replica concatenates the parts there (TensorFlow copies each part to the
    replica's device), assigning it splits the value. A variable created with
    `colocate_with` a `ShardedVariable` (Keras's optimizer slots:
    `add_variable_from_reference` runs inside
    `extended.colocate_vars_with(variable)`) is split the same way, part i
    beside part i. Every other variable is created as before (mirrored).

    Private API: `MirroredExtended._create_variable` (the strategy's variable
    creator) and `_validate_colocate_with_variable`, which accepts only
    `DistributedVariable`s ("`colocate_vars_with` must only be passed a
    variable created in this tf.distribute.Strategy.scope()") and so refuses
    a `ShardedVariable` slot reference; and `MirroredExtended._update`
    (behind `extended.update`), which asserts its variable is a
    `DistributedVariable` (a bare `AssertionError` when Keras's optimizer
    writes the EMA averages into the weights at the end of `fit`,
    `_overwrite_model_variables_with_average_value`): a `ShardedVariable` is
    written in place. Verified on TensorFlow 2.21.
    """
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    extended = strategy.extended
    original = extended._create_variable
    original_validate = extended._validate_colocate_with_variable
    devices = list(devices)

    def evaluate(kwargs):
        initial = kwargs.pop("initial_value")
        with tf.init_scope():
            full = initial() if callable(initial) else initial
            return tf.convert_to_tensor(full, dtype=kwargs.get("dtype"))

    def create_parts(next_creator, kwargs, full, rows_and_devices):
        name = kwargs.pop("name", None) or "Variable"
        kwargs.pop("shape", None)
        parts, offset = [], 0
        for i, (rows, device) in enumerate(rows_and_devices):
            with tf.init_scope(), tf.device(device):
                # A copy: a slice at an aligned offset shares the whole value's buffer, which
                # each part would then keep alive (every slot a whole variable's size besides its parts).
                value = tf.raw_ops.DeepCopy(x=full[offset : offset + rows])
                part_kwargs = dict(kwargs, initial_value=value, name=f"{name}/part_{i}")
                parts.append(next_creator(**part_kwargs))
            offset += rows
        return ShardedVariable(parts, name=name)

    def create_variable(next_creator, **kwargs):
        reference = kwargs.pop("colocate_with", None)
        if isinstance(reference, ShardedVariable):
            full = evaluate(kwargs)
            return create_parts(
                next_creator, kwargs, full, [(int(p.shape[0]), p.device) for p in reference.variables]
            )
        if reference is not None:
            kwargs["colocate_with"] = reference
        dtype = _creation_dtype(kwargs)
        if (
            reference is not None
            or not kwargs.get("trainable", True)
            or kwargs.get("synchronization", tf.VariableSynchronization.AUTO) == tf.VariableSynchronization.ON_READ
            or (dtype is not None and not dtype.is_floating)
        ):
            return original(next_creator, **kwargs)
        full = evaluate(kwargs)
        if not full.dtype.is_floating or full.shape.rank == 0 or full.shape[0] == 0:
            return original(next_creator, initial_value=full, **kwargs)
        rows = int(full.shape[0])
        count = min(len(devices), rows)
        split = [rows // count + (1 if i < rows % count else 0) for i in range(count)]
        return create_parts(next_creator, kwargs, full, list(zip(split, devices)))

    def validate_colocate_with_variable(variable):
        if isinstance(variable, ShardedVariable):
            return
        original_validate(variable)

    original_update = extended._update

    def update(var, fn, args, kwargs, group):
        if isinstance(var, ShardedVariable):
            # Written where its parts live (it splits what is assigned).
            return fn(var, *args, **kwargs)
        return original_update(var, fn, args, kwargs, group)

    extended._create_variable = create_variable
    extended._validate_colocate_with_variable = validate_colocate_with_variable
    extended._update = update


@contextlib.contextmanager
def cpu_devices_per_worker(k: int):
    """While a MultiWorkerMirroredStrategy initialises inside: K local CPU devices per worker.

    Private API: `CollectiveAllReduceExtended._initialize_local_devices`,
    which gives a worker without GPUs or TPUs exactly one replica, its
    `CPU:0` (TensorFlow 2.21: "num_local_devices = 1"), so logical CPU
    devices (`tfdist.configure_local_devices`) never join the job. Inside,
    a CPU worker's local devices are its `CPU:0` to `CPU:K-1`, and the
    collective group is K devices of every worker (TensorFlow's ring over
    all of them, each worker's devices adjacent). GPU and TPU workers are
    unchanged. Verified on TensorFlow 2.21.
    """
    from tfdist._compat import patches

    def wrap(original):
        def initialize_local_devices(self, cluster_resolver, worker_device):
            devices, kind = original(self, cluster_resolver, worker_device)
            if kind != "CPU":
                return devices, kind
            return tuple(f"{worker_device}/device:CPU:{i}" for i in range(k)), kind

        return initialize_local_devices

    # The registry's temporary patch: undone when the strategy has initialised.
    with patches.temporarily("CollectiveAllReduceExtended._initialize_local_devices", wrap):
        yield


def worker_leader_all_reduce(strategy):
    """A hierarchical sum for a multi-worker strategy with several CPU replicas per worker, or None.

    Returns `exchange(ctx, buffers) -> sums`, to call in replica context with
    dense buffers of equal shape on every replica: each buffer is summed over
    the worker's local replicas on its first device, all-reduced across the
    workers by a collective group of one device per worker, and the sum copied
    back to every local device. The cross-worker ring then has W members and
    every worker sends 2 (W - 1) / W of each buffer over gRPC, where
    TensorFlow's one collective over all W x K devices sends 2 (W K - 1) /
    (W K) of it in W x K ring steps.

    Private API: the group of one device per worker is the strategy's own
    `CollectiveAllReduceExtended._host_cross_device_ops` (TensorFlow's
    per-host collective, created with the strategy's `CollectiveKeys`, so its
    group key agrees on every worker) and its `CollectiveReplicaLauncher`,
    whose `all_reduce` chains the collectives by its own ordering token.
    Verified on TensorFlow 2.21. Returns None, so the exchange stays
    TensorFlow's, where those parts are missing or the host device is not the
    worker's first replica device (GPU workers).
    """
    from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
    from tensorflow.python.distribute import device_util
    from tensorflow.python.distribute import values as values_lib

    extended = strategy.extended
    host = getattr(extended, "_host_cross_device_ops", None)
    launchers = getattr(host, "_launchers", None)
    devices = tuple(extended.worker_devices)
    if (
        not isinstance(host, cross_device_ops_lib.CollectiveAllReduce)
        or not launchers
        or len(launchers) != 1
        or not hasattr(launchers[0], "all_reduce")
        or len(devices) < 2
        or device_util.canonicalize(getattr(extended, "_worker_device", "")) != device_util.canonicalize(devices[0])
    ):
        return None
    launcher, leader = launchers[0], devices[0]

    def exchange(ctx, buffers):
        def merged(strategy, *per_replica):
            sums = []
            for value in per_replica:
                parts = strategy.experimental_local_results(value)
                with tf.device(leader):
                    local = tf.math.add_n(list(parts))
                total = launcher.all_reduce(local)
                copies = []
                for device in devices:
                    with tf.device(device):
                        copies.append(tf.identity(total))
                sums.append(values_lib.PerReplica(copies))
            return sums

        return list(ctx.merge_call(merged, args=tuple(buffers)))

    return exchange


def all_gather_equal_shapes(value):
    """Replica context: every replica's `value` concatenated along axis 0, in one collective.

    `ReplicaContext.all_gather` lets the replicas' first dimensions differ, so
    over collective ops it gathers every replica's shape first and then the
    padded values: two collectives, each a round trip between workers
    (`CollectiveReplicaLauncher.all_gather`, tensorflow/python/distribute/
    cross_device_utils.py, TensorFlow 2.16 to 2.21). Where every replica's
    `value` has the same static shape (the sharded optimizer's equal chunks)
    the second is the whole gather: this calls each local device's
    `CollectiveReplicaLauncher._all_gather` directly (same group, keys and
    ordering token as TensorFlow's own). Other cross-device ops (a reduction
    to one device on a CPU-only MirroredStrategy) gather as TensorFlow does.
    """
    from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
    from tensorflow.python.distribute import values as values_lib

    ctx = tf.distribute.get_replica_context()
    extended = ctx.strategy.extended
    get_ops = getattr(extended, "_get_cross_device_ops", None)
    cross = get_ops(value) if get_ops is not None else None
    launchers = getattr(cross, "_launchers", None)
    if (
        not isinstance(cross, cross_device_ops_lib.CollectiveAllReduce)
        or launchers is None
        or len(launchers) != len(extended.worker_devices)
        or not value.shape.is_fully_defined()
        or not all(hasattr(launcher, "_all_gather") for launcher in launchers)
    ):
        return ctx.all_gather(value, axis=0)

    def gather(strategy, per_replica):
        parts = strategy.experimental_local_results(per_replica)
        return values_lib.PerReplica([launcher._all_gather(part, None) for launcher, part in zip(launchers, parts)])

    return ctx.merge_call(gather, args=(value,))


def read_xspace(path: str):
    """The `XSpace` protocol buffer of a profile `tf.profiler.experimental.stop()` wrote to `path`.

    TensorFlow writes a profile as `<logdir>/plugins/profile/<run>/<host>.xplane.pb`
    and has no public reader for it: this parses it with the message class
    TensorFlow ships, `tensorflow.tsl.profiler.protobuf.xplane_pb2.XSpace`
    (planes → lines → events; event and stat metadata per plane). Verified on
    TensorFlow 2.21. (The bytes `ProfilerSession.stop()` returns in memory are
    not this message: parsing them fails with "String field had bad UTF-8".)
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with open(path, "rb") as f:
        return xplane_pb2.XSpace.FromString(f.read())


def first_replica_spec(spec):
    """`spec` with each per-replica spec (`PerReplicaSpec`, a distributed iterator's elements) as its first replica's.

    `PerReplicaSpec` keeps its components in `_value_specs` (TensorFlow 2.16 to
    2.21, tensorflow/python/distribute/values.py); no public accessor exists.
    """

    def first(s):
        values = getattr(s, "_value_specs", None)
        return values[0] if values else s

    return tf.nest.map_structure(first, spec, expand_composites=False)
# ---------------------------------------------------------------------------
# The coordination service's key-value store (tfdist.preemption). Verified on
# TensorFlow 2.16 to 2.21: `context.set_config_key_value` raises
# AlreadyExistsError for a key that exists, `get_config_key_value(key,
# timeout_in_ms)` blocks (releasing the GIL) and raises DeadlineExceededError.
# ---------------------------------------------------------------------------


def coordination_service_enabled() -> bool:
    """Whether this process's eager context talks to a coordination service (a multi-worker job)."""
    from tensorflow.python.eager import context

    return bool(context.context().coordination_service)


def insert_key_value(key: str, value: str) -> bool:
    """Stores `key` in the job's coordination service; False when another task stored it first."""
    from tensorflow.python.eager import context

    try:
        context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    return True


def get_key_value(key: str, timeout_s: float):
    """The value of `key` in the job's coordination service, waiting up to `timeout_s`; None after that."""
    from tensorflow.python.eager import context

    try:
        return context.context().get_config_key_value(key, max(1, int(timeout_s * 1000)))
    except tf.errors.DeadlineExceededError:
        return None


@contextlib.contextmanager
def cross_replica_in_this_thread(strategy):
    """Replica context of a one-replica `strategy`: cross-replica context in this thread and graph.

    What TensorFlow's base `ReplicaContext._merge_call` does for a
    one-replica strategy (`tensorflow/python/distribute/distribute_lib.py`,
    "Default implementation for single replica": `_push_per_thread_mode(
    _CrossReplicaThreadMode(strategy))`, run the function, pop), without
    MirroredStrategy's hand-off to the main thread (`mirrored_run.
    _MirroredReplicaContext._merge_call`), which cannot leave a
    `tf.function` traced in the replica thread: where every replica is a GPU,
    `mirrored_run.call_for_each_replica` calls a jit-compiled function in each
    replica thread instead of lifting it, and a `merge_call` inside raises
    "`merge_call` called while defining a new graph or a tf.function". With
    one replica the merge has nothing to merge: the block sees the replica's
    values as they are, and `strategy.extended.update` writes the one copy
    of each variable. Private API: `distribute_lib._push_per_thread_mode`,
    `_pop_per_thread_mode`, `_CrossReplicaThreadMode`; verified on
    TensorFlow 2.21.
    """
    from tensorflow.python.distribute import distribute_lib

    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync != 1:
        raise RuntimeError(
            "cross_replica_in_this_thread needs the replica context of a strategy with one replica; "
            f"got {'cross-replica context' if ctx is None else f'{ctx.num_replicas_in_sync} replicas'}."
        )
    distribute_lib._push_per_thread_mode(distribute_lib._CrossReplicaThreadMode(strategy))
    try:
        yield
    finally:
        distribute_lib._pop_per_thread_mode()


# The modules whose `_is_gpu_device(device)` decides TensorFlow's GPU-only branches of
# MirroredStrategy and MultiWorkerMirroredStrategy (TensorFlow 2.21): `mirrored_run` (a
# jit-compiled function passed to `strategy.run` is called in each replica thread, not
# lifted), `mirrored_strategy` and `collective_all_reduce_strategy` (`_use_merge_call`:
# inside XLA, replica-context all-reduces and variable writes skip `merge_call`).
_GPU_PREDICATE_MODULES = ("mirrored_run", "mirrored_strategy", "collective_all_reduce_strategy")


def gpu_predicate_modules() -> dict:
    """`{module name: module}` of the TensorFlow modules whose `_is_gpu_device` `devices_read_as_gpu` replaces."""
    from tensorflow.python.distribute import collective_all_reduce_strategy, mirrored_run, mirrored_strategy

    modules = {
        "mirrored_run": mirrored_run,
        "mirrored_strategy": mirrored_strategy,
        "collective_all_reduce_strategy": collective_all_reduce_strategy,
    }
    assert tuple(modules) == _GPU_PREDICATE_MODULES
    return modules


@contextlib.contextmanager
def devices_read_as_gpu():
    """For tests and the CPU smoke of `benchmarks/gpu_check.py`: TensorFlow's GPU-only strategy branches, on CPU.

    Inside, every device reads as a GPU to the `_is_gpu_device` predicates
    of `tensorflow/python/distribute/mirrored_run.py` (`call_for_each_replica`:
    a jit-compiled `tf.function` is not lifted, each replica thread calls
    it), `mirrored_strategy.py` and `collective_all_reduce_strategy.py`
    (`_use_merge_call`: False inside XLA, so replica-context all-reduces
    and writes to mirrored variables skip `merge_call`). The cross-device
    ops TensorFlow chose at the strategy's creation are unchanged (they are
    chosen from the device strings, `_make_collective_ops_with_fallbacks`).
    Never used by the library itself. Verified on TensorFlow 2.21.
    """
    modules = gpu_predicate_modules()
    originals = {name: module._is_gpu_device for name, module in modules.items()}
    for module in modules.values():
        module._is_gpu_device = lambda device: True
    try:
        yield
    finally:
        for name, module in modules.items():
            module._is_gpu_device = originals[name]

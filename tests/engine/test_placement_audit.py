"""Placement audit of the training step on 2 logical CPU devices: where each op runs, what crosses devices.

One step of `fit` runs with TensorFlow's run metadata on, which records the
graphs the runtime executed after placement and partitioning
(`RunMetadata.function_graphs[...].partition_graphs`): every op with the
device the placer gave it, and a `_Send`/`_Recv` pair for every tensor or
control edge between two devices. Counted per strategy, in the function that
holds the step (the one with replica 1's ops), against mirrored's, which
keeps every replica's work on its own device:

* every op of replica 1 (TensorFlow names them `replica_1/...`) runs on
  replica 1's device, except reads of variables the strategy keeps on
  another device (central_storage's parameter device, stage 3's parts);
* the cross-device copies: control edges, and data edges by dtype. On GPUs
  every one is a `_Send`/`_Recv` whose receiver waits until the sender's
  stream has run everything before it (`GPUUtil::DeviceToDeviceCopy`), so a
  copy mirrored does not have is a synchronisation of the two devices a
  mirrored step does not pay.

What the audit found in the sharded optimizer (issue 36: stage 2 at 0.24x
mirrored's samples/s on 2 logical GPUs of an H200, faster than mirrored on
CPU): (1) each replica's piece of a summed gradient and each variable's piece
of a gathered bucket was copied out with `DeepCopy`, which is stateful, and
TensorFlow's automatic control dependencies run every stateful op without a
resource input in program order, across devices: the replicas' copies were
chained replica 0, replica 1, replica 0, ..., a cross-device control edge per
copy (23 control edges per step where mirrored has 6, on this model; more with
more buckets); (2) with the update on the whole slice (one bucket,
`shard_bucket_bytes=0`, across workers), each replica's updated slice was cut
into buckets by ops without a device, placed on the first replica's: replica
1's whole slice went to device 0 and back every step. Both fixed
(`collectives.copy_out`; the cut under the slice's device): stages 1 and 2 now
copy exactly what mirrored copies, but for one int32 scalar per collective
(its instance key, fed from the host function's device: host memory on a GPU
too).
"""

from __future__ import annotations

import collections
import dataclasses
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tfdist
from tests.conftest import DEVICES

# 4 Dense layers: 8 trainable variables.
VARIABLES = 8


@dataclasses.dataclass
class Audit:
    """What one step executed: cross-device copies, misplaced ops, collectives."""

    copies: collections.Counter  # (kind, "0>1" or "1>0", dtype class) -> count
    misplaced: list  # (op type, name) of replica 1's ops not on CPU:1 (reads of remote variables apart)
    remote_reads: int  # replica 1's ReadVariableOps on CPU:0 (variables kept there)
    collectives: collections.Counter  # (op type, device index) -> count
    int32_indices: collections.Counter  # (op type, device index) -> gathers/scatters indexed by int32

    def kind(self, kind: str) -> collections.Counter:
        return collections.Counter({k[1:]: v for k, v in self.copies.items() if k[0] == kind})


def _index(device: str) -> int:
    return tf.DeviceSpec.from_string(device).device_index


def _dtype_class(enum: int) -> str:
    dtype = tf.as_dtype(enum)
    return "float" if dtype.is_floating else dtype.name


# Ops reading or writing rows by index: on a GPU an int32 index tensor lives in host memory
# (TensorFlow's convention for int32, `HostConstantOp`) and is copied to the device for each
# of them, every step; an int64 one lives on the device.
_INDEXED = ("GatherV2", "ResourceGather", "ResourceScatterUpdate", "ResourceScatterAdd", "TensorScatterUpdate")

# Nodes the partitioner adds for a cross-device edge: `<name>/_<n>` receivers and senders.
_ARTEFACT = re.compile(r"/_\d+$")


def _audit(row: str, **options) -> Audit:
    name, _, stage = row.partition(" stage=")
    if stage:
        options["stage"] = int(stage)
    if name == "central_storage":
        strategy = tfdist.get_strategy(name, compute_devices=DEVICES[2], **options)
    else:
        strategy = tfdist.get_strategy(name, devices=DEVICES[2], **options)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)).astype("float32")
    y = rng.integers(0, 10, 64).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,))]
            + [keras.layers.Dense(128, activation="relu") for _ in range(3)]
            + [keras.layers.Dense(10)]
        )
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.export_run_metadata()  # drops what an earlier test left collected
    try:
        model.fit(x, y, batch_size=32, steps_per_epoch=1, shuffle=False, verbose=0)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    copies, collectives, int32_indices = collections.Counter(), collections.Counter(), collections.Counter()
    misplaced, remote_reads = [], 0
    for function in metadata.function_graphs:
        nodes = [n for graph in function.partition_graphs for n in graph.node]
        if not any("replica_1/" in n.name for n in nodes):
            continue  # the input pipeline's functions
        producers = {n.name: n for n in nodes}
        for n in nodes:
            if n.op.startswith("Collective"):
                collectives[n.op, _index(n.device)] += 1
            if n.op in _INDEXED and n.attr["Tindices"].type == tf.int32.as_datatype_enum:
                int32_indices[n.op, _index(n.device)] += 1
            if n.op in ("_Send", "_HostSend"):
                source = producers[n.input[0].split(":")[0]]
                kind = "control" if "/ctrl/" in source.name else "data"
                route = f"{_index(n.attr['send_device'].s.decode())}>{_index(n.attr['recv_device'].s.decode())}"
                copies[kind, route, "none" if kind == "control" else _dtype_class(n.attr["T"].type)] += 1
            if "replica_1/" in n.name and _index(n.device) != 1:
                if n.op.startswith("_") or (n.op == "Identity" and _ARTEFACT.search(n.name)):
                    continue
                if n.op == "ReadVariableOp":
                    remote_reads += 1
                else:
                    misplaced.append((n.op, n.name))
    return Audit(copies, misplaced, remote_reads, collectives, int32_indices)


CONFIGS = {
    "mirrored": ("mirrored", {}),
    "central_storage": ("central_storage", {}),
    # One bucket: the update on the whole slice, cut into its buckets after.
    "stage 1": ("sharded_optimizer stage=1", {}),
    # 16 KiB buckets: gradients summed in pieces, the update chunk by chunk, bucket-by-bucket all-gathers.
    "stage 2": ("sharded_optimizer stage=2", {"shard_bucket_bytes": 16384}),
    "stage 3": ("sharded_optimizer stage=3", {}),
}


@pytest.fixture(scope="module")
def audits():
    return {label: _audit(row, **options) for label, (row, options) in CONFIGS.items()}


def _replica_1_collectives(audit: Audit) -> int:
    return sum(v for (_, device), v in audit.collectives.items() if device == 1)


def test_mirrored_step_keeps_each_replica_on_its_device(audits):
    mirrored = audits["mirrored"]
    assert mirrored.misplaced == [] and mirrored.remote_reads == 0
    assert mirrored.collectives == {("CollectiveReduceV2", 0): 1, ("CollectiveReduceV2", 1): 1}
    # The host call's structure (a conditional on the iterator), replica 1's batch (x, y),
    # its collective's instance key, the optimizer's iteration count written to
    # replica 1's copy, the loss metric's two reads: nothing of the model's size.
    assert mirrored.copies == {
        ("control", "0>1", "none"): 4,
        ("control", "1>0", "none"): 2,
        ("data", "0>1", "float"): 1,  # x
        ("data", "0>1", "int32"): 2,  # y, the instance key
        ("data", "0>1", "int64"): 1,  # the iteration count
        ("data", "0>1", "bool"): 2,
        ("data", "1>0", "float"): 3,  # the loss metric's total and count, the call's output
        ("data", "1>0", "int32"): 1,
        ("data", "1>0", "bool"): 1,
    }


@pytest.mark.parametrize("stage", ["stage 1", "stage 2"])
def test_sharded_stages_1_and_2_copy_what_mirrored_copies(audits, stage):
    # Before the fix: 13 control edges device 0 -> 1 and 10 back (stage 1; more with more
    # buckets), and stage 1's updated slice (device 1 -> 0 -> 1) as two more float copies.
    mirrored, sharded = audits["mirrored"], audits[stage]
    assert sharded.misplaced == [] and sharded.remote_reads == 0
    assert sharded.kind("control") == mirrored.kind("control")
    expected = mirrored.kind("data")
    # One int32 scalar per collective of replica 1: its instance key, from the host
    # function's device (on a GPU an input in host memory, not a device copy).
    extra_keys = _replica_1_collectives(sharded) - _replica_1_collectives(mirrored)
    expected["0>1", "int32"] += extra_keys
    assert sharded.kind("data") == expected
    # The exchanges themselves are collectives, not copies: stage 1's one bucket is summed
    # in 2 all-reduces (the layers' groups), stage 2's 16 KiB pieces in 12; each bucket gathered once.
    reduces, gathers = {"stage 1": (2, 1), "stage 2": (12, 11)}[stage]
    assert sharded.collectives == {
        ("CollectiveReduceV2", 0): reduces, ("CollectiveReduceV2", 1): reduces,
        ("CollectiveGatherV2", 0): gathers, ("CollectiveGatherV2", 1): gathers,
    }
    # Rows read and written by int32 index (a host-to-device copy each on a GPU): none, as
    # mirrored. The update runs on per-chunk variables (no slot rows read by index; before:
    # 22 gathers and 22 scatters per device for Adam's slots over 11 buckets), and the
    # in-place writes of the gathered buckets index by int64 (before: 20 more gathers and 33
    # more scatters per device).
    assert mirrored.int32_indices == {}
    assert sharded.int32_indices == {}


def test_central_storage_and_stage_3_copy_what_their_layout_needs(audits):
    mirrored, central, stage3 = audits["mirrored"], audits["central_storage"], audits["stage 3"]
    # central_storage: replica 1 reads each variable from the parameter device (CPU:0) and
    # sends its packed gradient there (one bucket); no collective, no iteration-count copy.
    assert central.misplaced == [] and central.remote_reads == VARIABLES
    assert central.collectives == {}
    assert central.kind("data")["0>1", "float"] == mirrored.kind("data")["0>1", "float"] + VARIABLES
    assert central.kind("data")["1>0", "float"] == mirrored.kind("data")["1>0", "float"] + 1
    # Stage 3: each variable in 2 parts, one per device; per variable and direction, the
    # other device's part read for the gather (replica 1 reads part 0 where it lives) and
    # the replica's gradient of that part sent to its owner: the layout's exchange, by
    # copies. And one more per variable each way: the summed part 1 is concatenated with
    # part 0 on device 0 (`_sum_onto_parts`, no device), finished there, and its part cut
    # back to device 1 for the update (a round trip of a slice of the gradient; left, see
    # docs/gpu.md), plus replica 1's batch weight.
    assert stage3.misplaced == [] and stage3.remote_reads == VARIABLES
    assert stage3.collectives == {}
    assert stage3.kind("data")["0>1", "float"] == mirrored.kind("data")["0>1", "float"] + 3 * VARIABLES
    assert stage3.kind("data")["1>0", "float"] == mirrored.kind("data")["1>0", "float"] + 3 * VARIABLES + 1

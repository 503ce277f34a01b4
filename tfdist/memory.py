"""Bytes per device, by kind, from the variables a model holds; and the allocator's measured peak."""

from __future__ import annotations

import tensorflow as tf

from tfdist._compat import keras as kc
from tfdist.strategies.sharded import sharded_state

KINDS = ("weights", "optimizer_state", "parameter_shard", "gradient_buffers")


def _parts(variable) -> list:
    """The device-resident variables behind a Keras or TF variable."""
    v = kc.tf_variable(variable)
    if isinstance(v, tf.distribute.DistributedValues):
        return list(v.values)
    parts = getattr(v, "variables", None)  # ShardedVariable (variable partitioner)
    if isinstance(parts, (list, tuple)) and parts and parts[0] is not v:
        return list(parts)
    return [v]


def _nbytes(v) -> int:
    return int(v.shape.num_elements()) * tf.as_dtype(v.dtype).size


def _device(v) -> str:
    spec = tf.DeviceSpec.from_string(v.device)
    return spec.replace(job=None, replica=None, task=None).to_string() if spec.job == "localhost" else v.device


def memory_report(model) -> dict[str, dict[str, int]]:
    """Bytes per device by kind, measured from the model's variables and the step's buffers.

    Every variable is counted where it lives: each replica's copy of a
    mirrored variable on its device, each slice of a sharded optimizer's state
    on its replica's device, each part of a sharded variable (stage 3, or a
    partitioned parameter-server variable) on its device or task. Kinds:

    * `weights`: the model's variables (trainable and not).
    * `optimizer_state`: the optimizer's variables (slots, iteration count,
      learning rate, EMA averages).
    * `parameter_shard`: a float32 copy of a replica's slice of the
      parameters kept between steps (a "master" slice). 0: the sharded
      optimizer updates the slice it reads from the float32 weights and keeps
      no copy (it accepts float32 trainable variables only).
    * `gradient_buffers`: the reduced gradient each device holds per step:
      the whole gradient under all-reduce (mirrored, sharded stage 1), the
      summed gradient on the parameter device under central storage; under
      sharded stage 2, the replica's gradient slice plus the two buckets of
      the reduce-scatter that can be alive at once; under sharded stages 1
      and 2 once a step has reduced layer by layer, the replica's slice plus
      the largest group of layers' gradients; under stage 3, each parameter
      part's summed gradient on the part's device (each replica's local
      gradients and the gathered weights of the layer it runs are not
      counted). Transient, not variables.
    * `peak`: measured, not counted: the most bytes TensorFlow's allocator
      has held on the device (`tf.config.experimental.get_memory_info`) since
      the process started or `tf.config.experimental.reset_memory_stats`, on
      GPU and TPU devices of this process; `None` where TensorFlow does not
      report one (CPU devices, logical ones included, share the host allocator
      and keep no per-device statistics; measure the process's peak resident
      memory there, as `benchmarks/sharded_optimizer.py` does), and for
      devices of other processes. Not part of `total`.

    Args:
        model: a built Keras model (compiled if optimizer state should count;
            the optimizer is built by `fit` or `optimizer.build`).

    Returns:
        `{device: {kind: bytes, ..., "total": bytes, "peak": bytes or None}}`,
        devices sorted.

    Example:

    ```python
    report = tfdist.memory_report(model)
    report["/device:CPU:1"]["optimizer_state"]   # bytes of Adam state on replica 1
    ```
    """
    report: dict[str, dict[str, int]] = {}

    def add(device, kind, nbytes):
        entry = report.setdefault(device, {k: 0 for k in KINDS})
        entry[kind] += nbytes

    seen = set()

    def count(variables, kind):
        for variable in variables:
            for part in _parts(variable):
                if id(part) in seen:
                    continue
                seen.add(id(part))
                add(_device(part), kind, _nbytes(part))

    optimizer = getattr(model, "optimizer", None)
    sharded = sharded_state(optimizer)
    count(model.weights, "weights")
    if optimizer is not None:
        # A sharded optimizer's state copies that hold memory (whole-variable state on its owner only).
        count(optimizer.variables if sharded is None else sharded.held_state(), "optimizer_state")
    for device, nbytes in _gradient_buffers(model, sharded).items():
        add(device, "gradient_buffers", nbytes)
    for device, entry in report.items():
        entry["total"] = sum(entry[k] for k in KINDS)
        entry["peak"] = measured_peak(device)
    return dict(sorted(report.items()))


def measured_peak(device: str, memory_info=None) -> int | None:
    """TensorFlow's allocator peak on `device` in bytes, or `None` where it reports none.

    Args:
        device: a device string as `memory_report` keys it (`"/device:GPU:0"`).
        memory_info: callable `(device) -> {"current", "peak"}`; default
            `tf.config.experimental.get_memory_info`.
    """
    spec = tf.DeviceSpec.from_string(device)
    if spec.device_type not in ("GPU", "TPU") or spec.job not in (None, "localhost"):
        return None
    memory_info = memory_info or tf.config.experimental.get_memory_info
    try:
        return int(memory_info(f"{spec.device_type}:{spec.device_index or 0}")["peak"])
    except (ValueError, KeyError):  # a device TensorFlow keeps no statistics for
        return None


def _gradient_buffers(model, sharded) -> dict[str, int]:
    strategy = kc.model_strategy(model)
    trainable = model.trainable_variables
    if sharded is not None and sharded.built:
        devices = [_device(p) for p in sharded.replica_copies()]
        return {d: sharded.gradient_buffer_estimate() for d in devices}
    parameter_device = getattr(strategy, "parameter_device", None)
    out: dict[str, int] = {}
    for variable in trainable:
        parts = _parts(variable)
        if parameter_device is not None:
            destination = tf.DeviceSpec.from_string(parameter_device).to_string()
            out[destination] = out.get(destination, 0) + sum(_nbytes(p) for p in parts)
            continue
        for part in parts:
            out[_device(part)] = out.get(_device(part), 0) + _nbytes(part)
    return out

"""Bytes per device, by kind, measured from the variables a model actually holds."""

from __future__ import annotations

import tensorflow as tf

from tfdist._compat import keras as kc

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
    on its replica's device, a parameter-server variable on its task. Kinds:

    * `weights`: the model's variables (trainable and not).
    * `optimizer_state`: the optimizer's variables (slots, iteration count,
      learning rate, EMA averages).
    * `parameter_shard`: the sharded-optimizer strategy's float32 working
      slice of the parameters (the "master" slice the optimizer updates);
      0 elsewhere.
    * `gradient_buffers`: the reduced gradient each device receives per step
      from its strategy's collective: the whole gradient under
      all-reduce (mirrored, sharded stage 1, and sharded stage 2 where
      reduce-scatter falls back to all-reduce), the summed gradient on the
      parameter device under central storage. Transient, not variables.

    Args:
        model: a built Keras model (compiled if optimizer state should count;
            the optimizer is built by `fit` or `optimizer.build`).

    Returns:
        `{device: {kind: bytes, ..., "total": bytes}}`, devices sorted.

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
    sharded = kc.sharded_state(optimizer) if optimizer is not None else None
    count(model.weights, "weights")
    if sharded is not None and sharded.flat is not None:
        count([sharded.flat], "parameter_shard")
    if optimizer is not None:
        count(optimizer.variables, "optimizer_state")
    for device, nbytes in _gradient_buffers(model, sharded).items():
        add(device, "gradient_buffers", nbytes)
    for entry in report.values():
        entry["total"] = sum(entry[k] for k in KINDS)
    return dict(sorted(report.items()))


def _gradient_buffers(model, sharded) -> dict[str, int]:
    strategy = kc.model_strategy(model)
    trainable = model.trainable_variables
    if sharded is not None and sharded.layout is not None:
        layout = sharded.layout
        devices = [_device(p) for p in _parts(sharded.flat)]
        if sharded.gradient_buffer_bytes is not None:  # recorded when the step was traced
            return {d: sharded.gradient_buffer_bytes for d in devices}
        # Stage 1 all-reduces each gradient; stage 2's reduce-scatter runs as
        # chunked all-reduces of the padded flat vector (see
        # tfdist.collectives.reduce_scatter_sum).
        per_replica = layout.total * 4 if sharded.strategy.stage == 1 else (layout.total + layout.padding) * 4
        return {d: per_replica for d in devices}
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

"""A model's training FLOPs counted from a traced graph, and the device peak they are measured against.

FLOPs: the model's forward and backward pass on one batch is traced once
(`tf.function.get_concrete_function` on the batch's shapes, never run) and its
graph counted with TensorFlow's profiler (`tf.compat.v1.profiler.profile` with
`ProfileOptionBuilder.float_operation()`: the `flops` statistics TensorFlow
registers per op — MatMul 2·m·n·k, convolutions and their gradients, element-wise
ops, reductions). `Einsum`, which has no registered statistic, is counted here
(2 · the product of every index's size for two operands). Gradients are taken
with respect to the trainable variables only, as a training step does (the
first layer computes no gradient for its input). A sum of the outputs stands
in for the loss (a loss costs a few operations per output element); the
optimizer's update and the exchange are not counted. Ops inside a loop's body
(a recurrent layer's `tf.while_loop`) are not counted.

Peaks: on a GPU or TPU, a table of vendor peaks by device name and compute
dtype (dense, no sparsity); TensorFloat-32 is used for float32 where
TensorFlow enables it (its default on Ampere and later). On a CPU no table
means anything (cores, threads, vector units, load): the peak is measured, a
square matmul in the compute dtype on the device with TensorFlow's threads as
configured, best of three.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time

import tensorflow as tf

# Dense TFLOP/s per device from the vendors' datasheets: (float32, tf32, bfloat16, float16).
# tf32 None: the device has none; bfloat16 None: not supported.
GPU_PEAKS_TFLOPS = {
    "H200": (67.0, 494.7, 989.4, 989.4),
    "H100 PCIe": (51.2, 378.0, 756.0, 756.0),
    "H100": (67.0, 494.7, 989.4, 989.4),  # SXM5
    "A100": (19.5, 156.0, 312.0, 312.0),
    "L40S": (91.6, 183.0, 362.0, 362.0),
    "L4": (30.3, 60.0, 121.0, 121.0),
    "A10": (31.2, 62.5, 125.0, 125.0),
    "V100": (15.7, None, None, 125.0),
    "T4": (8.1, None, None, 65.0),
}
# Per chip, bfloat16 (what a TPU's matrix units compute; float32 matmuls run through them too).
TPU_PEAKS_TFLOPS = {"v6e": 918.0, "v5p": 459.0, "v5e": 197.0, "v5 lite": 197.0, "v4": 275.0, "v3": 123.0, "v2": 45.0}


def output_sum(outputs) -> tf.Tensor:
    leaves = [t for t in tf.nest.flatten(outputs) if t is not None]
    return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in leaves])


def _einsum_flops(op) -> int:
    """2 · product of every index's size for a two-operand Einsum (the product for one operand)."""
    equation = op.get_attr("equation").decode()
    inputs = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, tensor in zip(inputs, op.inputs):
        shape = tensor.shape
        if shape.rank is None or "." in letters or len(letters) != shape.rank:
            return 0
        for letter, size in zip(letters, shape.as_list()):
            if size is None:
                return 0
            sizes[letter] = size
    product = 1
    for size in sizes.values():
        product *= size
    return product * (2 if len(inputs) > 1 else 1)


@contextlib.contextmanager
def _quiet_tf_logging():
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # the v1 profiler's deprecation notice
    try:
        yield
    finally:
        logger.setLevel(level)


def graph_flops(graph) -> int:
    """Floating-point operations of one run of `graph` (a `tf.Graph`), by TensorFlow's op statistics.

    Example:

    ```python
    concrete = tf.function(lambda x: tf.matmul(x, x)).get_concrete_function(tf.TensorSpec([8, 8]))
    graph_flops(concrete.graph)   # 1024 = 2 * 8 * 8 * 8
    ```
    """
    profiler = tf.compat.v1.profiler
    options = profiler.ProfileOptionBuilder(profiler.ProfileOptionBuilder.float_operation()).with_empty_output()
    with _quiet_tf_logging():
        counted = profiler.profile(graph, options=options.build()).total_float_ops
    return int(counted) + sum(_einsum_flops(op) for op in graph.get_operations() if op.type == "Einsum")


def with_batch(spec, batch: int):
    shape = spec.shape
    if shape.rank is None or shape.rank == 0:
        return spec
    return tf.TensorSpec([batch] + shape.as_list()[1:], spec.dtype)


def input_specs(model, element_spec=None):
    """The structure of `TensorSpec`s the model is called on: its `input`, else `x` of the input's element spec."""
    try:
        structure = model.input  # a functional model's inputs as it declared them (a tensor, list or dict)
    except (AttributeError, ValueError):  # a subclassed model: none
        structure = None
    if structure is not None:
        return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), structure)
    if element_spec is None:
        return None
    from tfdist._compat import tf as tfc

    element_spec = tfc.first_replica_spec(element_spec)
    return element_spec[0] if isinstance(element_spec, tuple) else element_spec


def training_flops(model, batch: int, element_spec=None) -> int | None:
    """FLOPs of the model's forward and backward pass on a batch of `batch` examples, or None.

    Args:
        model: a built Keras model.
        batch: int, examples in the batch.
        element_spec: the input's element spec (used where the model has no
            `inputs`, e.g. a subclassed model), `(x, y, ...)`.

    Returns:
        The count (see the module's doc for what is counted), or None when the
        model's input shapes are unknown.

    Example:

    ```python
    training_flops(model, 128)
    ```
    """
    specs = input_specs(model, element_spec)
    if specs is None:
        return None
    specs = tf.nest.map_structure(lambda s: with_batch(s, batch), specs)
    variables = model.trainable_variables

    def forward_backward(x):
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            total = output_sum(outputs)
        return tape.gradient(total, variables)

    concrete = tf.function(forward_backward, autograph=False).get_concrete_function(specs)
    return graph_flops(concrete.graph)


def _dtype_index(dtype: str, tf32: bool) -> int:
    if dtype == "bfloat16":
        return 2
    if dtype == "float16":
        return 3
    return 1 if tf32 else 0


def table_peak(device_type: str, device_name: str, dtype: str) -> tuple[float, str] | None:
    """The vendor peak FLOP/s of a GPU or TPU named `device_name` for `dtype`, and its label; None if unknown.

    Example:

    ```python
    table_peak("GPU", "NVIDIA H100 80GB HBM3", "bfloat16")   # (9.894e14, 'H100 bfloat16 dense ...')
    ```
    """
    if device_type == "GPU":
        for key, peaks in GPU_PEAKS_TFLOPS.items():
            if re.search(rf"\b{re.escape(key)}\b", device_name):
                tf32 = dtype == "float32" and peaks[1] is not None and tf.config.experimental.tensor_float_32_execution_enabled()
                value = peaks[_dtype_index(dtype, tf32)]
                if value is None:
                    return None
                kind = "tf32" if tf32 else dtype
                return value * 1e12, f"{key} {kind} dense, {value:g} TFLOP/s (vendor datasheet)"
    if device_type == "TPU":
        for key, value in TPU_PEAKS_TFLOPS.items():
            if key in device_name.lower():
                return value * 1e12, f"TPU {key} bfloat16, {value:g} TFLOP/s per chip (vendor datasheet)"
    return None


@functools.cache
def measured_peak(device: str, dtype: str = "float32", n: int = 512, repeats: int = 8) -> tuple[float, str]:
    """FLOP/s of `repeats` chained `n`x`n` matmuls in `dtype` on `device`, best of three; and its label.

    Measured once per process and device (about 0.1-0.5 s on one CPU core).
    """
    with tf.device(device):
        a = tf.random.stateless_normal([n, n], seed=[0, 1], dtype=tf.float32)
        a = tf.cast(a / n, dtype)

        @tf.function(autograph=False)
        def chain(x):
            for _ in range(repeats):
                x = tf.matmul(x, a)
            return tf.reduce_sum(tf.cast(x, tf.float32))

        chain(a).numpy()  # traced, kernels warmed
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            chain(a).numpy()
            best = min(best, time.perf_counter() - start)
    rate = 2 * n**3 * repeats / best
    return rate, f"measured: {dtype} {n}x{n} matmul on {device}, {rate / 1e9:.1f} GFLOP/s"


def device_peak(device: str, dtype: str) -> tuple[float, str]:
    """The peak FLOP/s of one `device` (e.g. `"/device:GPU:0"`) for `dtype`, and the label naming it.

    A GPU or TPU in the table gets its vendor peak; anything else (every CPU)
    gets a measured matmul rate (`measured_peak`).
    """
    spec = tf.DeviceSpec.from_string(device)
    if spec.device_type in ("GPU", "TPU"):
        physical = tf.config.list_physical_devices(spec.device_type)
        index = spec.device_index or 0
        if index < len(physical):
            details = tf.config.experimental.get_device_details(physical[index])
            found = table_peak(spec.device_type, details.get("device_name", ""), dtype)
            if found is not None:
                return found
    local = spec.replace(job=None, replica=None, task=None).to_string()
    return measured_peak(local, dtype)

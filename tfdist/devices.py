"""Local devices: splitting the host into logical devices, and checking device names."""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tfdist.options import OptionError


def configure_local_devices(n: int, memory_limit_mb: Optional[int] = None) -> list[str]:
    """Splits the host CPU (or each GPU) into `n` logical devices.

    A single machine then offers `n` replicas to a strategy, which is how
    multi-replica runs and tests work on a host with one CPU. It must be called
    before TensorFlow initialises its devices (before the first op runs).

    Args:
        n: int. Logical devices per physical device, >= 1.
        memory_limit_mb: Optional int. Memory of each logical GPU in MiB;
            required when the host has GPUs (TensorFlow needs a limit to
            split one), ignored on CPU.

    Returns:
        The logical device names, e.g. `['/device:CPU:0', '/device:CPU:1']`.
        TensorFlow's runtime is not started, so a multi-worker strategy
        created afterwards can still configure its collective ops.

    Raises:
        ValueError: `n` is not a positive integer, or GPUs are present and
            `memory_limit_mb` is missing.
        RuntimeError: TensorFlow has already initialised its devices.

    Example:

    ```python
    import tfdist
    tfdist.configure_local_devices(4)   # first thing in the script
    strategy = tfdist.get_strategy("mirrored")   # 4 replicas
    ```
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"Argument 'n' must be a positive integer. Received: n={n!r}"
        )
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and memory_limit_mb is None:
        raise ValueError(
            "Splitting a GPU into logical devices needs a memory limit per device. "
            "Pass memory_limit_mb=..., e.g. configure_local_devices("
            f"{n}, memory_limit_mb=4096). Received: memory_limit_mb=None"
        )
    physical = gpus or tf.config.list_physical_devices("CPU")
    kind = "GPU" if gpus else "CPU"
    current = tf.config.get_logical_device_configuration(physical[0])
    # The names, without listing the logical devices: listing initialises
    # TensorFlow's runtime, after which a multi-worker strategy can no longer
    # configure its collective ops ("Collective ops must be configured at
    # program startup").
    names = [f"/device:{kind}:{i}" for i in range(n * len(physical))]
    if current is not None and len(current) == n:
        return names
    try:
        for dev in physical:
            if gpus:
                configs = [
                    tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
                    for _ in range(n)
                ]
            else:
                configs = [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
            tf.config.set_logical_device_configuration(dev, configs)
    except RuntimeError:
        have = len(tf.config.list_logical_devices(kind))
        raise RuntimeError(
            f"configure_local_devices({n}) was called after TensorFlow initialised "
            f"its devices (it now has {have} logical {kind} device(s)). Call it "
            "first in the program, before any TensorFlow op, model or strategy is "
            "created; or set it for the whole process with the environment "
            f"variable TFDIST_LOCAL_DEVICES={n}."
        ) from None
    return names


def default_devices() -> list[str]:
    """Every local GPU, or else every logical CPU device."""
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return [d.name for d in devices]


def check_devices(devices: Sequence[str], argument: str = "devices") -> list[str]:
    """Returns canonical names of `devices`, or raises `OptionError` naming the bad one.

    `OptionError` is a `ValueError`: an invalid or unknown device string, or
    a device named twice.
    """
    available = {d.name for d in tf.config.list_logical_devices()}
    canonical = []
    for d in devices:
        try:
            spec = tf.DeviceSpec.from_string(d)
        except ValueError:
            raise OptionError(
                f"Argument '{argument}' holds an invalid device string. "
                f"Received: {d!r}. Expected strings like '/cpu:0' or '/gpu:1'."
            ) from None
        local = spec.replace(job=None, replica=None, task=None)
        if local.device_type is None:
            raise OptionError(
                f"Argument '{argument}' holds a device string without a device type. "
                f"Received: {d!r}. Expected strings like '/cpu:0' or '/gpu:1'."
            )
        name = local.replace(device_index=local.device_index or 0).to_string()
        if name not in available and f"/job:localhost/replica:0/task:0{name}" not in available:
            raise OptionError(
                f"Device {d!r} in argument '{argument}' does not exist on this host. "
                f"Available devices: {sorted(available)}. To get more CPU devices, "
                "call tfdist.configure_local_devices(n) first in the program."
            )
        canonical.append(name)
    if len(set(canonical)) != len(canonical):
        twice = next(d for d, name in zip(devices, canonical) if canonical.count(name) > 1)
        raise OptionError(
            f"Argument '{argument}' names a device twice: {twice!r} ({canonical[devices.index(twice)]}); "
            f"list each device once. Received: {list(devices)}"
        )
    return canonical

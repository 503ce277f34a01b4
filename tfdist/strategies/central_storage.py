"""Synchronous data parallelism with one copy of every variable on a parameter device."""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tfdist import devices as devices_lib
from tfdist import options as options_lib
from tfdist._compat import tf as tfc
from tfdist.engine import step as engine_step
from tfdist.strategies.base import TfdistStrategy

PARAMETER_DEVICE = options_lib.Option(
    name="parameter_device",
    default=None,
    types=(str,),
    expected="a device string such as '/cpu:0'",
    doc="Device that holds the single copy of every variable; default '/cpu:0'.",
)
COMPUTE_DEVICES = options_lib.dataclasses.replace(
    options_lib.DEVICES,
    name="compute_devices",
    doc="Devices that compute replicas run on; default as for mirrored.",
)


class CentralStorageStrategy(TfdistStrategy, tf.distribute.experimental.CentralStorageStrategy):
    """Keeps variables on one parameter device and replicates compute.

    Replicas run on the compute devices; gradients are summed onto the
    parameter device (in fused buffers), where each variable is updated once.
    Suits one host whose accelerators are short of memory, or a CPU host.

    Args:
        compute_devices: Optional list of device strings for the replicas.
            Default: every local GPU, else every logical CPU device.
        parameter_device: Optional device string for the variables.
            Default `'/cpu:0'`.
        **options: step options (see `tfdist.options.STEP_OPTIONS`).

    Example:

    ```python
    strategy = tfdist.get_strategy("central_storage", parameter_device="/cpu:0")
    ```
    """

    name = "central_storage"
    PARAMS = {"compute_devices": COMPUTE_DEVICES, "parameter_device": PARAMETER_DEVICE}
    gradient_path = engine_step.REDUCE_TO_VARIABLES

    def unsupported(self, feature: str, model=None) -> str | None:
        dtype = self.options.allreduce_dtype
        if feature == "step_options" and dtype != "float32":
            return (
                f"allreduce_dtype={dtype!r} is not used by the 'central_storage' strategy: its "
                "gradients are summed onto the parameter device by a reduce, not an all-reduce, and "
                "cross devices in float32. Use 'mirrored' or 'multi_worker' for a compressed exchange, "
                "or leave allreduce_dtype='float32'."
            )
        return None

    def __init__(
        self,
        compute_devices: Optional[Sequence[str]] = None,
        parameter_device: Optional[str] = None,
        **options,
    ):
        params = self._tfdist_init(
            {"compute_devices": compute_devices, "parameter_device": parameter_device, **options}
        )
        compute = params.get("compute_devices")
        compute = (
            devices_lib.check_devices(compute, "compute_devices")
            if compute
            else devices_lib.default_devices()
        )
        param_dev = devices_lib.check_devices(
            [params.get("parameter_device") or "/cpu:0"], "parameter_device"
        )[0]
        super().__init__(compute_devices=compute, parameter_device=param_dev)
        self.parameter_device = param_dev
        tfc.configure_variable_creation(self, on_read_devices=compute)
        self._refuse_tf_keras_if_options_are_set()

"""Synchronous data parallelism over the devices of one host."""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tfdist import devices as devices_lib
from tfdist import options as options_lib
from tfdist._compat import tf as tfc
from tfdist.strategies.base import TfdistStrategy


class MirroredStrategy(TfdistStrategy, tf.distribute.MirroredStrategy):
    """Replicates the model on every local device and all-reduces gradients.

    Each replica holds a copy of every variable; the step engine sums the
    gradients of all replicas in fused buffers (`bucket_bytes`) and every
    replica applies the same update.

    Args:
        devices: Optional list of device strings. Default: every local GPU,
            else every logical CPU device (see `tfdist.configure_local_devices`).
        **options: step options (see `tfdist.options.STEP_OPTIONS`), e.g.
            `bucket_bytes=0`.

    Example:

    ```python
    tfdist.configure_local_devices(2)
    strategy = tfdist.strategies.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss="mse")
    ```
    """

    name = "mirrored"
    PARAMS = {"devices": options_lib.DEVICES}

    def __init__(self, devices: Optional[Sequence[str]] = None, **options):
        params = self._tfdist_init({"devices": devices, **options})
        devs = params.get("devices")
        devs = devices_lib.check_devices(devs) if devs else devices_lib.default_devices()
        tfc.isolate_collective_keys(self)
        super().__init__(devices=devs)
        tfc.configure_variable_creation(self)
        self._refuse_tf_keras_if_options_are_set()

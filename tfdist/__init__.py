"""tfdist: distribution strategies for Keras 3 and TensorFlow.

Users keep writing ordinary Keras code and pick how training spreads over
devices and machines by name or preset file:

```python
import keras, tfdist

strategy = tfdist.get_strategy("mirrored")
with strategy.scope():
    model = keras.Sequential([...])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=64, epochs=3)
```
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

from tfdist.devices import configure_local_devices  # noqa: E402

if _os.environ.get("TFDIST_LOCAL_DEVICES"):
    configure_local_devices(int(_os.environ["TFDIST_LOCAL_DEVICES"]))

from tfdist import cluster, data, datasets, options, strategies  # noqa: E402
from tfdist import keras_integration as _keras_integration  # noqa: E402
from tfdist.cluster import ClusterConfigError  # noqa: E402
from tfdist.memory import memory_report  # noqa: E402
from tfdist.options import OptionError, TrainingOptions  # noqa: E402
from tfdist.registry import PresetError, from_config, get_strategy, register, strategy_names  # noqa: E402

_keras_integration.install()


def __getattr__(name: str):
    # `tfdist.estimator` (the Estimator-style runner) is imported on first use.
    if name == "estimator":
        import importlib

        return importlib.import_module("tfdist.estimator")
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")

__all__ = [
    "ClusterConfigError",
    "OptionError",
    "PresetError",
    "TrainingOptions",
    "cluster",
    "configure_local_devices",
    "data",
    "datasets",
    "estimator",
    "from_config",
    "get_strategy",
    "memory_report",
    "options",
    "register",
    "strategies",
    "strategy_names",
]

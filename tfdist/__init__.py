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

`import tfdist` itself loads neither TensorFlow nor Keras, so that the
`tfdist` command (`tfdist launch --help`, the launcher's own process) starts
at once. The first use of a public function or class (`tfdist.get_strategy`,
`tfdist.configure_local_devices`, ...) loads the package whole; a submodule
(`tfdist.data`, `tfdist.callbacks`) loads itself and what it imports.
`tfdist.cli`, `tfdist.launch`, `tfdist.cluster`, `tfdist.options`,
`tfdist.datasets` and `tfdist.tuning` load without TensorFlow. With
`TFDIST_LOCAL_DEVICES` set, `import tfdist` loads everything at once, as the
devices must be split before TensorFlow initialises them.

Neither importing nor loading changes Keras or TensorFlow: tfdist's patches
(`tfdist._compat.patches`, docs/compat.md) are installed when a tfdist
strategy is created. This module hands the registry the integration layer's
wrappers (`keras_integration.patch_implementations`), loaded then.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os

from tfdist._compat import patches as _patches

__version__ = "0.1.0"

# Modules that import no TensorFlow: reached without loading the package.
_LIGHT_MODULES = ("cli", "launch", "cluster", "options", "datasets", "tuning")


def _integration_patches() -> dict:
    """The integration layer's patch wrappers, for the registry (loaded when a strategy installs them)."""
    from tfdist import keras_integration

    return keras_integration.patch_implementations()


_patches.add_implementations(_integration_patches)

# Every public name, and the module that defines it.
_PUBLIC = {
    "ClusterConfigError": "tfdist.cluster",
    "OptionError": "tfdist.options",
    "PresetError": "tfdist.registry",
    "TrainingOptions": "tfdist.options",
    "configure_local_devices": "tfdist.devices",
    "from_config": "tfdist.registry",
    "get_strategy": "tfdist.registry",
    "memory_report": "tfdist.memory",
    "register": "tfdist.registry",
    "strategy_names": "tfdist.registry",
    "tune": "tfdist.tuning",
}

_loaded = False


def _local_devices_from_environment() -> int:
    raw = _os.environ["TFDIST_LOCAL_DEVICES"]
    count = int(raw.strip()) if raw.strip().isdigit() else 0
    if count < 1:
        from tfdist.options import OptionError

        raise OptionError(
            "Environment variable TFDIST_LOCAL_DEVICES must be a positive integer (logical devices "
            "to split each physical device into, e.g. TFDIST_LOCAL_DEVICES=2), or unset. "
            f"Received: TFDIST_LOCAL_DEVICES={raw!r}"
        )
    return count


def _load() -> None:
    """Imports the whole package, once (Keras and TensorFlow stay as they are)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # the imports below reach `__getattr__` again
    try:
        if _os.environ.get("TFDIST_LOCAL_DEVICES"):
            count = _local_devices_from_environment()
            from tfdist import devices

            devices.configure_local_devices(count)
        from tfdist import cluster, data, datasets, memory, options, registry, strategies  # noqa: F401
    except BaseException:
        _loaded = False
        raise


def install_hooks() -> None:
    """Installs the patches of Keras and TensorFlow every tfdist strategy installs when it is created.

    Creating a strategy does this (however it was imported), so calling it
    yourself is never needed; models outside tfdist strategies are unaffected
    either way (docs/compat.md). Idempotent.

    Example:

    ```python
    import tfdist
    tfdist.install_hooks()
    ```
    """
    _load()
    _patches.install()


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
    module = _PUBLIC.get(name, f"tfdist.{name}")
    # A public function or class loads the package whole; a submodule (`tfdist.data`,
    # `from tfdist import collectives` inside another module's import) imports just
    # itself and what it imports, so a module reached half-way through another's import
    # never pulls in the rest of the package around it (an import cycle at run time).
    if name in _PUBLIC and module.split(".")[1] not in _LIGHT_MODULES:
        _load()
    try:
        found = _importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}") from None
    return getattr(found, name) if name in _PUBLIC else found


def __dir__() -> list[str]:
    return sorted({name for name in globals() if not name.startswith("_")} | set(__all__))


if _os.environ.get("TFDIST_LOCAL_DEVICES"):
    _load()

__all__ = [
    "ClusterConfigError",
    "callbacks",
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
    "install_hooks",
    "memory_report",
    "options",
    "register",
    "report",
    "strategies",
    "strategy_names",
    "tune",
]

"""Strategy names and preset files: `get_strategy` and `from_config`."""

from __future__ import annotations

import os
from typing import Any, Mapping, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import tensorflow as tf

from tfdist import strategies
from tfdist.options import OptionError

_REGISTRY: dict[str, type] = {}


class PresetError(ValueError):
    """A preset file or mapping is malformed; the message names the file, key and fix."""


def register(cls: type) -> type:
    """Registers a strategy class under its `name` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"Strategy class {cls.__name__} has no 'name'.")
    _REGISTRY[cls.name] = cls
    return cls


# Every strategy class `tfdist.strategies` exports is registered under its `name`: a new
# strategy is its module and its line in strategies/__init__.py (docs/ARCHITECTURE.md).
for _export in strategies.__all__:
    _cls = getattr(strategies, _export)
    if isinstance(_cls, type) and issubclass(_cls, strategies.TfdistStrategy) and _cls.name:
        register(_cls)


def strategy_names() -> list[str]:
    """The registered strategy names, sorted."""
    return sorted(_REGISTRY)


def strategy_class(name: str) -> type:
    """The class registered under `name` (`KeyError` if none)."""
    return _REGISTRY[name]


def get_strategy(name: str, **options: Any) -> tf.distribute.Strategy:
    """Returns the tfdist strategy registered under `name`.

    Args:
        name: str. One of `tfdist.strategy_names()`: `"mirrored"`,
            `"central_storage"`, ...
        **options: the strategy's own parameters (e.g. `devices=`) and step
            options (e.g. `bucket_bytes=`).

    Returns:
        A `tf.distribute.Strategy` (also a `tfdist.strategies.TfdistStrategy`).

    Raises:
        ValueError: `name` is not registered; the message lists valid names.
        TypeError: an option is unknown; the message lists the valid ones.
        tfdist.options.OptionError: an option has a bad type or value.

    Example:

    ```python
    strategy = tfdist.get_strategy("mirrored", bucket_bytes=4 << 20)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64)
    ```
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        valid = ", ".join(repr(n) for n in strategy_names())
        raise ValueError(f"Unknown strategy name {name!r}. Valid names: {valid}.")
    return _REGISTRY[name](**options)


def load_preset(path_or_mapping: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple[str, dict, str]:
    """Reads a preset; returns `(strategy name, options, source)` without building it."""
    if isinstance(path_or_mapping, Mapping):
        source = "preset mapping"
        data = dict(path_or_mapping)
    else:
        if not isinstance(path_or_mapping, (str, os.PathLike)):
            raise PresetError(
                "A preset must be the path of a TOML file (e.g. 'strategies/mirrored.toml') or a "
                "mapping such as {'strategy': 'mirrored'}. "
                f"Received: {path_or_mapping!r} (type {type(path_or_mapping).__name__})"
            )
        source = os.fspath(path_or_mapping)
        if os.path.isdir(source):
            raise PresetError(
                f"{source}: is a directory; a preset is one TOML file, e.g. "
                f"{os.path.join(source, 'mirrored.toml')}."
            )
        try:
            with open(source, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise PresetError(f"{source}: preset file not found.") from None
        except tomllib.TOMLDecodeError as e:
            raise PresetError(f"{source}: not valid TOML: {e}.") from None
    if "strategy" not in data:
        raise PresetError(
            f"{source}: key 'strategy' is missing. Expected a strategy name, one of "
            f"{strategy_names()}, e.g. strategy = \"mirrored\"."
        )
    name = data.pop("strategy")
    if not isinstance(name, str) or name not in _REGISTRY:
        raise PresetError(
            f"{source}: key 'strategy' must be one of {strategy_names()}. Received: {name!r}"
        )
    for key, value in data.items():
        if isinstance(value, dict):
            raise PresetError(
                f"{source}: key {key!r} is a table; presets are flat: write the "
                f"options of the strategy as top-level keys. Received: {key} = {value!r}"
            )
    return name, data, source


def from_config(path_or_mapping: Union[str, os.PathLike, Mapping[str, Any]]) -> tf.distribute.Strategy:
    """Builds a strategy from a preset: a TOML file, or a mapping with the same keys.

    A preset has a `strategy` key naming the strategy and, at the top level,
    any of that strategy's options:

    ```toml
    # strategies/mirrored.toml
    strategy = "mirrored"
    bucket_bytes = 26214400
    ```

    Args:
        path_or_mapping: path of a TOML file, or a dict.

    Returns:
        The strategy, as `get_strategy(name, **options)` would build it.

    Raises:
        PresetError: the file is missing, is not TOML, lacks `strategy`, or a
            key has the wrong type or value; the message names file and key.

    Example:

    ```python
    strategy = tfdist.from_config("strategies/mirrored.toml")
    ```
    """
    name, options, source = load_preset(path_or_mapping)
    cls = _REGISTRY[name]
    try:
        # Validate with the file named, then build.
        from tfdist.options import split_options

        split_options(name, cls.PARAMS, options, source=source)
    except TypeError as e:
        raise PresetError(str(e)) from None
    except OptionError as e:
        raise PresetError(str(e)) from None
    return cls(**options)

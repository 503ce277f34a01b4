"""Strategy names, options and preset files (issue 3)."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.options import OptionError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(glob.glob(os.path.join(REPO, "strategies", "*.toml")))


def test_get_strategy_returns_a_tf_distribute_strategy():
    strategy = tfdist.get_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    assert isinstance(strategy, tf.distribute.Strategy)
    assert isinstance(strategy, tfdist.strategies.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2
    assert strategy.options.bucket_bytes == 25 * 1024 * 1024


def test_default_devices_are_every_logical_cpu():
    assert tfdist.get_strategy("mirrored").num_replicas_in_sync == 4
    assert tfdist.get_strategy("central_storage").num_replicas_in_sync == 4


def test_unknown_strategy_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        tfdist.get_strategy("mirorred")
    assert str(e.value).startswith("Unknown strategy name 'mirorred'. Valid names: ")
    for name in ("'mirrored'", "'central_storage'"):
        assert name in str(e.value)


def test_unknown_option_raises_type_error_naming_it_and_valid_ones():
    with pytest.raises(TypeError) as e:
        tfdist.get_strategy("mirrored", bucket_size=4)
    assert str(e.value).startswith("unknown option 'bucket_size' for strategy 'mirrored'. Valid options: ")
    assert "bucket_bytes" in str(e.value) and "devices" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"bucket_bytes": -1},
            "option 'bucket_bytes' must be an integer >= 0 (bytes per fused gradient buffer; "
            "0 turns fusion off). Received: bucket_bytes=-1",
        ),
        (
            {"bucket_bytes": "25MB"},
            "option 'bucket_bytes' must be an integer >= 0 (bytes per fused gradient buffer; "
            "0 turns fusion off). Received: bucket_bytes='25MB' (type str)",
        ),
        (
            {"devices": "/cpu:0"},
            "option 'devices' must be a non-empty list of device strings such as ['/cpu:0', '/cpu:1']. "
            "Received: devices='/cpu:0' (type str)",
        ),
    ],
)
def test_bad_option_values_are_named(kwargs, message):
    with pytest.raises(OptionError) as e:
        tfdist.get_strategy("mirrored", **kwargs)
    assert str(e.value) == message


def test_numpy_integers_are_integer_options():
    # Before: "option 'sink_size' must be a positive integer or "epoch" ... Received:
    # sink_size=np.int64(4) (type int64)".
    strategy = tfdist.get_strategy(
        "mirrored", devices=["/cpu:0"], sink_size=np.int64(4), bucket_bytes=np.int32(1024),
        accumulation_steps=np.uint8(2),
    )
    options = strategy.options
    assert (options.sink_size, options.bucket_bytes, options.accumulation_steps) == (4, 1024, 2)
    assert all(type(v) is int for v in (options.sink_size, options.bucket_bytes, options.accumulation_steps))
    with pytest.raises(OptionError, match=r"Received: sink_size=0$"):
        tfdist.get_strategy("mirrored", devices=["/cpu:0"], sink_size=np.int64(0))
    with pytest.raises(OptionError, match=r"Received: jit_compile=1 \(type int\)"):
        tfdist.get_strategy("mirrored", devices=["/cpu:0"], jit_compile=1)


def test_bucket_bytes_environment_override(monkeypatch):
    monkeypatch.setenv("TFDIST_BUCKET_BYTES", "1024")
    assert tfdist.get_strategy("mirrored", devices=["/cpu:0"]).options.bucket_bytes == 1024
    monkeypatch.setenv("TFDIST_BUCKET_BYTES", "lots")
    with pytest.raises(OptionError, match=r"Environment variable TFDIST_BUCKET_BYTES must be an integer >= 0"):
        tfdist.get_strategy("mirrored", devices=["/cpu:0"])


def test_every_preset_in_strategies_loads():
    assert len(PRESETS) >= 3
    for path in PRESETS:
        strategy = tfdist.from_config(path)
        assert isinstance(strategy, tfdist.strategies.TfdistStrategy), path


def test_mapping_preset_builds_the_same_strategy_as_get_strategy():
    strategy = tfdist.from_config({"strategy": "central_storage", "bucket_bytes": 0, "compute_devices": ["/cpu:0", "/cpu:1"]})
    assert isinstance(strategy, tfdist.strategies.CentralStorageStrategy)
    assert strategy.options.bucket_bytes == 0
    assert strategy.num_replicas_in_sync == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ('strategy = "mirrored"\nbucket_bytes = "big"\n',
         "{path}: option 'bucket_bytes' must be an integer >= 0 (bytes per fused gradient buffer; "
         "0 turns fusion off). Received: bucket_bytes='big' (type str)"),
        ('bucket_bytes = 1\n',
         "{path}: key 'strategy' is missing. Expected a strategy name, one of "
         "{names}, e.g. strategy = \"mirrored\"."),
        ('strategy = "ring"\n',
         "{path}: key 'strategy' must be one of {names}. Received: 'ring'"),
        ('strategy = "mirrored"\nbuckets = 3\n',
         "{path}: unknown option 'buckets' for strategy 'mirrored'. Valid options: {mirrored_options}"),
        ('strategy = "mirrored"\n[options]\nbucket_bytes = 3\n',
         "{path}: key 'options' is a table; presets are flat: write the options of the strategy as "
         "top-level keys. Received: options = {{'bucket_bytes': 3}}"),
    ],
    ids=["wrong-type", "missing-strategy", "unknown-strategy", "unknown-key", "table"],
)
def test_bad_preset_names_file_key_and_expectation(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(tfdist.PresetError) as e:
        tfdist.from_config(str(path))
    mirrored_options = ", ".join(sorted(set(tfdist.strategies.MirroredStrategy.PARAMS) | set(tfdist.options.STEP_OPTIONS)))
    assert str(e.value) == message.format(path=path, names=tfdist.strategy_names(), mirrored_options=mirrored_options)


def test_preset_that_is_not_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('strategy = "mirrored\n')
    with pytest.raises(tfdist.PresetError, match=rf"^{path}: not valid TOML: "):
        tfdist.from_config(str(path))


def test_missing_preset_file_is_named(tmp_path):
    with pytest.raises(tfdist.PresetError) as e:
        tfdist.from_config(str(tmp_path / "nope.toml"))
    assert str(e.value) == f"{tmp_path / 'nope.toml'}: preset file not found."


def test_preset_path_that_is_a_directory_is_named(tmp_path):
    with pytest.raises(tfdist.PresetError) as e:
        tfdist.from_config(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: is a directory; a preset is one TOML file, e.g. {tmp_path / 'mirrored.toml'}."


@pytest.mark.parametrize("value, shown", [(None, "None (type NoneType)"), (3, "3 (type int)")])
def test_preset_that_is_neither_path_nor_mapping_is_refused(value, shown):
    with pytest.raises(tfdist.PresetError) as e:
        tfdist.from_config(value)
    assert str(e.value) == (
        "A preset must be the path of a TOML file (e.g. 'strategies/mirrored.toml') or a mapping such "
        f"as {{'strategy': 'mirrored'}}. Received: {shown}"
    )


@pytest.mark.parametrize("stage", ["1", True, 4])
def test_a_stage_that_is_not_1_2_or_3_is_an_option_error(stage):
    with pytest.raises(OptionError) as e:
        tfdist.get_strategy("sharded_optimizer", stage=stage)
    assert str(e.value) == f"Argument 'stage' must be 1, 2 or 3. Received: stage={stage!r}"

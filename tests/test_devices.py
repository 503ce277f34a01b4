"""Logical devices and device names (issue 3)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tfdist
from tfdist.devices import check_devices


def test_configure_local_devices_after_initialisation_says_how_to_fix():
    import tensorflow as tf

    # conftest split the CPU in 4 without starting TensorFlow's runtime; listing starts it.
    assert len(tf.config.list_logical_devices("CPU")) == 4
    with pytest.raises(RuntimeError) as e:
        tfdist.configure_local_devices(2)
    assert str(e.value) == (
        "configure_local_devices(2) was called after TensorFlow initialised its devices "
        "(it now has 4 logical CPU device(s)). Call it first in the program, before any "
        "TensorFlow op, model or strategy is created; or set it for the whole process with "
        "the environment variable TFDIST_LOCAL_DEVICES=2."
    )


def test_configure_local_devices_again_with_the_same_count_is_harmless():
    assert tfdist.configure_local_devices(4) == [f"/device:CPU:{i}" for i in range(4)]


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_configure_local_devices_rejects_bad_counts(n):
    with pytest.raises(ValueError, match=rf"^Argument 'n' must be a positive integer. Received: n={n!r}$"):
        tfdist.configure_local_devices(n)


def test_configure_local_devices_in_a_fresh_process_and_by_environment():
    code = (
        "import tfdist, tensorflow as tf;"
        "print(tfdist.configure_local_devices(3));"
        "print(tfdist.get_strategy('mirrored').num_replicas_in_sync)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']", "3"]
    env_code = "import tfdist; print(tfdist.get_strategy('central_storage').num_replicas_in_sync)"
    out = subprocess.run(
        [sys.executable, "-c", env_code], capture_output=True, text=True, timeout=120, check=True,
        env={**__import__("os").environ, "TFDIST_LOCAL_DEVICES": "2"},
    )
    assert out.stdout.strip() == "2"


def test_device_that_does_not_exist_is_named_with_the_available_ones():
    with pytest.raises(ValueError) as e:
        tfdist.get_strategy("mirrored", devices=["/cpu:0", "/gpu:0"])
    message = str(e.value)
    assert message.startswith("Device '/gpu:0' in argument 'devices' does not exist on this host. Available devices: [")
    assert "'/device:CPU:3'" in message
    assert message.endswith("call tfdist.configure_local_devices(n) first in the program.")


def test_central_storage_parameter_device_is_checked():
    with pytest.raises(ValueError, match=r"^Device '/cpu:9' in argument 'parameter_device' does not exist"):
        tfdist.get_strategy("central_storage", parameter_device="/cpu:9")


def test_duplicate_and_malformed_devices():
    with pytest.raises(tfdist.OptionError) as e:
        check_devices(["/cpu:1", "/CPU:1"])
    assert str(e.value) == (
        "Argument 'devices' names a device twice: '/cpu:1' (/device:CPU:1); list each device once. "
        "Received: ['/cpu:1', '/CPU:1']"
    )
    with pytest.raises(tfdist.OptionError, match=r"^Argument 'devices' holds a device string without a device type"):
        check_devices(["/job:worker"])


def test_unknown_and_duplicate_devices_of_a_strategy_are_option_errors():
    with pytest.raises(tfdist.OptionError) as e:
        tfdist.get_strategy("mirrored", devices=["/cpu:0", "/gpu:7"])
    assert str(e.value).startswith("Device '/gpu:7' in argument 'devices' does not exist on this host.")
    with pytest.raises(tfdist.OptionError) as e:
        tfdist.get_strategy("mirrored", devices=["/cpu:0", "/cpu:0"])
    assert str(e.value) == (
        "Argument 'devices' names a device twice: '/cpu:0' (/device:CPU:0); list each device once. "
        "Received: ['/cpu:0', '/cpu:0']"
    )


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "1.5"])
def test_tfdist_local_devices_that_is_not_a_count_names_the_variable(raw):
    done = subprocess.run(
        [sys.executable, "-c", "import tfdist"], capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "TFDIST_LOCAL_DEVICES": raw},
    )
    assert done.returncode == 1
    assert done.stderr.rstrip().splitlines()[-1] == (
        "tfdist.options.OptionError: Environment variable TFDIST_LOCAL_DEVICES must be a positive integer "
        "(logical devices to split each physical device into, e.g. TFDIST_LOCAL_DEVICES=2), or unset. "
        f"Received: TFDIST_LOCAL_DEVICES={raw!r}"
    )

"""The supported TensorFlow and Keras versions: declared once, in setup.py, checked at strategy creation.

Runs on the newest versions (`make test`) and on the oldest (`make test-compat`).
The version gates of `tfdist._compat.keras` each have a test here that fails
without the gate on the Keras versions it serves.
"""

from __future__ import annotations

import os
import runpy

import keras
import numpy as np
import pytest
import setuptools

import tfdist
from tests.conftest import DEVICES
from tfdist._compat import keras as kc
from tfdist._compat import patches, versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_setup_py_declares_both_bounds_from_the_one_declaration(monkeypatch):
    declared = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: declared.update(kwargs))
    runpy.run_path(os.path.join(ROOT, "setup.py"))
    assert declared["install_requires"][:2] == ["tensorflow>=2.16.1,<2.22", "keras>=3.8.0,<3.16"]
    assert declared["extras_require"]["legacy"] == ["tf-keras>=2.16.0,<2.22"]
    assert "tf-keras>=2.16.0,<2.22" in declared["extras_require"]["test"]


def test_this_process_runs_supported_versions():
    # make test: the newest; make test-compat: the oldest (tfdist/_compat/versions.py --oldest).
    versions.check()
    found = versions.installed()
    assert versions.parse(versions.TENSORFLOW[0]) <= found["tensorflow"] < versions.parse(versions.TENSORFLOW[1])
    assert versions.parse(versions.KERAS[0]) <= found["keras"] < versions.parse(versions.KERAS[1])


@pytest.mark.parametrize("tensorflow,keras_version,message", [
    ((2, 15, 1), (3, 15, 1), "this process has TensorFlow 2.15.1 and Keras 3.15.1"),
    ((2, 21, 0), (3, 5, 0), "this process has TensorFlow 2.21.0 and Keras 3.5.0"),
    ((2, 21, 0), (3, 16, 0), "this process has TensorFlow 2.21.0 and Keras 3.16.0"),
    ((2, 22, 0), (3, 15, 1), "this process has TensorFlow 2.22.0 and Keras 3.15.1"),
])
def test_creating_a_strategy_outside_the_range_names_both_and_the_fix(monkeypatch, tensorflow, keras_version,
                                                                      message):
    # The one accessor through which tfdist reads the versions, faked: nothing else is.
    monkeypatch.setattr(versions, "installed", lambda: {"tensorflow": tensorflow, "keras": keras_version})
    was = patches.uninstall()
    try:
        with pytest.raises(versions.UnsupportedVersionError) as e:
            tfdist.get_strategy("mirrored", devices=DEVICES[2])
        assert str(e.value) == (
            f"tfdist supports TensorFlow >=2.16.1,<2.22 and Keras >=3.8.0,<3.16; {message}. Install "
            "supported versions, e.g. pip install 'tensorflow>=2.16.1,<2.22' 'keras>=3.8.0,<3.16' "
            "(docs/compat.md), then restart the process. Models outside tfdist strategies are unaffected."
        )
        assert patches.installed() == []  # refused before anything was patched
    finally:
        patches.install_named(*reversed(was))


@pytest.mark.parametrize("text,parsed", [("2.21.0", (2, 21, 0)), ("3.16.0.dev2025", (3, 16, 0)),
                                         ("2.22.0-rc1", (2, 22, 0)), ("3.8", (3, 8, 0))])
def test_versions_are_read_with_their_suffixes_dropped(text, parsed):
    assert versions.parse(text) == parsed


def test_the_float8_rule_is_read_on_every_supported_keras():
    # Version gate: Keras 3.10 asks the optimizer (`_overwrite_variable_with_gradient`);
    # 3.8 and 3.9 have no such method, and every first fit under a strategy raised
    # "AttributeError: 'Adam' object has no attribute '_overwrite_variable_with_gradient'".
    optimizer = keras.optimizers.Adam()
    plain = keras.Variable(np.zeros(2, np.float32))
    scale = keras.Variable(np.zeros(2, np.float32))
    scale.overwrite_with_gradient = True
    optimizer.build([plain, scale])
    assert kc.overwrites_with_gradient(optimizer, plain) is False
    assert kc.overwrites_with_gradient(optimizer, scale) is True


def test_weight_decay_is_read_on_every_supported_keras():
    # Version gate: Muon is Keras 3.10's; on 3.8 importing keras.src.optimizers.muon raised
    # ModuleNotFoundError at every first fit.
    variable = keras.Variable(np.zeros(2, np.float32))
    adamw = keras.optimizers.AdamW(weight_decay=0.25)
    adamw.build([variable])
    assert kc.weight_decay_rate(adamw, variable) == 0.25
    assert kc.weight_decay_rate(keras.optimizers.Adam(), variable) is None

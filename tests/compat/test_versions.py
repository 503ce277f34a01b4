"""The supported TensorFlow and Keras versions: declared once, in setup.py, checked at strategy creation.

Runs on the newest versions (`make test`) and on the oldest (`make test-compat`).
The version gate of `tfdist._compat.keras` has a test here that fails without
the gate on the Keras versions it serves.
"""

from __future__ import annotations

import os
import runpy

import keras
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
    assert declared["install_requires"][:2] == ["tensorflow>=2.16.1,<2.22", "keras>=3.10.0,<3.16"]
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
    ((2, 21, 0), (3, 9, 2), "this process has TensorFlow 2.21.0 and Keras 3.9.2"),
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
            f"tfdist supports TensorFlow >=2.16.1,<2.22 and Keras >=3.10.0,<3.16; {message}. Install "
            "supported versions, e.g. pip install 'tensorflow>=2.16.1,<2.22' 'keras>=3.10.0,<3.16' "
            "(docs/compat.md), then restart the process. Models outside tfdist strategies are unaffected."
        )
        assert patches.installed() == []  # refused before anything was patched
    finally:
        patches.install_named(*reversed(was))


@pytest.mark.parametrize("text,parsed", [("2.21.0", (2, 21, 0)), ("3.16.0.dev2025", (3, 16, 0)),
                                         ("2.22.0-rc1", (2, 22, 0)), ("3.8", (3, 8, 0))])
def test_versions_are_read_with_their_suffixes_dropped(text, parsed):
    assert versions.parse(text) == parsed


def test_multi_optimizer_is_recognised_on_every_supported_keras():
    # Version gate: MultiOptimizer is Keras 3.13's; on 3.10 to 3.12 `keras.optimizers` has none,
    # and reading it without `getattr` raised AttributeError at every compile.
    assert kc.is_multi_optimizer(keras.optimizers.Adam()) is False
    if hasattr(keras.optimizers, "MultiOptimizer"):
        assert kc.is_multi_optimizer(keras.optimizers.MultiOptimizer(lambda v: keras.optimizers.SGD())) is True

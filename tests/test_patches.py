"""The patch registry (`tfdist._compat.patches`): every process-wide change is an entry, installed by a strategy, undone exactly.

The first test snapshots every function, class and descriptor in the
namespace of every loaded Keras and TensorFlow module and class, creates
tfdist strategies of every kind this process can run (each installs what it
needs), trains under one, and compares: what changed is exactly the
registry's installed targets — so a patch made outside the registry fails
here — and after `uninstall` nothing differs from the snapshot, down to the
identity of each object.
"""

from __future__ import annotations

import pathlib
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import DEVICES
from tfdist._compat import patches
from tfdist.strategies.base import run_creation_hooks

_WATCHED = ("keras", "tensorflow", "tf_keras")
TFDIST_DIR = pathlib.Path(tfdist.__file__).resolve().parent
_KINDS = (types.FunctionType, types.BuiltinFunctionType, type, staticmethod, classmethod, property)


def _namespaces() -> dict[int, tuple[str, object]]:
    """`{id: (name, module or class)}` of every loaded Keras/TensorFlow module and every class they define."""
    found: dict[int, tuple[str, object]] = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in _WATCHED:
            continue
        found[id(module)] = (name, module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and (value.__module__ or "").split(".")[0] in _WATCHED:
                found.setdefault(id(value), (f"{value.__module__}.{value.__qualname__}", value))
    return found


def _snapshot(namespaces) -> dict[tuple[str, str], object]:
    """`{(owner, attribute): object}` for every function, class and descriptor each namespace holds itself."""
    return {
        (name, attribute): value
        for name, owner in namespaces.values()
        for attribute, value in list(vars(owner).items())
        if isinstance(value, _KINDS)
    }


def _from_tfdist(value) -> bool:
    code = getattr(value, "__code__", None)
    return code is not None and TFDIST_DIR in pathlib.Path(code.co_filename).resolve().parents


def _changes(namespaces, before: dict) -> set[tuple[str, str]]:
    """Keys whose object changed or went; keys added where tfdist's code was put, or at a patch's target.

    (A first use of TensorFlow or Keras may add names of their own to a loaded module.)
    """
    after = _snapshot(namespaces)
    targets = {_target_key(p) for p in patches.PATCHES}
    changed = {key for key in before if before[key] is not after.get(key)}
    return changed | {key for key in after.keys() - before.keys() if _from_tfdist(after[key]) or key in targets}


def _target_key(entry) -> tuple[str, str]:
    owner, attribute = patches.resolve(entry)
    if isinstance(owner, types.ModuleType):
        return owner.__name__, attribute
    return f"{owner.__module__}.{owner.__qualname__}", attribute


@pytest.fixture
def pristine():
    """Keras and TensorFlow without tfdist's patches for the test; what was installed is reinstalled after."""
    was = patches.installed()
    patches.uninstall()
    try:
        yield
    finally:
        patches.uninstall()
        patches.install_named(*was)


@pytest.mark.usefixtures("pristine")
def test_strategies_change_only_registry_targets_and_uninstall_restores_every_object(digits):
    namespaces = _namespaces()
    before = _snapshot(namespaces)
    assert len(before) > 10_000  # the whole of Keras and TensorFlow, not a sample
    assert patches.installed() == []

    x, y = digits
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[2])
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:64], y[:64], batch_size=32, verbose=0)
    tfdist.get_strategy("multi_worker", devices_per_worker=2)  # its temporary patch comes and goes
    tfdist.get_strategy("sharded_optimizer", stage=3, devices=DEVICES[2])
    # A parameter-server strategy needs a cluster of processes; its constructor announces this need.
    run_creation_hooks("parameter_server", None)

    declared = {p.name for p in patches.PATCHES if not p.temporary}
    assert set(patches.installed()) == declared
    expected = {_target_key(patches.patch(name)) for name in declared}
    assert _changes(namespaces, before) == expected

    patches.uninstall()
    assert patches.installed() == []
    assert _changes(namespaces, before) == set()


@pytest.mark.usefixtures("pristine")
def test_a_class_that_only_inherited_a_method_gets_it_inherited_again():
    # Keras's TensorFlowTrainer inherits `fit` from nowhere but defines it; TensorFlow's
    # GradientTape defines `gradient`. LossScaleOptimizer defines `apply`. The undo must
    # put back the class's own entry, or delete it where the class had none.
    trainer = patches.resolve(patches.patch("TensorFlowTrainer.fit"))[0]
    own_before = dict(vars(trainer))
    patches.install()
    assert vars(trainer)["fit"] is not own_before["fit"]
    patches.uninstall()
    assert dict(vars(trainer)) == own_before


def test_every_entry_is_documented_and_implemented():
    names = [p.name for p in patches.PATCHES]
    assert len(names) == len(set(names))
    for entry in patches.PATCHES:
        assert entry.changes and entry.upstream and entry.verified, entry.name
        assert ":" in entry.target and entry.attribute, entry.name
        if not entry.temporary:
            assert callable(patches.implementation(entry.name)), entry.name


def test_an_unknown_need_is_named():
    with pytest.raises(ValueError) as e:
        patches.install("mirrored_plus")
    assert str(e.value) == (
        "Argument 'need' must be None or one of ['multi_worker', 'parameter_server', 'sharded_parameters']. "
        "Received: need='mirrored_plus'"
    )


@pytest.mark.usefixtures("pristine")
def test_an_attribute_replaced_again_after_tfdist_is_not_silently_clobbered():
    patches.install_named("Variable.__int__")
    owner, attribute = patches.resolve(patches.patch("Variable.__int__"))
    ours = vars(owner)[attribute]

    def someone_elses(self):
        return 7

    setattr(owner, attribute, someone_elses)
    try:
        with pytest.raises(RuntimeError) as e:
            patches.uninstall()
        assert str(e.value) == (
            "tfdist cannot undo its patch 'Variable.__int__': Variable.__int__ was replaced again after "
            "tfdist patched it. Undo that change first."
        )
    finally:
        setattr(owner, attribute, ours)
        patches.uninstall()


@pytest.mark.usefixtures("pristine")
def test_int_of_the_iterations_under_a_strategy_needs_its_patch():
    # The registry's Variable.__int__: without it, int() of a mirrored variable raises (stock tf.distribute too).
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[2])
    with strategy.scope():
        counter = keras.Variable(np.int64(3), dtype="int64")
    assert int(counter) == 3
    patches.uninstall()
    with pytest.raises(TypeError, match="MirroredVariable"):
        int(counter)
    assert isinstance(tf.constant(1), tf.Tensor)


COMPAT_DOC = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "compat.md"
BEGIN, END = "<!-- patch registry: generated by tests/test_patches.py -->", "<!-- end of the patch registry -->"


def render_registry() -> str:
    """The registry as docs/compat.md shows it: one row per patch, then the changes to single objects."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        BEGIN,
        "| patch | replaces | installed | what changes | upstream | verified on |",
        "|---|---|---|---|---|---|",
    ]
    for p in patches.PATCHES:
        when = "for one call" if p.temporary else ("every tfdist strategy" if not p.needs else
                                                   "needs: " + ", ".join(p.needs))
        lines.append(f"| `{p.name}` | `{p.target}` | {when} | {cell(p.changes)} | {cell(p.upstream)} | "
                     f"{cell(p.verified)} |")
    lines += ["", "Changes to single objects (not process-wide; made by the function named):", "",
              "| function | object | what changes | upstream |", "|---|---|---|---|"]
    for function, obj, what, upstream in patches.OBJECT_CHANGES:
        lines.append(f"| `{function}` | {cell(obj)} | {cell(what)} | {cell(upstream)} |")
    lines.append(END)
    return "\n".join(lines)


def test_docs_compat_shows_the_registry_as_it_is():
    text = COMPAT_DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    start, end = text.index(BEGIN), text.index(END) + len(END)
    table = render_registry()
    if __import__("os").environ.get("TFDIST_UPDATE_DOCS"):
        COMPAT_DOC.write_text(text[:start] + table + text[end:])
        text = COMPAT_DOC.read_text()
    assert text[start:text.index(END) + len(END)] == table, (
        "docs/compat.md's patch table differs from tfdist/_compat/patches.py; rerun with TFDIST_UPDATE_DOCS=1"
    )

"""Every private Keras and TensorFlow name `tfdist._compat` reads exists in the installed versions.

The names come from one declared table, `tfdist._compat.private_names`, and
the patch registry's targets (`tfdist._compat.patches.PATCHES`). A test reads
`_compat`'s source with `ast` and fails on a private name the table lacks, so
the table stays whole; the others check each name against the installed
Keras and TensorFlow (on the newest in `make test`, on the oldest in `make
test-compat`): a release that renames one fails here, not in a user's run.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist._compat import patches, private_names, versions

COMPAT = pathlib.Path(tfdist.__file__).resolve().parent / "_compat"
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.core", "tf_keras.src")
# Modules of the table itself: they read no Keras or TensorFlow name.
NOT_READERS = ("private_names.py", "versions.py", "patches.py", "__init__.py")


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__") and not attr.startswith("_tfdist")


def private_names_read(path: pathlib.Path) -> dict[str, list[int]]:
    """`{name: lines}` of the private names a module reads, in the table's spellings.

    `from keras.src.x import y [as z]` reads `"keras.src.x:y"`, and `z.attr`
    then reads `"keras.src.x:y.attr"`; `obj._attr` (and `getattr(obj,
    "_attr")`) reads `"._attr"` unless `obj` is `self`/`cls` inside a method of
    a class `_compat` defines itself (`self` of a wrapper is Keras's object).
    """
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bound: dict[str, str] = {}
    found: dict[str, list[int]] = {}

    def add(name: str, line: int) -> None:
        found.setdefault(name, []).append(line)

    def own_method(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return isinstance(parents.get(node), ast.ClassDef)
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}:{alias.name}"
                add(f"{node.module}:{alias.name}", node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PRIVATE_MODULES):
                    raise AssertionError(f"{path.name}:{node.lineno}: write `from {alias.name} import ...`")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id in bound:
                add(f"{bound[base.id]}.{node.attr}", node.lineno)
            elif _private(node.attr) and not (
                isinstance(base, ast.Name) and base.id in ("self", "cls") and own_method(node)
            ):
                add(f".{node.attr}", node.lineno)
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            add(f".{node.args[1].value}", node.lineno)
    return found


def _resolve(path: str):
    """`"module:dotted.path"` imported and followed attribute by attribute."""
    module, _, rest = path.partition(":")
    found = importlib.import_module(module)
    for part in filter(None, rest.split(".")):
        found = getattr(found, part)
    return found


def _installed() -> dict:
    return versions.installed()


def test_every_private_name_compat_reads_is_declared():
    undeclared = []
    readers = sorted(p for p in COMPAT.glob("*.py") if p.name not in NOT_READERS)
    assert {p.name for p in readers} >= {"keras.py", "tf.py"}
    for path in readers:
        for name, lines in private_names_read(path).items():
            declared = name[1:] in private_names.ATTRIBUTES if name.startswith(".") else name in private_names.NAMES
            if not declared:
                undeclared.append(f"{path.name}:{lines[0]}: {name}")
    assert undeclared == [], (
        "private names read in tfdist/_compat but missing from tfdist/_compat/private_names.py "
        "(declare each, with its owner and version gate):\n" + "\n".join(sorted(undeclared))
    )


def test_the_reader_finds_imports_aliases_attributes_and_strings(tmp_path):
    # The completeness check above is only as good as this reader.
    source = tmp_path / "probe.py"
    source.write_text(
        "from keras.src.losses import loss as loss_module\n"
        "class Own:\n"
        "    def method(self):\n"
        "        return self._mine\n"
        "def wrapper(self, model):\n"
        "    loss_module.apply_mask(self._metrics)\n"
        "    return getattr(model, '_compile_loss', None), model._tfdist_state\n"
    )
    assert sorted(private_names_read(source)) == [
        "._compile_loss", "._metrics", "keras.src.losses:loss", "keras.src.losses:loss.apply_mask",
    ]


def test_every_declared_private_name_exists_in_the_installed_versions():
    installed = _installed()
    missing = []
    for name, gate in private_names.NAMES.items():
        if not private_names.applies(gate, installed):
            continue
        try:
            _resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name}: {type(error).__name__}: {error}")
    assert missing == [], _versions_line(installed) + "\n".join(missing)


@functools.cache
def _instances() -> dict:
    """One real object per owner whose private attributes are set per instance."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)
    model.fit(x, y, batch_size=2, verbose=0)
    variable = keras.Variable(np.ones((2,), np.float32))

    def built(optimizer):
        optimizer.build([keras.Variable(np.ones((2,), np.float32))])
        return optimizer

    from keras.src.backend.tensorflow.trainer import TFEpochIterator
    from tensorflow.python.distribute.values import PerReplicaSpec
    from tensorflow.python.trackable.data_structures import ListWrapper

    multi_worker = tfdist.get_strategy("multi_worker")
    masked = keras.layers.Embedding(4, 2, mask_zero=True)(tf.constant([[1, 0]]))
    out = {
        "keras:Model": model,
        "tensorflow:Tensor": masked,
        "keras.src.trainers.compile_utils:CompileLoss": model._compile_loss,
        "keras.src.optimizers.base_optimizer:BaseOptimizer": built(keras.optimizers.Adam(use_ema=True)),
        "keras:optimizers.Nadam": built(keras.optimizers.Nadam()),
        "keras:Variable": variable,
        "tensorflow:Variable": tf.Variable(1.0),
        "keras.src.backend.tensorflow.trainer:TFEpochIterator": TFEpochIterator(
            x=x, y=y, batch_size=2, distribute_strategy=tf.distribute.get_strategy()
        ),
        "keras:callbacks.BackupAndRestore": keras.callbacks.BackupAndRestore("unused-backup-dir"),
        "tensorflow.python.distribute.collective_all_reduce_strategy:CollectiveAllReduceExtended":
            multi_worker.extended,
        "tensorflow.python.distribute.cross_device_ops:CollectiveAllReduce":
            multi_worker.extended._host_cross_device_ops,
        "tensorflow.python.distribute.values:PerReplicaSpec": PerReplicaSpec(tf.TensorSpec([1])),
        "tensorflow.python.trackable.data_structures:ListWrapper": ListWrapper([1]),
    }
    if hasattr(keras.optimizers, "MultiOptimizer"):
        out["keras:optimizers.MultiOptimizer"] = built(keras.optimizers.MultiOptimizer(lambda v: keras.optimizers.SGD()))
    return out


def test_every_declared_private_attribute_exists_in_the_installed_versions():
    installed = _installed()
    missing = []
    for attr, (owner, gate) in private_names.ATTRIBUTES.items():
        if not private_names.applies(gate, installed):
            continue
        try:
            cls = _resolve(owner)
        except (ImportError, AttributeError) as error:
            missing.append(f"{attr}: its owner {owner}: {type(error).__name__}: {error}")
            continue
        if hasattr(cls, attr):
            continue
        instance = _instances().get(owner)
        if instance is None:
            missing.append(f"{attr}: not an attribute of {owner} (and the test makes no instance of it)")
        elif not hasattr(instance, attr):
            missing.append(f"{attr}: not an attribute of {owner} nor of its instance")
    assert missing == [], _versions_line(installed) + "\n".join(missing)


def test_every_patch_target_exists_in_the_installed_versions():
    missing = []
    for entry in patches.PATCHES:
        module, _, rest = entry.target.partition(":")
        try:
            owner = _resolve(f"{module}:{entry.owner_path}")
        except (ImportError, AttributeError) as error:
            missing.append(f"{entry.name} ({entry.target}): {type(error).__name__}: {error}")
            continue
        if not hasattr(owner, entry.attribute):
            missing.append(f"{entry.name} ({entry.target}): no attribute {entry.attribute!r}")
    assert missing == [], _versions_line(_installed()) + "\n".join(missing)


@pytest.mark.parametrize("gate,expected", [(None, True), (("keras", (3, 8)), True), (("keras", (99, 0)), False)])
def test_a_version_gate_applies_from_its_release_on(gate, expected):
    assert private_names.applies(gate, _installed()) is expected


def _versions_line(installed: dict) -> str:
    shown = ", ".join(f"{k} {'.'.join(map(str, v))}" for k, v in sorted(installed.items()))
    return f"Missing with {shown}:\n"


def private_name_count() -> int:
    """Distinct private names `_compat` reads: the table's entries and the patches' private targets."""
    targets = {p.target for p in patches.PATCHES if p.module.startswith(PRIVATE_MODULES) or _private(p.attribute)}
    return len(private_names.NAMES) + len(private_names.ATTRIBUTES) + len(targets)

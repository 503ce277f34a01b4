"""The module graph (issue 14): layered, without cycles, private APIs only in `tfdist/_compat/`.

Read from the source with `ast`, imports inside functions included:

* no import cycle among tfdist's modules;
* each layer imports only from layers below it (options/cluster/sharding/timing/datasets/
  devices → _compat → collectives/data → engine → strategies → integration,
  estimator, registry, cli);
* only `tfdist/_compat/` imports `keras.src`, `tensorflow.python` or
  `tf_keras.src`, or reads a private attribute (`obj._name`) of an object
  other than `self`/`cls` — up to a short list of tfdist's own private names.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tfdist"

# Lower number = lower layer; a module may import its own layer or lower ones.
LAYERS = {
    "tfdist.options": 0, "tfdist.cluster": 0, "tfdist.sharding": 0, "tfdist.devices": 0,
    "tfdist.timing": 0, "tfdist.datasets": 0,
    "tfdist._compat": 1,
    "tfdist.collectives": 2, "tfdist.data": 2,
    "tfdist.engine": 3,
    "tfdist.strategies": 4,
    "tfdist.precision": 5, "tfdist.memory": 5, "tfdist.keras_integration": 5, "tfdist.checkpointing": 5,
    "tfdist.resume": 5, "tfdist.preemption": 5,
    "tfdist.estimator": 5,
    "tfdist.registry": 5, "tfdist.launch": 5, "tfdist.demo": 6, "tfdist.cli": 6, "tfdist": 7,
}

PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tf_keras.src")

# tfdist's own private names, read across its own objects (not Keras's or TensorFlow's).
OWN_PRIVATE = {
    ("tfdist.estimator.estimator", "_call_model_fn"),  # Estimator's, as in TF1's Estimator
    ("tfdist.options", "_values"),  # TrainingOptions.__eq__
    ("tfdist.strategies.parameter_server", "_exit"),  # os._exit: a documented os function
    ("tfdist.preemption", "_exit"),  # os._exit: a documented os function
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """(imported module name, line) for every import in the file, nested ones included."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), node.lineno


def _tfdist_edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _ in _imports(name, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and target != "tfdist":
                graph[name].add(target)
    return graph


def _layer(name: str) -> int:
    while name not in LAYERS:
        name = name.rpartition(".")[0]
    return LAYERS[name]


def test_no_import_cycles_among_tfdist_modules():
    graph = _tfdist_edges()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_module_imports_only_its_layer_or_lower():
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in _tfdist_edges().items()
        for target in sorted(targets)
        if _layer(target) > _layer(name)
    ]
    assert upward == []


def test_private_keras_and_tensorflow_modules_are_imported_only_in_compat():
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {target}"
        for name, path in MODULES.items()
        if not name.startswith("tfdist._compat")
        for target, line in _imports(name, path)
        if target.startswith(PRIVATE_MODULES)
    ]
    assert found == []


def test_private_attributes_are_read_only_in_compat():
    found = []
    for name, path in MODULES.items():
        if name.startswith("tfdist._compat"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr.startswith("_tfdist"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if (name, attr) in OWN_PRIVATE:
                continue
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: .{attr}")
    assert found == []


def test_private_attributes_are_not_read_by_name_outside_compat():
    # getattr/hasattr/setattr/delattr(obj, "_private") is the same reach-in, spelled as a string.
    found = []
    for name, path in MODULES.items():
        if name.startswith("tfdist._compat"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr", "setattr", "delattr") or len(node.args) < 2:
                continue
            target, attr = node.args[0], node.args[1]
            if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
                continue
            text = attr.value
            if not text.startswith("_") or text.startswith("__") or text.startswith("_tfdist"):
                continue
            if isinstance(target, ast.Name) and target.id in ("self", "cls"):
                continue
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.func.id}(..., {text!r})")
    assert found == []


def test_compat_imports_no_other_tfdist_module():
    outside = [
        f"{name} imports {target}"
        for name, targets in _tfdist_edges().items()
        if name.startswith("tfdist._compat")
        for target in targets
        if not target.startswith("tfdist._compat")
    ]
    assert outside == []

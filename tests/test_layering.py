"""The module graph (issue 14): layered, without cycles, private APIs only in `tfdist/_compat/`.

Read from the source with `ast`, with no exemptions: imports inside functions,
`import tfdist` itself (the package, the top layer) and `importlib.import_module`
with a constant name all count:

* no import cycle among tfdist's modules;
* each layer imports only from layers below it (options/cluster/sharding/timing/datasets/
  devices → _compat → collectives/data → engine → strategies → integration,
  estimator, registry → demo, cli → the `tfdist` package);
* `importlib.import_module` with a computed name only in the top layer (the
  package's lazy `__getattr__`), where every target is below;
* only `tfdist/_compat/` imports `keras.src`, `tensorflow.python` or
  `tf_keras.src`, or reads a private attribute (`obj._name`) of an object
  other than `self`/`cls` — up to a short list of tfdist's own private names;
* no module but a strategy's own compares a strategy's name or class name.
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
    "tfdist.registry": 5, "tfdist.launch": 5, "tfdist.report": 5, "tfdist.callbacks": 5,
    "tfdist.demo": 6, "tfdist.tuning": 6, "tfdist.cli": 6, "tfdist": 7,
}

PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tf_keras.src")
COMPUTED = "<computed>"
TOP = "tfdist"

# tfdist's own private names, read across its own objects (not Keras's or TensorFlow's).
OWN_PRIVATE = {
    ("tfdist.estimator.estimator", "_call_model_fn"),  # Estimator's, as in TF1's Estimator
    ("tfdist.options", "_values"),  # TrainingOptions.__eq__
    ("tfdist.strategies.parameter_server", "_exit"),  # os._exit: a documented os function
    ("tfdist.report.recorder", "_exit"),  # os._exit: a tune trial ends its process
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


def _is_import_module(node: ast.AST) -> bool:
    """`importlib.import_module(...)` (or `<alias of importlib>.import_module(...)`, or `import_module(...)`)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def _imports(name: str, path: pathlib.Path):
    """(imported module name, line) for every import in the file, nested ones included.

    `importlib.import_module("x.y")` counts as `import x.y`; with a computed
    name it yields `("<computed>", line)`.
    """
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if _is_import_module(node):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield first.value, node.lineno
            else:
                yield COMPUTED, node.lineno
        elif isinstance(node, ast.Import):
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
    """Module → the tfdist modules it imports (`import tfdist` is an edge to the package, "tfdist")."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _ in _imports(name, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
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


def test_computed_module_imports_only_in_the_top_layer():
    # A computed `importlib.import_module(name)` can reach any module: only the
    # package itself (nothing above it) may use one, for its lazy attributes.
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: import_module(<computed name>)"
        for name, path in MODULES.items()
        for target, line in _imports(name, path)
        if target == COMPUTED and _layer(name) != LAYERS[TOP]
    ]
    assert found == []


def test_the_layering_check_sees_function_level_and_importlib_imports(tmp_path):
    # The rules above read these forms; a checker that missed them would pass vacuously.
    source = tmp_path / "probe.py"
    source.write_text(
        "import importlib\n"
        "def f():\n"
        "    import tfdist\n"
        "    importlib.import_module('tfdist.keras_integration')\n"
        "    importlib.import_module(f'tfdist.{f}')\n"
    )
    assert [t for t, _ in _imports("tfdist.engine.probe", source)] == [
        "importlib", "tfdist", "tfdist.keras_integration", COMPUTED,
    ]
    assert _layer("tfdist") > _layer("tfdist.engine")


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


def _strategy_names_by_module() -> dict[str, set[str]]:
    """Module of tfdist.strategies → the registry names (`name = "..."`) and class names it defines."""
    found: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if not name.startswith("tfdist.strategies."):
            continue
        own = found.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            own.add(node.name)
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else (
                    [statement.target] if isinstance(statement, ast.AnnAssign) else []
                )
                value = getattr(statement, "value", None)
                if any(isinstance(t, ast.Name) and t.id == "name" for t in targets) and isinstance(
                    value, ast.Constant
                ) and isinstance(value.value, str) and value.value:
                    own.add(value.value)
    return found


def _reads_a_name(node: ast.AST) -> bool:
    """`x.name`, `x.__name__`, `type(x).__name__`, `getattr(x, "name"...)`."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("name", "__name__")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in ("name", "__name__")
    )


def _strings(node: ast.AST, constants: dict[str, set[str]]) -> set[str]:
    """The string constants `node` stands for: a literal, a tuple/list/set of them, or a module constant of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e, constants) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    return set()


def name_comparisons(path: pathlib.Path, forbidden: set[str]) -> list[str]:
    """Comparisons (`==`, `!=`, `in`, `not in`) of a name read (`_reads_a_name`) with a string of `forbidden`."""
    tree = ast.parse(path.read_text())
    constants = {
        t.id: _strings(node.value, {})
        for node in tree.body if isinstance(node, ast.Assign)
        for t in node.targets if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if not any(_reads_a_name(o) for o in operands):
            continue
        named = set().union(*(_strings(o, constants) for o in operands)) & forbidden
        if named:
            found.append(f"{path}:{node.lineno}: compares a name with {sorted(named)}")
    return found


def test_no_module_recognises_a_strategy_by_its_name():
    # A strategy is asked for its declaration (asynchronous, host_loop, gradient_path,
    # unsupported(...)), never recognised by its registry name or class name outside its module.
    by_module = _strategy_names_by_module()
    every = set().union(*by_module.values())
    assert {"mirrored", "central_storage", "multi_worker", "parameter_server", "sharded_optimizer",
            "MirroredStrategy"} <= every
    found = [
        hit
        for name, path in MODULES.items()
        for hit in name_comparisons(path, every - by_module.get(name, set()))
    ]
    assert found == []


def test_the_name_check_sees_comparisons_in_every_spelling(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "KINDS = ('mirrored', 'central_storage')\n"
        "def f(strategy):\n"
        "    a = getattr(strategy, 'name', None) == 'parameter_server'\n"
        "    b = strategy.name in KINDS\n"
        "    c = type(strategy).__name__ != 'MirroredStrategy'\n"
        "    d = strategy.name == 'adam'\n"
    )
    hits = name_comparisons(source, {"parameter_server", "mirrored", "MirroredStrategy"})
    assert [h.rpartition(": ")[2] for h in hits] == [
        "compares a name with ['parameter_server']",
        "compares a name with ['mirrored']",
        "compares a name with ['MirroredStrategy']",
    ]

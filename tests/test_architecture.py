"""docs/ARCHITECTURE.md stays true (issue 37 item 7): its layer picture, its "where does my change go" table."""

from __future__ import annotations

import pathlib
import re

from tests.test_layering import LAYERS

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n## ", start + len(title))
    return DOC[start:] if end < 0 else DOC[start:end]


def test_layer_picture_is_the_layering_tests_layers():
    picture = _section("## Layers").split("```")[1]
    drawn: dict[str, int] = {}
    row = None
    for line in picture.strip("\n").splitlines():
        match = re.match(r"^(\d)\s+(.*)$", line)
        if match:
            row, names = int(match.group(1)), match.group(2)
        else:
            names = line
        for name in names.split():
            drawn["tfdist" if name == "tfdist" else f"tfdist.{name}"] = row
    assert drawn == LAYERS


def test_every_file_the_change_table_names_exists():
    table = _section("## Where does my change go")
    rows = [line for line in table.splitlines() if line.startswith("| a ")]
    assert [row.split("|")[1].strip() for row in rows] == [
        "a new strategy",
        "a new step option",
        "a GPU-specific fix in the update",
    ]
    for row in rows:
        edited = row.split("|")[2]
        files = set(re.findall(r"`((?:tfdist|tests|docs)/[\w/<>.]+\.(?:py|md))`", edited))
        assert 1 <= len(files) <= 3, (row, files)
        paths = set(re.findall(r"`((?:tfdist|tests|docs)/[\w/<>.]+\.(?:py|md))`", row))
        for path in paths:
            if "<name>" not in path:
                assert (REPO / path).is_file(), path


def test_a_strategy_exported_by_the_strategies_package_is_registered_without_more():
    import tfdist
    from tfdist import strategies

    exported = {
        cls.name
        for cls in (getattr(strategies, name) for name in strategies.__all__)
        if isinstance(cls, type) and issubclass(cls, strategies.TfdistStrategy) and cls.name
    }
    assert set(tfdist.strategy_names()) == exported
    # No hand-kept list of strategy classes in the registry.
    assert not re.search(r"strategies\.(?!TfdistStrategy)\w+Strategy\b", (REPO / "tfdist" / "registry.py").read_text())


def test_the_step_option_row_names_where_the_step_composes_its_transforms():
    step = (REPO / "tfdist" / "engine" / "step.py").read_text()
    assert "self.reduced = update.compose(" in step
    options = (REPO / "tfdist" / "options.py").read_text()
    assert "STEP_OPTIONS: dict[str, Option] = {" in options

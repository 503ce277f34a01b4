"""The README tells what the tests measured (issue 3, issue 7 item 7)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def test_readme_feature_matrix_is_the_generated_one():
    # docs/feature_matrix.md is generated and checked by tests/engine/test_matrix.py.
    readme = read("README.md")
    generated = [line for line in read("docs/feature_matrix.md").splitlines() if line.startswith("|")]
    assert len(generated) >= 6
    for line in generated:
        assert line in readme, line


def test_readme_shows_the_two_setup_commands_and_every_strategy():
    import tfdist

    readme = read("README.md")
    assert "make demo" in readme and "make test" in readme
    for name in tfdist.strategy_names():
        assert f"| `{name}` |" in readme, name


def test_ci_runs_what_the_readme_promises():
    assert "make test" in read(".ci/run")


def test_readme_step_options_table_has_one_row_per_step_option():
    from tfdist.options import STEP_OPTIONS

    readme = read("README.md")
    table = readme[readme.index("| option | default | meaning |"):].split("\n\n")[0]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert rows == list(STEP_OPTIONS)

"""The `tfdist` command (issue 3)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import tfdist
from tfdist import cli, demo


def run_cli(*args, timeout=300):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, "-m", "tfdist.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.slow
def test_demo_trains_every_strategy_and_prints_the_table():
    out = run_cli("demo", "--epochs", "2", "--quiet", "--strategy", "mirrored", "--strategy", "central_storage")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    assert lines[header].split() == ["strategy", "replicas", "test", "loss", "accuracy", "samples/s"]
    rows = {}
    for line in lines[header + 2:]:
        m = re.match(r"^(\S+(?: device)?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$", line)
        assert m, line
        rows[m.group(1)] = (int(m.group(2)), float(m.group(3)), float(m.group(4)), int(m.group(5)))
    assert set(rows) == {"mirrored", "central_storage"}
    for name, (replicas, _loss, accuracy, rate) in rows.items():
        assert replicas == 2
        assert accuracy > 0.8, (name, accuracy)  # 2 epochs of Adam on digits
        assert rate > 0
    # Same data, seed and global batch: both strategies reach the same test loss.
    assert rows["mirrored"][1] == pytest.approx(rows["central_storage"][1], rel=1e-3)


def test_demo_runs_every_registered_strategy_that_fits_on_one_host():
    names = [name for name, _ in demo.demo_strategies()]
    assert {"mirrored", "central_storage"} <= set(names)
    assert set(names) <= set(tfdist.strategy_names())


def test_demo_rejects_unknown_strategy_and_bad_counts(capsys):
    assert cli.main(["demo", "--strategy", "ring", "--quiet", "--devices", "4"]) == 2
    assert "tfdist demo: unknown strategy 'ring'. Valid names: [" in capsys.readouterr().err
    # A cluster strategy printed an empty table and exited 0.
    assert cli.main(["demo", "--strategy", "multi_worker", "--quiet"]) == 2
    runnable = [name for name, _ in demo.demo_strategies()]
    assert capsys.readouterr().err.strip() == (
        f"tfdist demo: strategy 'multi_worker' needs a cluster of processes, which the demo does not start; it "
        f"runs {runnable}. Run a job of several processes with `tfdist launch` (docs/operations.md) or see "
        "examples/."
    )
    assert cli.main(["demo", "--epochs", "0"]) == 2
    assert capsys.readouterr().err.strip() == "tfdist demo: --epochs must be a positive integer. Received: --epochs 0"


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_format_table_aligns_columns():
    table = demo.format_table(
        [{"strategy": "mirrored", "replicas": 2, "loss": 0.25, "accuracy": 0.9, "samples_per_s": 812.4}]
    )
    assert table.splitlines()[2] == "mirrored                  2     0.2500    0.9000        812"

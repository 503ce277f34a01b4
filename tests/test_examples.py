"""The example scripts users copy still run (multi-worker, parameter-server and estimator
examples run in their own strategies' cluster tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "args",
    [
        ["--strategy", "mirrored", "--devices", "2", "--option", "bucket_bytes=0"],
        ["--preset", os.path.join(REPO, "strategies", "zero1.toml"), "--devices", "2"],
    ],
    ids=["mirrored", "zero1-preset"],
)
def test_single_host_example_trains(args, tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "single_host", "train.py"), *args,
         "--epochs", "2", "--save", str(tmp_path / "model.keras")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = float(re.search(r"test accuracy ([\d.]+)", out.stdout).group(1))
    assert accuracy > 0.85
    assert (tmp_path / "model.keras").exists()

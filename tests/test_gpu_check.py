"""`benchmarks/gpu_check.py --cpu-smoke`: every section of the GPU check runs on CPU, so the check cannot rot."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_smoke_runs_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["failures"] == []
    # 1 device: one replica against plain Keras, XLA through TensorFlow's forced GPU branch
    # (the whole-step program that crashed on the H200) and sinking.
    one = result["one"]
    assert one["forced_gpu_branch"] is True
    assert [(r["row"], r["config"]) for r in one["rows"]] == [
        ("wide MLP mixed_bfloat16 + XLA", "mirrored x1"), ("digits MLP sink 32", "mirrored x1"),
    ]
    assert all(r["samples_per_s"] > 0 and r["keras_samples_per_s"] > 0 for r in one["rows"])
    # 2 devices: zoo parity under every strategy, within the zoo's tolerance.
    parity = result["two"]["zoo_parity"]
    assert [(r["model"], r["strategy"]) for r in parity] == [
        ("mlp", s) for s in ("mirrored", "central_storage", "stage 1", "stage 2", "stage 3")
    ]
    assert all(r["status"] == "ok" and r["difference"] <= r["tolerance"] for r in parity)
    # Sinking at sink 32, sink 1 and the on-device bound, timed in the same rounds.
    assert {"mirrored x2", "mirrored x2 @ sink 1", "bound"} <= set(result["two"]["sinking"])
    # Against stock MirroredStrategy on the same devices.
    assert [r["config"] for r in result["two"]["vs_stock"]] == [
        "stock MirroredStrategy", "tfdist mirrored", "tfdist mirrored sink 32",
    ]
    # ZeRO: a peak and a step time per configuration.
    assert [z["config"] for z in result["zero"]] == ["mirrored adam", "stage 2", "stage 3"]
    assert all(z["peak_bytes"] > 0 and z["samples_per_s"] > 0 for z in result["zero"])
    # One table row per measurement, with its target where it has one.
    sections = {row["section"] for row in result["table"]}
    assert sections == {"1 device", "2 devices: zoo parity", "2 devices: sinking", "2 devices: vs stock",
                        "2 devices: ZeRO"}

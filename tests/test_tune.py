"""`tfdist.tune` and `tfdist tune` (issue 39): the step options tried on the digits MLP, the best written as a preset."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import DEVICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "tune_script.py")


def digits_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_tune_tries_each_option_on_the_digits_mlp_and_writes_the_best_as_a_preset(digits, tmp_path, capsys):
    x, y = digits
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)
    preset = tmp_path / "tuned.toml"
    result = tfdist.tune(digits_mlp, dataset, strategy="mirrored", steps=8, bucket_mib=[1], sink_sizes=[4],
                         apply=str(preset), devices=DEVICES[2])
    labels = [r["label"] for r in result["rows"]]
    assert labels[:3] == ["defaults", "bucket_bytes=1 MiB", "sink_size=4"]
    assert all(r["samples_per_s"] > 0 for r in result["rows"]), result["rows"]
    best = max(result["rows"], key=lambda r: r["samples_per_s"])
    assert result["best"] is best
    assert result["gain"] == pytest.approx(best["samples_per_s"] / result["rows"][0]["samples_per_s"])
    assert result["best_options"] == {"devices": DEVICES[2], **best["changed"]}
    strategy = tfdist.from_config(str(preset))
    assert strategy.name == "mirrored" and list(strategy.extended.worker_devices) == [
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
    for key, value in best["changed"].items():
        assert getattr(strategy.options, key) == value
    out = capsys.readouterr().out
    assert "setting" in out and "samples/s" in out and "vs defaults" in out
    assert f"best: {best['label']} at " in out


def test_tune_command_runs_the_script_once_per_setting_and_applies_the_best(tmp_path):
    preset = tmp_path / "tuned.toml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-m", "tfdist.cli", "tune", "--strategy", "mirrored", "--steps", "6", "--bucket-mib", "1",
         "--sink-sizes", "4", "--apply", str(preset), "--", sys.executable, SCRIPT, "{preset}"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("tfdist tune: ")]
    assert [line.split(": ")[1] for line in lines[:3]] == ["defaults", "bucket_bytes=1 MiB", "sink_size=4"]
    assert all(line.endswith(" samples/s") for line in lines), lines
    assert "the script trained to its end" not in done.stdout  # each trial ends once its steps are timed
    best = next(line for line in done.stdout.splitlines() if line.startswith("best: "))
    text = preset.read_text()
    assert text.startswith(f"# Written by tfdist tune: {best[len('best: '):].split(' at ')[0]}, ")
    assert 'strategy = "mirrored"' in text
    assert tfdist.from_config(str(preset)).name == "mirrored"


def test_tune_command_without_a_command_says_how(capsys):
    from tfdist import cli

    assert cli.main(["tune", "--strategy", "mirrored"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tfdist tune: no command given. Usage: tfdist tune --workers 2 -- python train.py {preset}")


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "Argument 'steps' must be an integer >= 1. Received: steps=0"),
    ({"sink_sizes": [0]}, "Argument 'sink_sizes' must hold integers >= 1. Received: sink_sizes=[0]"),
    ({"strategy": "nope"}, "Unknown strategy name 'nope'."),
])
def test_tune_names_a_bad_argument(kwargs, message):
    with pytest.raises(ValueError) as e:
        tfdist.tune(digits_mlp, None, **kwargs)
    assert str(e.value).startswith(message)


def test_tune_help_loads_no_tensorflow():
    # `tfdist tune --help` (and the launcher beside it) start at once: TensorFlow is loaded by the trials.
    done = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom tfdist import cli\ntry:\n    cli.main(['tune', '--help'])\n"
         "except SystemExit:\n    pass\nprint('tensorflow' in sys.modules)"],
        env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines()[-1] == "False"
    assert "usage: tfdist tune [--preset FILE | --strategy NAME] [--workers N]" in done.stdout

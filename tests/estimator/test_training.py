"""train_and_evaluate: the local loop, and every TF_CONFIG role in a real job started by `tfdist launch`."""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.estimator.digits import input_fn_for, model_fn
from tests.strategies.parity import strategy_for
from tfdist import estimator as est
from tfdist.launch import run_job

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "estimator", "digits_estimator.py")


def test_local_train_and_evaluate_evaluates_after_checkpoints_and_exports_once(digits, tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    x, y = digits
    estimator = est.Estimator(model_fn, model_dir=str(tmp_path / "model"), params={}, config=est.RunConfig(
        train_distribute=strategy_for("mirrored", 2), save_checkpoints_steps=10, tf_random_seed=0,
        log_step_count_steps=None, save_summary_steps=None))
    receiver = est.build_raw_serving_input_receiver_fn(tf.TensorSpec([64], tf.float32))
    evaluated = []
    original = estimator.evaluate

    def recording_evaluate(*args, **kwargs):
        result = original(*args, **kwargs)
        evaluated.append(result["global_step"])
        return result

    monkeypatch.setattr(estimator, "evaluate", recording_evaluate)
    result, exports = est.train_and_evaluate(
        estimator,
        est.TrainSpec(input_fn_for(x[:800], y[:800]), max_steps=25),
        est.EvalSpec(input_fn_for(x[1500:], y[1500:]), steps=None, throttle_secs=0,
                     exporters=[est.FinalExporter("digits", receiver),
                                est.LatestExporter("latest", receiver, exports_to_keep=2)]),
    )
    # After each checkpoint (10, 20, the final 25); the final one is not evaluated twice.
    assert evaluated == [10, 20, 25]
    assert result == original(input_fn_for(x[1500:], y[1500:]))
    export_dir = tmp_path / "model" / "export"
    # Latest after every evaluation (keeping 2), final once, at the end.
    assert [os.path.basename(os.path.dirname(p)) for p in exports] == ["latest", "latest", "latest", "digits"]
    assert sorted(os.listdir(export_dir / "latest")) == sorted(os.path.basename(p) for p in exports[1:3])
    assert len(os.listdir(export_dir / "digits")) == 1
    exports = [p for p in exports if os.path.dirname(p) == str(export_dir / "digits")]
    assert len(exports) == 1
    served = tf.saved_model.load(exports[0]).signatures["serving_default"](input=tf.constant(x[1500:]))
    assert float(np.mean(np.argmax(served["logits"].numpy(), 1) == y[1500:])) == pytest.approx(result["accuracy"])


@pytest.mark.cluster
@pytest.mark.slow
def test_chief_workers_ps_and_evaluator_under_tfdist_launch_then_resume_locally(tmp_path, capfd, caplog):
    model_dir = str(tmp_path / "model")
    status = run_job(
        [sys.executable, EXAMPLE, "--model-dir", model_dir, "--max-steps", "200", "--export"],
        workers=2, chief=True, ps=1, evaluator=True, env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=240,
    )
    out = capfd.readouterr().out
    assert status == 0, out[-3000:]
    assert "[chief:0]" in out and "on ParameterServerStrategy" in out
    # The evaluator evaluated the final checkpoint, exported it and exited by itself.
    assert "[evaluator:0]" in out and "Evaluated the final checkpoint (global step 200); evaluator exits." in out
    final = json.loads(out.split("[evaluator:0] final evaluation: ")[1].splitlines()[0])
    assert final["global_step"] == 200 and final["accuracy"] > 0.8
    with open(os.path.join(model_dir, "eval", "evaluated.json")) as f:
        assert json.load(f)["global_step"] == 200
    export = out.split("[evaluator:0] exported: ")[1].splitlines()[0]
    x, y = tfdist.datasets.load_digits()
    served = tf.saved_model.load(export).signatures["serving_default"](pixels=tf.constant(x[1500:]))
    assert float(np.mean(served["class"].numpy() == y[1500:])) == pytest.approx(final["accuracy"], abs=1e-6)

    # The same script, now without TF_CONFIG, resumes the job's checkpoint under mirrored.
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        import digits_estimator
    finally:
        sys.path.pop(0)
    os.environ.pop("TF_CONFIG", None)
    with caplog.at_level(logging.INFO, logger="tfdist.estimator"):
        resumed = digits_estimator.main(["--model-dir", model_dir, "--max-steps", "250", "--strategy", "mirrored"])
    assert resumed["global_step"] == 250
    log = caplog.text
    assert f"Restored {model_dir}/model.ckpt-200 (global step 200)." in log
    assert "Training from global step 200 to 250" in log


@pytest.mark.cluster
@pytest.mark.slow
def test_multi_worker_job_trains_in_step_and_only_the_chief_writes(tmp_path, capfd):
    model_dir = str(tmp_path / "model")
    status = run_job(
        [sys.executable, EXAMPLE, "--model-dir", model_dir, "--max-steps", "60", "--save-checkpoints-steps", "30"],
        workers=2, evaluator=True, env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=240,
    )
    out = capfd.readouterr().out
    assert status == 0, out[-3000:]
    losses = {w: [line.split("loss = ")[1].split(" ")[0] for line in out.splitlines()
                  if line.startswith(f"[worker:{w}]") and "global step 50/60: loss = " in line] for w in (0, 1)}
    # Synchronous: both workers saw the same global batches and report the same loss.
    assert len(losses[0]) == 1 and losses[0] == losses[1]
    saved = [line.split("]")[0] for line in out.splitlines() if "Saved checkpoint for global step" in line]
    assert saved == ["[worker:0", "[worker:0"]
    assert sorted(f for f in os.listdir(model_dir) if f.endswith(".index")) == ["model.ckpt-30.index", "model.ckpt-60.index"]
    assert "[evaluator:0] final evaluation: " in out
    final = json.loads(out.split("[evaluator:0] final evaluation: ")[1].splitlines()[0])
    assert final["global_step"] == 60

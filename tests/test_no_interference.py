"""Models outside tfdist strategies train exactly as without tfdist.

Two processes train every model of the zoo (tests/models/zoo.py) the same way,
with Keras alone — no strategy — with Dropout on (so the seed generator runs),
for 2 epochs with validation, then evaluate, predict, save and reload, and
read the iteration count with `int()`. One has imported tfdist and used it
without creating a strategy: its light parts (options, datasets, the cluster
config parser), `configure_local_devices`, `strategy_names`, and every
module of the package imported (the integration layer included). The other never imports tfdist. Weights, logs, evaluation and
predictions must be equal bit for bit, and the first process must end with
no patch of tfdist's registry installed.

The data is generated here (the MLP's digits come from tfdist) and handed to
both processes in one file, so the process without tfdist reads the same
arrays.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.models.zoo import SAMPLES, ZOO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 420

_CHILD = r"""
import os, pickle, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
mode, data_path, out_path, work = sys.argv[1:5]
sys.path.insert(0, os.getcwd())
if mode == "tfdist":
    import tfdist
    from tfdist import cluster, options

    options.TrainingOptions(accumulation_steps=2)
    cluster.parse_tf_config('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}')
    tfdist.datasets.load_digits()
    tfdist.configure_local_devices(2)
    assert tfdist.strategy_names()
    import importlib, pkgutil
    for module in pkgutil.walk_packages(tfdist.__path__, "tfdist."):
        if module.name != "tfdist.__main__":
            importlib.import_module(module.name)  # every module of the package, the integration too

import keras
import numpy as np
from tests.models.zoo import ZOO

with open(data_path, "rb") as f:
    data = pickle.load(f)
results = {}
for name, entry in ZOO.items():
    x, y = data[name]
    model = entry.make(seed=0, dropout=0.25)
    history = model.fit(x, y, batch_size=entry.batch_size, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x, y))
    path = os.path.join(work, f"{mode}-{name}.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    results[name] = {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True),
        "predict": model.predict(x, batch_size=entry.batch_size, verbose=0),
        "reloaded": reloaded.predict(x, batch_size=entry.batch_size, verbose=0),
        "iterations": int(model.optimizer.iterations),
    }
loaded = sorted(m for m in sys.modules if m == "tfdist" or m.startswith("tfdist."))
if mode == "tfdist":
    from tfdist._compat import patches
    results["installed patches"] = patches.installed()
    assert "tfdist.keras_integration" in loaded, loaded
else:
    assert loaded == [], loaded
with open(out_path, "wb") as f:
    pickle.dump(results, f)
"""


def _equal(a, b) -> bool:
    """Bit-for-bit equality of nested results (arrays by bytes and dtype)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.usefixtures("no_leftover_processes")
def test_zoo_trains_bit_identically_with_tfdist_imported_but_no_strategy(tmp_path):
    data_path = tmp_path / "data.pkl"
    with open(data_path, "wb") as f:
        pickle.dump({name: entry.data() for name, entry in ZOO.items()}, f)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("TFDIST_LOCAL_DEVICES", "TF_CONFIG")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    children = {
        mode: subprocess.Popen(
            [sys.executable, str(script), mode, str(data_path), str(tmp_path / f"{mode}.pkl"), str(tmp_path)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for mode in ("tfdist", "plain")
    }
    outputs = {}
    try:
        for mode, child in children.items():
            outputs[mode] = child.communicate(timeout=TIMEOUT_S)[0]
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
    for mode, child in children.items():
        assert child.returncode == 0, f"{mode} process failed:\n{outputs[mode][-4000:]}"
    with open(tmp_path / "tfdist.pkl", "rb") as f:
        with_tfdist = pickle.load(f)
    with open(tmp_path / "plain.pkl", "rb") as f:
        without = pickle.load(f)
    assert with_tfdist.pop("installed patches") == []
    assert sorted(with_tfdist) == sorted(without) == sorted(ZOO)
    different = [
        f"{name}: {part}"
        for name in ZOO
        for part in without[name]
        if not _equal(with_tfdist[name][part], without[name][part])
    ]
    assert different == []
    # Not vacuous: every model took its 2 epochs of steps and logged a loss for each.
    for name, entry in ZOO.items():
        assert without[name]["iterations"] == 2 * SAMPLES // entry.batch_size
        assert len(without[name]["history"]["loss"]) == 2

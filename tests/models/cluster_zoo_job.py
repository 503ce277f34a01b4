"""The cluster jobs of the model zoo conformance tests: every zoo model, one cluster each mode.

Run by `tests/models/test_cluster_conformance.py` in child processes, with
the repository on `PYTHONPATH`:

    python tests/models/cluster_zoo_job.py multi_worker OUT_DIR
    python tests/models/cluster_zoo_job.py parameter_server OUT_DIR EPOCHS

`multi_worker` is the script of each process of a 2-worker job (TF_CONFIG
set by `tfdist launch --workers 2`): it trains every zoo model in turn (dropout
0, one epoch of the zoo's data and global batch, `shuffle=False`), evaluates
it, and writes `<task>.npz` (each model's final weights) and `<task>.json`
(per model: iterations, evaluate, or the error it raised).

`parameter_server` starts TensorFlow's in-process cluster (2 worker and
1 ps `tf.distribute.Server`s in this process, the coordinator here, as
`tests/strategies/ps_in_process_job.py`), trains every zoo model
asynchronously for EPOCHS epochs and writes `parameter_server.json`: per
model the loss `evaluate` gives on the training data before and after `fit`,
the epochs' losses and the optimizer's iterations, or the error the model
raised and where (compile or fit). It exits with `os._exit`, since
in-process servers cannot be stopped and can hang interpreter shutdown.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two cores for the whole machine: one op thread per process.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import tfdist  # noqa: E402
from tests.models.zoo import ZOO  # noqa: E402

# Seconds a collective may wait for the other worker before the job fails
# (instead of hanging until the test's timeout).
COLLECTIVE_TIMEOUT_S = 60.0


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def multi_worker(out: str) -> None:
    strategy = tfdist.get_strategy("multi_worker", collective_timeout=COLLECTIVE_TIMEOUT_S)
    task = f"{strategy.cluster_config.task_type}{strategy.cluster_config.task_id}"
    results, weights = {"replicas": strategy.num_replicas_in_sync}, {}
    for name, entry in ZOO.items():
        x, y = entry.data()
        started = time.monotonic()
        try:
            with strategy.scope():
                model = entry.make(seed=0, dropout=0.0)
            model.fit(x, y, batch_size=entry.batch_size, epochs=1, shuffle=False, verbose=0)
            evaluation = model.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)
        except Exception as e:  # noqa: BLE001 (recorded; the test names it)
            results[name] = {"error": _error(e)}
            continue
        results[name] = {
            "iterations": int(model.optimizer.iterations.numpy()),
            "evaluate": {k: float(v) for k, v in evaluation.items()},
        }
        weights.update({f"{name}/{i}": w for i, w in enumerate(model.get_weights())})
        print(f"{task}: {name} trained in {time.monotonic() - started:.1f} s", flush=True)
    np.savez(os.path.join(out, f"{task}.npz"), **weights)
    with open(os.path.join(out, f"{task}.json"), "w") as f:
        json.dump(results, f)


def parameter_server(out: str, epochs: int) -> None:
    from tests.strategies.ps_in_process_job import create_in_process_cluster

    resolver, _servers = create_in_process_cluster(num_workers=2, num_ps=1)
    strategy = tfdist.get_strategy("parameter_server", cluster_resolver=resolver)
    results = {"num_workers": strategy.num_workers, "num_ps": strategy.num_ps}
    for name, entry in ZOO.items():
        x, y = entry.data()
        where, started = "compile", time.monotonic()
        try:
            with strategy.scope():
                model = entry.make(seed=0, dropout=0.0)
            where = "evaluate"
            initial = model.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)
            where = "fit"
            history = model.fit(x, y, batch_size=entry.batch_size, epochs=epochs, shuffle=False, verbose=0)
            where = "evaluate"
            final = model.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)
        except Exception as e:  # noqa: BLE001 (recorded; the test names it)
            results[name] = {"error": _error(e), "where": where}
            continue
        results[name] = {
            "initial_loss": float(initial["loss"]),
            "final_loss": float(final["loss"]),
            "epoch_losses": [float(v) for v in history.history["loss"]],
            "iterations": int(model.optimizer.iterations.numpy()),
        }
        print(f"parameter_server: {name} trained in {time.monotonic() - started:.1f} s", flush=True)
    with open(os.path.join(out, "parameter_server.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    if sys.argv[1] == "multi_worker":
        multi_worker(sys.argv[2])
    else:
        parameter_server(sys.argv[2], int(sys.argv[3]))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

"""One worker of the preemption and resize jobs (tests/test_preemption.py, tests/test_slurm.py).

Trains the digits MLP (Adam) under `--strategy` on a fixed global batch, with
`BackupAndRestore(--out/backup, save_freq=--save-every)`, as a script a user
would write. What the tests read:

* `--out/pid-<task>-<run>`: this process's pid, once training has begun;
* `--out/steps-<task>-<run>.txt`: the optimizer's step count after each trained
  step, one per line (a resumed epoch's skipped batches add none);
* `--out/snapshots/<run>/`: the chief's copy, before `fit`, of the backup this
  run resumes from (absent on the first run);
* `--out/final.npz`: the chief's weights at the end, and `DONE iterations=<n>`.

`<run>` counts this task's runs in `--out` (1, 2, ...). `--fail WORKERS:INDEX:STEPS`
makes worker INDEX of a job of WORKERS exit with status 1 after STEPS trained
steps (a worker lost for good: every restart at that size fails alike).
`--step-seconds` slows each step so a test's signal lands mid-training.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if __name__ == "__main__":
    # Two cores for the whole machine: one op thread per process.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

import tfdist  # noqa: E402

EXAMPLES, GLOBAL_BATCH, HIDDEN = 384, 48, 32


def dataset(global_batch: int = GLOBAL_BATCH) -> tf.data.Dataset:
    """The same batches in the same order in every run and at every size (seeded shuffle, then repeat)."""
    x, y = tfdist.datasets.load_digits()
    return tf.data.Dataset.from_tensor_slices((x[:EXAMPLES], y[:EXAMPLES])).shuffle(EXAMPLES, seed=0).repeat().batch(
        global_batch)


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class Trace(keras.callbacks.Callback):
    """Writes the optimizer's step count after each trained step; fails or slows on request."""

    def __init__(self, path: str, fail_after: int | None, step_seconds: float):
        super().__init__()
        self.path, self.fail_after, self.step_seconds = path, fail_after, step_seconds
        self.trained = 0

    def on_train_batch_end(self, batch, logs=None):
        if not logs:
            return  # a batch the resumed epoch skipped: already in the restored weights
        step = int(self.model.optimizer.iterations.numpy())
        self.trained += 1
        with open(self.path, "a") as f:
            f.write(f"{step}\n")
        if self.fail_after is not None and self.trained >= self.fail_after:
            print(f"FAILING after {self.trained} steps", flush=True)
            os._exit(1)
        time.sleep(self.step_seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="multi_worker")
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--fail", default=None, help="WORKERS:INDEX:STEPS")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)

    strategy = tfdist.get_strategy(args.strategy, **({"cluster": args.cluster} if args.cluster else {}))
    config = getattr(strategy, "cluster_config", None)
    task = f"{config.task_type}{config.task_id}" if config is not None else "worker0"
    workers = getattr(strategy, "num_workers", 1)
    run = 1
    while os.path.exists(os.path.join(args.out, f"steps-{task}-{run}.txt")) or os.path.exists(
            os.path.join(args.out, f"pid-{task}-{run}")):
        run += 1
    backup = os.path.join(args.out, "backup")
    if strategy.is_chief and os.path.exists(backup):
        shutil.copytree(backup, os.path.join(args.out, "snapshots", str(run)))
    fail_after = None
    if args.fail:
        size, index, steps = (int(v) for v in args.fail.split(":"))
        if workers == size and config is not None and config.task_id == index:
            fail_after = steps

    with strategy.scope():
        model = build()
    trace = Trace(os.path.join(args.out, f"steps-{task}-{run}.txt"), fail_after, args.step_seconds)
    with open(os.path.join(args.out, f"pid-{task}-{run}"), "w") as f:
        f.write(str(os.getpid()))
    model.fit(
        dataset(), epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=0, shuffle=False,
        # The trace before the backup: a preempted step's batch end reaches it before the save exits.
        callbacks=[trace, keras.callbacks.BackupAndRestore(backup, save_freq=args.save_every or "epoch",
                                                           delete_checkpoint=False)],
    )
    if strategy.is_chief:
        np.savez(os.path.join(args.out, "final.npz"), *model.get_weights())
        with open(os.path.join(args.out, "final.json"), "w") as f:
            json.dump({"iterations": int(model.optimizer.iterations.numpy()), "workers": workers}, f)
    print(f"DONE iterations={int(model.optimizer.iterations.numpy())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

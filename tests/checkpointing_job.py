"""One training process of the checkpoint fault tests (tests/test_checkpointing.py).

Trains a small Adam classifier under a tfdist strategy with, at each epoch's
end, `BackupAndRestore(--out/backup)` then `ModelCheckpoint(--out/model.keras)`
(a whole-model `.keras` save). Every layer is a `SlowSaveDense`: when its
variables have been written into a checkpoint it prints

    SAVING <backup|keras> epoch=<e> part=<k>

and, in the write named by `--slow-at WRITER:EPOCH`, sleeps `--slow` seconds,
so a test that reads these lines kills the process at a known point of that
write (part k of 4 written, the file still open). With
`--self-kill WRITER:EPOCH:PART` the chief SIGKILLs itself there instead, on the
job's first attempt only (`TFDIST_RESTART_COUNT` unset or 0). Keras's own save
runs unchanged; only this test layer's hook sleeps.

Also printed (and appended to `--out/log-<task>.txt`): `MODEL_KERAS
iterations=<n>` when a `model.keras` from an earlier run loads, `EPOCH <e>` as
each epoch begins, and `DONE` at the end, after which the final weights go to
`--out/final-<task>.npz`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if __name__ == "__main__":
    # Two cores for the whole machine: one op thread per process (before
    # tfdist configures the devices, which starts TensorFlow's runtime).
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

import tfdist  # noqa: E402

EXAMPLES, BATCH, LAYERS = 256, 64, 4
STATE = {"writer": None, "epoch": None, "part": 0, "slow": 0.0, "slow_at": None, "kill": None, "log": None}


def say(line: str) -> None:
    print(line, flush=True)
    if STATE["log"] is not None:
        with open(STATE["log"], "a") as f:
            f.write(line + "\n")


@keras.saving.register_keras_serializable("tfdist_tests")
class SlowSaveDense(keras.layers.Dense):
    """A Dense layer that announces (and, in the test child, slows) each save of its variables."""

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if STATE["writer"] is None:
            return
        where = (STATE["writer"], STATE["epoch"], STATE["part"])
        STATE["part"] += 1
        say(f"SAVING {where[0]} epoch={where[1]} part={where[2]}")
        if STATE["kill"] == where:
            os.kill(os.getpid(), signal.SIGKILL)
        if STATE["slow_at"] == where[:2]:
            time.sleep(STATE["slow"])


class Tag(keras.callbacks.Callback):
    """Names the write the next callback makes, for `SlowSaveDense`'s lines."""

    def __init__(self, writer: str):
        super().__init__()
        self.writer = writer

    def on_epoch_end(self, epoch, logs=None):
        STATE.update(writer=self.writer, epoch=epoch, part=0)


class Log(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        STATE["writer"] = None
        say(f"EPOCH {epoch}")


def build(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((64,))]
        + [SlowSaveDense(64, activation="relu", name=f"dense{i}") for i in range(LAYERS - 1)]
        + [SlowSaveDense(10, name=f"dense{LAYERS - 1}")]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data():
    x, y = tfdist.datasets.load_digits()
    return x[:EXAMPLES], y[:EXAMPLES]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="mirrored")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--slow-at", default=None, help="WRITER:EPOCH")
    parser.add_argument("--self-kill", default=None, help="WRITER:EPOCH:PART")
    args = parser.parse_args(argv)

    strategy = tfdist.get_strategy(args.strategy)
    chief = getattr(strategy, "is_chief", True)
    task = "worker0"
    if getattr(strategy, "cluster_config", None) is not None:
        task = f"{strategy.cluster_config.task_type}{strategy.cluster_config.task_id}"
    STATE["log"] = os.path.join(args.out, f"log-{task}.txt")
    attempt = int(os.environ.get("TFDIST_RESTART_COUNT", "0"))
    say(f"START attempt={attempt}")
    STATE["slow"] = args.slow
    if args.slow_at:
        writer, epoch = args.slow_at.split(":")
        STATE["slow_at"] = (writer, int(epoch))
    if args.self_kill and chief and attempt == 0:
        writer, epoch, part = args.self_kill.split(":")
        STATE["kill"] = (writer, int(epoch), int(part))

    saved = os.path.join(args.out, "model.keras")
    if os.path.exists(saved):
        loaded = keras.models.load_model(saved)
        say(f"MODEL_KERAS iterations={int(loaded.optimizer.iterations.numpy())}")
    with strategy.scope():
        model = build()
    x, y = data()
    model.fit(
        x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0,
        callbacks=[
            Tag("backup"),
            keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup"), delete_checkpoint=False),
            Tag("keras"),
            keras.callbacks.ModelCheckpoint(saved),
            Log(),
        ],
    )
    STATE["writer"] = None
    np.savez(os.path.join(args.out, f"final-{task}.npz"), *model.get_weights())
    say(f"DONE iterations={int(model.optimizer.iterations.numpy())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

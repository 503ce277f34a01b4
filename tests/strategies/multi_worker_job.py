"""One process of the multi-worker test jobs (started by `tfdist.launch.run_job`).

Trains the conftest digits classifier under tfdist's multi_worker strategy and
writes what the tests compare to `--out`: `<task>.npz` (final weights) and
`<task>.json` (history, iterations, evaluate, predict). The chief appends one
line per finished epoch to `epochs.log` and per batch to `batches.log`.

With `--crash-epoch E --crash-batch B`, worker 1 kills itself with SIGKILL at
that batch on the job's first attempt (`TFDIST_RESTART_COUNT=0`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two cores for the whole machine: one op thread per worker.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import custom_loop  # noqa: E402  (tests/strategies/custom_loop.py, beside this script)
import keras  # noqa: E402

import tfdist  # noqa: E402
from tfdist.collectives import collective_ops_in  # noqa: E402

STEPS = 640  # 20 steps of 32


def build(seed: int = 0, **compile_kwargs):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    return model


def build_batchnorm(seed: int = 0):
    """tests/conftest.py's build_model("batchnorm", metrics=()): non-synchronized BatchNorm."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, use_bias=False),
         keras.layers.BatchNormalization(momentum=0.5), keras.layers.ReLU(), keras.layers.Dense(10)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build_tf_keras(seed: int = 0):
    import tf_keras

    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential(
        [tf_keras.Input((64,)), tf_keras.layers.Dense(32, activation="relu"), tf_keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=tf_keras.optimizers.SGD(0.1),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class Recorder(keras.callbacks.Callback):
    """Chief: one line per finished batch and epoch; worker 1: the planned crash."""

    def __init__(self, out, is_chief, crash):
        super().__init__()
        self.out, self.is_chief, self.crash = out, is_chief, crash
        self.epoch = 0
        self.batch_logs = []  # every worker's per-batch logs
        self.attempt = int(os.environ.get("TFDIST_RESTART_COUNT", "0"))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append({k: float(v) for k, v in logs.items()})
        if self.crash and self.attempt == 0 and (self.epoch, batch) == self.crash:
            print(f"killing myself at epoch {self.epoch} batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.is_chief:
            with open(os.path.join(self.out, "batches.log"), "a") as f:
                f.write(f"{self.attempt} {self.epoch} {batch}\n")

    def on_epoch_end(self, epoch, logs=None):
        if self.is_chief:
            with open(os.path.join(self.out, "epochs.log"), "a") as f:
                f.write(f"{self.attempt} {epoch}\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--backup-dir")
    p.add_argument("--crash-epoch", type=int)
    p.add_argument("--crash-batch", type=int)
    p.add_argument("--writers", help="directory for TensorBoard logs and checkpoints")
    p.add_argument("--tf-data", action="store_true", help="also train a second model on a tf.data dataset")
    p.add_argument("--tf-keras", action="store_true", help="also train a tf-keras model")
    p.add_argument("--batchnorm", action="store_true", help="also train a model with BatchNorm (not synchronized)")
    p.add_argument("--custom-loop", action="store_true", help="also train with custom_loop.py's loop")
    p.add_argument("--dropout-masks", action="store_true", help="also record each worker's dropout masks")
    args = p.parse_args()

    strategy = tfdist.get_strategy("multi_worker", collective_timeout=120.0)
    task = f"{strategy.cluster_config.task_type}{strategy.cluster_config.task_id}"
    x, y = tfdist.datasets.load_digits()
    x, y = x[:STEPS], y[:STEPS]
    crash = (args.crash_epoch, args.crash_batch) if args.crash_epoch is not None else None

    with strategy.scope():
        model = build()
    callbacks = [Recorder(args.out, strategy.is_chief, crash)]
    if args.backup_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(args.backup_dir, delete_checkpoint=False))
    if args.writers:
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(args.writers, "tb")))
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.writers, "ckpt.weights.h5"),
                                                         save_weights_only=True))
    validation = (x[:100], y[:100]) if args.writers else None
    history = model.fit(x, y, batch_size=32, epochs=args.epochs, shuffle=False, verbose=2, callbacks=callbacks,
                        validation_data=validation)
    result = {
        "task": task,
        "is_chief": strategy.is_chief,
        "replicas": strategy.num_replicas_in_sync,
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": history.history,
        "batch_logs": callbacks[0].batch_logs,
        "train_collectives": collective_ops_in(model.train_function.traced_graphs[-1]),
        "evaluate": model.evaluate(x, y, batch_size=50, verbose=0, return_dict=True),
        "predict": model.predict(x[:101], batch_size=32, verbose=0).tolist(),
    }
    weights = {f"keras3_{i}": w for i, w in enumerate(model.get_weights())}

    if args.tf_data:
        # Four steps per host call: the metrics are read once per call, in one all-reduce.
        with strategy.scope():
            data_model = build(steps_per_execution=4)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        result["sink_history"] = data_model.fit(ds, epochs=1, verbose=0).history
        result["sink_collectives"] = collective_ops_in(data_model.train_function.traced_graphs[-1])
        weights.update({f"tfdata_{i}": w for i, w in enumerate(data_model.get_weights())})

    if args.batchnorm:
        with strategy.scope():
            bn_model = build_batchnorm()
        bn_model.fit(x[:192], y[:192], batch_size=64, epochs=1, shuffle=False, verbose=0)
        weights.update({f"batchnorm_{i}": w for i, w in enumerate(bn_model.get_weights())})

    if args.custom_loop:
        loop_model, loop_optimizer, scales = custom_loop.train(strategy, custom_loop.clipped_loss_scaled_adam, **custom_loop.EVERY_FIX)
        result["custom_loop"] = {"scales": scales, "iterations": int(loop_optimizer.iterations.numpy())}
        weights.update({f"loop_{i}": w for i, w in enumerate(loop_model.get_weights())})

    if args.dropout_masks:
        with strategy.scope():
            dropout = keras.layers.Dropout(0.5, seed=7)

        @tf.function
        def draw():
            return strategy.run(lambda: dropout(tf.ones((1, 64)), training=True))

        result["dropout_masks"] = [strategy.experimental_local_results(draw())[0].numpy()[0].tolist()
                                   for _ in range(2)]

    if args.tf_keras:
        with strategy.scope():
            legacy = build_tf_keras()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        legacy_history = legacy.fit(ds, epochs=1, verbose=0)
        result["tf_keras_loss"] = legacy_history.history["loss"]
        weights.update({f"tf_keras_{i}": w for i, w in enumerate(legacy.get_weights())})

    np.savez(os.path.join(args.out, f"{task}.npz"), **weights)
    with open(os.path.join(args.out, f"{task}.json"), "w") as f:
        json.dump(result, f)
    print(f"done: {task} iterations={result['iterations']}", flush=True)


if __name__ == "__main__":
    main()

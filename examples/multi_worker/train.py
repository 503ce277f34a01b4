"""Multi-worker training with Keras 3 and tfdist: TensorFlow's "multi-worker training with
Keras" tutorial on the bundled digits, with the strategy line changed to tfdist.

Every worker runs this same script; TF_CONFIG tells each one where it is. Locally:

    tfdist launch --workers 2 -- python examples/multi_worker/train.py --model-dir DIR

On Kubernetes (tfjob.yaml) or Slurm (slurm.sbatch) the cluster manager starts
the processes (with `--slurm`, the job is read from Slurm's variables); see
README.md in this directory. Without TF_CONFIG the script runs as one process.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402


def digits_dataset(global_batch_size: int) -> tf.data.Dataset:
    x, y = tfdist.datasets.load_digits(flatten=False)
    # Every worker builds the same pipeline and keeps its share of each global
    # batch (auto-shard by data), so the shuffle must be seeded alike everywhere.
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=0)
        .repeat()
        .batch(global_batch_size)
    )


def build_and_compile_cnn_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(learning_rate=0.05),
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=28)
    parser.add_argument("--per-worker-batch-size", type=int, default=64)
    parser.add_argument("--slurm", action="store_true", help="read the job from Slurm (srun) instead of TF_CONFIG")
    parser.add_argument("--collective-timeout", type=float, default=None,
                        help="seconds a collective waits for a lost worker before failing (default: forever)")
    # No default: every worker, and every restart, must name the same folder
    # (the backup to resume from), so neither a fixed /tmp path nor a fresh
    # temporary directory would do.
    parser.add_argument("--model-dir", required=True,
                        help="checkpoints, TensorBoard logs, backups and the final model (shared by all workers)")
    args = parser.parse_args()

    # The one changed line: was `tf.distribute.MultiWorkerMirroredStrategy()`.
    strategy = tfdist.get_strategy(
        "multi_worker", cluster="slurm" if args.slurm else None, collective_timeout=args.collective_timeout
    )
    print(f"{strategy!r}, chief={strategy.is_chief}", flush=True)

    global_batch_size = args.per_worker_batch_size * strategy.num_workers
    dataset = digits_dataset(global_batch_size)

    with strategy.scope():
        model = build_and_compile_cnn_model()

    callbacks = [
        # Resumes from the last finished epoch when the job is restarted
        # (`tfdist launch --restarts K`, or the cluster manager's restart).
        keras.callbacks.BackupAndRestore(os.path.join(args.model_dir, "backup")),
        # Written by the chief; the other workers write to temporary directories.
        keras.callbacks.ModelCheckpoint(os.path.join(args.model_dir, "ckpt", "epoch{epoch}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.TensorBoard(os.path.join(args.model_dir, "logs")),
    ]
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, callbacks=callbacks, verbose=2)

    # Every worker saves (saving may need all of them); only the chief's copy is kept.
    path = strategy.write_dir(os.path.join(args.model_dir, "model.keras"))
    model.save(path)
    strategy.remove_write_dir(path)
    if strategy.is_chief:
        print(f"saved {path}", flush=True)


if __name__ == "__main__":
    main()

"""Multi-worker training with Keras 3 and tfdist: TensorFlow's "multi-worker training with
Keras" tutorial on the bundled digits, with the strategy line changed to tfdist.

Every worker runs this same script; TF_CONFIG tells each one where it is. Locally:

    tfdist launch --workers 2 -- python examples/multi_worker/train.py --model-dir DIR

On Slurm (slurm.sbatch, `--cluster slurm`) or Kubernetes (examples/kubernetes/,
`--cluster kubernetes`) the cluster manager starts the processes; see README.md
in this directory. Without TF_CONFIG the script runs as one process.

The job may stop and resume at another size: SIGTERM or SIGINT to any worker
(or to `tfdist launch`) makes every worker save the backup in --model-dir at
the next step and exit 0; the same command, at any number of workers, resumes
at the step after it. The global batch is fixed (--global-batch-size), and each
worker's share of it follows the job's size.
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
    parser.add_argument("--global-batch-size", type=int, default=128,
                        help="examples per step over the whole job: the same at any number of workers")
    parser.add_argument("--strategy", choices=["multi_worker", "sharded_optimizer"], default="multi_worker")
    parser.add_argument("--cluster", choices=["tf_config", "slurm", "kubernetes"], default=None,
                        help="where the job is described: TF_CONFIG (default; tfdist launch sets it), the Slurm "
                             "job step (srun), or the Kubernetes Indexed Job")
    parser.add_argument("--slurm", action="store_true", help="the same as --cluster slurm")
    parser.add_argument("--save-every", type=int, default=None,
                        help="also back up every N steps (default: at each epoch's end); a stop signal saves "
                             "at the next step anyway")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--collective-timeout", type=float, default=None,
                        help="seconds a collective waits for a lost worker before failing (default: 600)")
    # No default: every worker, and every restart, must name the same folder
    # (the backup to resume from), so neither a fixed /tmp path nor a fresh
    # temporary directory would do.
    parser.add_argument("--model-dir", required=True,
                        help="checkpoints, TensorBoard logs, backups and the final model (shared by all workers)")
    args = parser.parse_args()
    # The same initial weights and input order in every run and on every worker (the
    # shuffle's order follows the global seed too).
    keras.utils.set_random_seed(args.seed)

    # The one changed line: was `tf.distribute.MultiWorkerMirroredStrategy()`.
    options = {"cluster": "slurm" if args.slurm else args.cluster}
    if args.collective_timeout is not None:
        options["collective_timeout"] = args.collective_timeout
    strategy = tfdist.get_strategy(args.strategy, **{k: v for k, v in options.items() if v is not None})
    print(f"{strategy!r}, chief={strategy.is_chief}", flush=True)

    # Batch sizes given to Keras are global: each replica computes on its share.
    dataset = digits_dataset(args.global_batch_size)

    with strategy.scope():
        model = build_and_compile_cnn_model()

    callbacks = [
        # Resumes where the job stopped when it is started again (`tfdist launch
        # --restarts K`, the cluster manager's restart or requeue, a stop signal).
        keras.callbacks.BackupAndRestore(os.path.join(args.model_dir, "backup"),
                                         save_freq=args.save_every or "epoch"),
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

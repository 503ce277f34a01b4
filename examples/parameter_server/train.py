"""Parameter-server training with Keras 3 `model.fit`: one script for every task of the job.

Run locally (a chief, 2 workers, 1 ps task, each its own process; `--evaluator`
adds a sidecar evaluator process):

    tfdist launch --chief --workers 2 --ps 1 [--evaluator] -- python examples/parameter_server/train.py --out DIR

On worker and ps tasks `tfdist.get_strategy("parameter_server")` starts the
task's TensorFlow server and blocks until the job ends; only the chief gets
past it, builds the model and calls `fit`, which schedules steps on the
workers. Variables (here a partitioned embedding) live on the ps tasks.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tensorflow as tf

import tfdist

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--steps-per-epoch", type=int, default=50, help="steps per epoch, summed over workers")
parser.add_argument("--batch-size", type=int, default=32, help="batch size of each worker's step")
parser.add_argument("--out", default=None,
                    help="checkpoints go here; required on the chief and the evaluator (the same folder)")
args = parser.parse_args()

# Variables over 16 KiB are split in shards of at most 16 KiB, at most one per
# ps task: the embedding table (1088 x 16 floats) spreads over every ps task.
strategy = tfdist.get_strategy("parameter_server", variable_partitioner="max_shard_bytes:16384")
# Only the chief (and the sidecar evaluator, if any) runs what follows.
import keras  # noqa: E402

if args.out is None:
    # A restarted chief resumes from the folder it wrote, and the evaluator
    # reads it: neither a fixed /tmp path nor a fresh temporary one would do.
    parser.error(f"--out DIR is required on the {strategy.task_type} (checkpoints are written and read there)")

x, y = tfdist.datasets.load_digits()
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
tokens = (np.arange(64) * 17 + np.round(x * 16)).astype("int32")  # pixel position x value
split = 1500


def train_dataset(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
    # Built on each worker: every worker shuffles its own copy of the data.
    ds = tf.data.Dataset.from_tensor_slices((tokens[:split], y[:split]))
    return ds.shuffle(split).repeat().batch(args.batch_size).prefetch(2)


with strategy.scope():
    inputs = keras.Input((64,), dtype="int32")
    h = keras.layers.Embedding(64 * 17, 16, name="pixel_embedding")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

os.makedirs(args.out, exist_ok=True)
checkpoint = os.path.join(args.out, "model.weights.h5")
if strategy.task_type == "evaluator":
    # The sidecar evaluator (tfdist launch --evaluator): evaluates each checkpoint the chief
    # writes, while training goes on; exits when the job ends.
    strategy.evaluate_checkpoints(model, (tokens[split:], y[split:]), checkpoint)
model.fit(
    train_dataset,
    epochs=args.epochs,
    steps_per_epoch=args.steps_per_epoch,
    validation_data=(tokens[split:], y[split:]),
    callbacks=[
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup")),
        keras.callbacks.ModelCheckpoint(checkpoint, save_weights_only=True),
    ],
    verbose=2,
)
loss, accuracy = model.evaluate(tokens[split:], y[split:], verbose=0)
print(f"test loss {loss:.4f}, accuracy {accuracy:.4f}")

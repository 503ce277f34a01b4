# TensorFlow tutorial "Multi-worker training with Keras", offline and on tfdist.
# Original: https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras
#           (tensorflow/docs, site/en/tutorials/distribute/multi_worker_with_keras.ipynb)
#
# The notebook writes `mnist_setup.py` and `main.py` and starts one process per worker with its
# own TF_CONFIG. This one script is `main.py` followed by the notebook's later sections (dataset
# sharding, model saving and loading, checkpointing, BackupAndRestore), all run by every worker.
# Start it with `tfdist launch`, which gives each process its TF_CONFIG on free ports:
#
#     tfdist launch --workers 2 --restarts 1 -- python examples/tutorials/multi_worker_with_keras.py \
#         --work-dir /shared/dir [--interrupt-at 1]
#
# Changed from the original, and why:
# - `tf.distribute.MultiWorkerMirroredStrategy()` -> `tfdist.get_strategy("multi_worker")` (reads
#   the same TF_CONFIG): the strategy line is tfdist's.
# - `mnist_setup.py` is inlined (its two functions, unchanged but for the data line), so the
#   tutorial is one file.
# - `tf.keras.datasets.mnist.load_data()` -> `offline_datasets.mnist_load_data()`: no download; same
#   arrays (uint8 (N, 28, 28) images, uint8 labels), 1,500 training images (the bundled 8x8 digits
#   scaled to 28x28) instead of 60,000; `shuffle(60000)` -> `shuffle(1500)` to match.
# - `tf.keras.layers.InputLayer(input_shape=(28, 28))` -> `InputLayer(shape=(28, 28))`: Keras 3's
#   argument name.
# - `epochs=3, steps_per_epoch=70` -> `--epochs` (default 3) and `--steps-per-epoch` (default 5);
#   the reloaded and the restored model keep `epochs=2` with `steps_per_epoch=20` -> the same
#   `--steps-per-epoch`; every fit gets `verbose=2`. Runs in seconds.
# - `model_path = '/tmp/keras-model'` -> `<work-dir>/keras-model.keras` (Keras 3 saves `.keras`
#   files); `checkpoint_dir = '/tmp/ckpt'` and `backup_dir='/tmp/backup'` -> under `--work-dir`
#   (required: every worker must see the same directory): never a fixed /tmp path.
# - The notebook's single-worker warm-up fit (no strategy, before the cluster exists) is left out;
#   its `single_worker_dataset = mnist_setup.mnist_dataset(batch_size)` is made where the reloaded
#   model uses it. The first fit's result is kept (`history = ...`). The notebook cells that print TF_CONFIG, echo an environment variable or kill background
#   processes are notebook plumbing, left out.
# - The notebook reloads the saved model and the checkpoint after the worker processes have ended.
#   Here the workers go on, so `wait_for_all_workers()` (added; an all-reduce, which returns only
#   when every worker has reached it) keeps a worker from reading before the chief has written.
# - The notebook's three BackupAndRestore examples (default, `save_freq='epoch'`, `save_freq=30`):
#   the first two are the same; the script runs the default one and the `save_freq` one, with
#   `save_freq` = `--steps-per-epoch` // 2 (was 30 of 70).
# - Added `--interrupt-at EPOCH`: worker 1 kills itself (SIGKILL) in that epoch of the first
#   BackupAndRestore fit, on the job's first attempt (`TFDIST_RESTART_COUNT=0`). With
#   `tfdist launch --restarts 1` the whole job restarts and the fit resumes from the backup: the
#   failure the tutorial's fault-tolerance section describes. The `Interruption` callback that does
#   it (and records the epoch the fit starts at) is added to that fit's callbacks.
# - Code style only: 4-space indents (the notebook uses 2).
# - Added a RESULT line per worker for a test to read: losses, the epoch the BackupAndRestore fit
#   started at, the step counts, and a checksum of the final weights.

import argparse
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from offline_datasets import mnist_load_data  # noqa: E402

import tfdist  # noqa: E402

parser = argparse.ArgumentParser(description="TensorFlow's 'Multi-worker training with Keras' tutorial on tfdist.")
parser.add_argument("--work-dir", required=True, help="model, checkpoints and backups (shared by every worker)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=5)
parser.add_argument("--interrupt-at", type=int, default=None,
                    help="worker 1 kills itself in this epoch of the BackupAndRestore fit on the first attempt")
args = parser.parse_args()
work_dir = args.work_dir
os.makedirs(work_dir, exist_ok=True)

# ---------------------------------------------------------------------------------------------
# mnist_setup.py
# ---------------------------------------------------------------------------------------------


def mnist_dataset(batch_size):
    (x_train, y_train), _ = mnist_load_data()
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(1500).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=['accuracy'])
    return model


# ---------------------------------------------------------------------------------------------
# main.py
# ---------------------------------------------------------------------------------------------

per_worker_batch_size = 64
tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])

strategy = tfdist.get_strategy("multi_worker")

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_and_compile_cnn_model()


history = multi_worker_model.fit(multi_worker_dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                                 verbose=2)

# ---------------------------------------------------------------------------------------------
# Dataset sharding
# ---------------------------------------------------------------------------------------------

options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

global_batch_size = 64
multi_worker_dataset = mnist_dataset(batch_size=64)
dataset_no_auto_shard = multi_worker_dataset.with_options(options)

# ---------------------------------------------------------------------------------------------
# Model saving and loading
# ---------------------------------------------------------------------------------------------


def wait_for_all_workers():
    # Added: returns on every worker once all of them have called it.
    strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)


model_path = os.path.join(work_dir, 'keras-model.keras')


def _is_chief(task_type, task_id):
    # Note: there are two possible `TF_CONFIG` configurations.
    #   1) In addition to `worker` tasks, a `chief` task type is use;
    #      in this case, this function should be modified to
    #      `return task_type == 'chief'`.
    #   2) Only `worker` task type is used; in this case, worker 0 is
    #      regarded as the chief. The implementation demonstrated here
    #      is for this case.
    # For the purpose of this Colab section, the `task_type` is `None` case
    # is added because it is effectively run with only a single worker.
    return (task_type == 'worker' and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = 'workertemp_' + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type,
                      strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)

multi_worker_model.save(write_model_path)

if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))

wait_for_all_workers()
loaded_model = tf.keras.models.load_model(model_path)

single_worker_dataset = mnist_dataset(per_worker_batch_size)
loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=args.steps_per_epoch, verbose=2)

checkpoint_dir = os.path.join(work_dir, 'ckpt')

checkpoint = tf.train.Checkpoint(model=multi_worker_model)
write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
checkpoint_manager = tf.train.CheckpointManager(
    checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

checkpoint_manager.save()
if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(write_checkpoint_dir)

wait_for_all_workers()
latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
checkpoint.restore(latest_checkpoint)
multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=args.steps_per_epoch, verbose=2)

# ---------------------------------------------------------------------------------------------
# The BackupAndRestore callback
# ---------------------------------------------------------------------------------------------


class Interruption(tf.keras.callbacks.Callback):
    """Added: records the epoch the fit starts at; kills worker 1 in epoch `kill_epoch` on the first attempt."""

    def __init__(self, kill_epoch=None):
        super().__init__()
        self.kill_epoch, self.first_epoch, self.epoch = kill_epoch, None, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.first_epoch is None:
            self.first_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        first_attempt = os.environ.get("TFDIST_RESTART_COUNT", "0") == "0"
        if first_attempt and task_id == 1 and self.epoch == self.kill_epoch and batch == 1:
            print(f"interrupted: worker 1 kills itself in epoch {self.epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


interruption = Interruption(args.interrupt_at)
callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=os.path.join(work_dir, 'backup')), interruption]
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset,
                       epochs=args.epochs,
                       steps_per_epoch=args.steps_per_epoch,
                       callbacks=callbacks,
                       verbose=2)
backup_iterations = int(multi_worker_model.optimizer.iterations.numpy())

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=os.path.join(work_dir, 'backup'),
                                                 save_freq=max(1, args.steps_per_epoch // 2))]
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset,
                       epochs=args.epochs,
                       steps_per_epoch=args.steps_per_epoch,
                       callbacks=callbacks,
                       verbose=2)

# Added: the results as numbers. Every worker prints its own line: synchronous training leaves the
# same weights on each (`weights_checksum`).
losses = history.history['loss']
weights_checksum = sum(float(np.abs(w).sum()) for w in multi_worker_model.get_weights())
print(f"RESULT worker={task_id} attempt={os.environ.get('TFDIST_RESTART_COUNT', '0')} "
      f"first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
      f"backup_fit_first_epoch={interruption.first_epoch} backup_fit_iterations={backup_iterations} "
      f"save_freq_fit_iterations={int(multi_worker_model.optimizer.iterations.numpy())} "
      f"weights_checksum={weights_checksum:.6f}", flush=True)

# Keras guide "Multi-GPU distributed training with TensorFlow", offline and on tfdist.
# Original: https://keras.io/guides/distributed_training_with_tensorflow/
#           (keras-team/keras-io, guides/distributed_training_with_tensorflow.py)
#
# Changed from the original, and why:
# - `tf.distribute.MirroredStrategy()` (twice) -> `tfdist.configure_local_devices(2)` once, then
#   `tfdist.get_strategy("mirrored")`: the strategy line is tfdist's; two logical CPU devices
#   stand in for the guide's GPUs.
# - `keras.datasets.mnist.load_data()` -> `offline_datasets.mnist_load_data()`: no download; same
#   arrays (uint8 (N, 28, 28) images, uint8 labels), 1,500 / 297 images instead of 60,000 /
#   10,000 (the bundled 8x8 digits scaled to 28x28).
# - `num_val_samples = 10000` -> 300: the validation split of the smaller training set.
# - `checkpoint_dir = "./ckpt"` -> under `--work-dir` (default: a new temporary directory): never a
#   fixed path.
# - The first `model.fit(train_dataset, epochs=2, ...)` -> `history = model.fit(..., epochs=--epochs
#   (default 2), ..., verbose=2)` and `model.evaluate(test_dataset)` -> `test_loss, test_accuracy =
#   model.evaluate(test_dataset, verbose=2)`: one line per epoch in logs, results kept.
# - The guide's prose sections (tf.data tips) are not code and are left out.
# - Added (lines marked `# Added`): `run_training` records each run's starting and final step count
#   and weights; at the end the script checks that the second run resumed exactly where the first
#   stopped, and prints one RESULT line for a test.
#
# Run: python examples/tutorials/distributed_training_with_tensorflow.py [--epochs 2] [--work-dir DIR]

import argparse
import os
import tempfile

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from offline_datasets import mnist_load_data  # noqa: E402

import tfdist  # noqa: E402

parser = argparse.ArgumentParser(description="Keras's 'Multi-GPU distributed training with TensorFlow' "
                                             "guide on tfdist.")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--work-dir", default=None, help="where checkpoints go (default: a new temp dir)")
args = parser.parse_args()
work_dir = args.work_dir or tempfile.mkdtemp(prefix="tfdist_tutorial_keras_guide_")
os.makedirs(work_dir, exist_ok=True)

tfdist.configure_local_devices(2)


def get_compiled_model():
    # Make a simple 2-layer densely-connected neural network.
    inputs = keras.Input(shape=(784,))
    x = keras.layers.Dense(256, activation="relu")(inputs)
    x = keras.layers.Dense(256, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def get_dataset():
    batch_size = 32
    num_val_samples = 300

    # Return the MNIST dataset in the form of a `tf.data.Dataset`.
    (x_train, y_train), (x_test, y_test) = mnist_load_data()

    # Preprocess the data (these are Numpy arrays)
    x_train = x_train.reshape(-1, 784).astype("float32") / 255
    x_test = x_test.reshape(-1, 784).astype("float32") / 255
    y_train = y_train.astype("float32")
    y_test = y_test.astype("float32")

    # Reserve num_val_samples samples for validation
    x_val = x_train[-num_val_samples:]
    y_val = y_train[-num_val_samples:]
    x_train = x_train[:-num_val_samples]
    y_train = y_train[:-num_val_samples]
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
    )


# Create a MirroredStrategy.
strategy = tfdist.get_strategy("mirrored")
print("Number of devices: {}".format(strategy.num_replicas_in_sync))  # noqa: UP032 (the guide's line)

# Open a strategy scope.
with strategy.scope():
    # Everything that creates variables should be under the strategy scope.
    # In general this is only model construction & `compile()`.
    model = get_compiled_model()

    # Train the model on all available devices.
    train_dataset, val_dataset, test_dataset = get_dataset()
    history = model.fit(train_dataset, epochs=args.epochs, validation_data=val_dataset, verbose=2)

    # Test the model on all available devices.
    test_loss, test_accuracy = model.evaluate(test_dataset, verbose=2)

# Prepare a directory to store all the checkpoints.
checkpoint_dir = os.path.join(work_dir, "ckpt")
if not os.path.exists(checkpoint_dir):
    os.makedirs(checkpoint_dir)


def make_or_restore_model():
    # Either restore the latest model, or create a fresh one
    # if there is no checkpoint available.
    checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        print("Restoring from", latest_checkpoint)
        return keras.models.load_model(latest_checkpoint)
    print("Creating a new model")
    return get_compiled_model()


# Added: what each run starts from and ends with, to check that the second run resumes.
runs = []


def run_training(epochs=1):
    # Create a MirroredStrategy.
    strategy = tfdist.get_strategy("mirrored")

    # Open a strategy scope and create/restore the model
    with strategy.scope():
        model = make_or_restore_model()
        start = (int(model.optimizer.iterations.numpy()), model.get_weights())  # Added

        callbacks = [
            # This callback saves a SavedModel every epoch
            # We include the current epoch in the folder name.
            keras.callbacks.ModelCheckpoint(
                filepath=checkpoint_dir + "/ckpt-{epoch}.keras",
                save_freq="epoch",
            )
        ]
        model.fit(
            train_dataset,
            epochs=epochs,
            callbacks=callbacks,
            validation_data=val_dataset,
            verbose=2,
        )
        runs.append((start, (int(model.optimizer.iterations.numpy()), model.get_weights())))  # Added


# Running the first time creates the model
run_training(epochs=1)

# Calling the same function again will resume from where we left off
run_training(epochs=1)

# Added: the tutorial's claims as numbers.
(first_start, first_end), (second_start, second_end) = runs
resume_difference = max(float(np.max(np.abs(a - b))) for a, b in zip(first_end[1], second_start[1]))
losses = history.history["loss"]
print(f"RESULT first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} test_accuracy={test_accuracy:.4f} "
      f"first_run_steps={first_start[0]}->{first_end[0]} second_run_steps={second_start[0]}->{second_end[0]} "
      f"resume_difference={resume_difference:g}")
assert first_start[0] == 0 and second_start[0] == first_end[0] and second_end[0] == 2 * first_end[0]
assert resume_difference == 0.0
assert test_accuracy > 0.5, test_accuracy  # chance is 0.1

# TensorFlow tutorial "Custom training with tf.distribute.Strategy", offline and on tfdist.
# Original: https://www.tensorflow.org/tutorials/distribute/custom_training
#           (tensorflow/docs, site/en/tutorials/distribute/custom_training.ipynb)
#
# The model, the optimizer and the metrics are created in the strategy's scope and built at the
# first step, inside `strategy.run` in a `tf.function`; `optimizer.apply_gradients` runs in each
# replica. As published this fails at the first step under tf.distribute.MirroredStrategy ("You
# must feed a value for placeholder tensor 'cond/else/_1/cond/Placeholder_1'"); under tfdist it
# trains, to one device's weights.
#
# Changed from the original, and why:
# - `tf.distribute.MirroredStrategy()` -> `tfdist.configure_local_devices(2)` then
#   `tfdist.get_strategy("mirrored")`: the strategy line is tfdist's; the two logical CPU devices
#   give this GPU-less host two replicas, as the tutorial's GPUs would. `--strategy one_device`
#   runs the same script with TensorFlow's default strategy (one device), to compare (with
#   `--batch-size-per-replica 128`, the same global batch as two replicas of 64).
# - `tf.keras.datasets.fashion_mnist.load_data()` -> `offline_datasets.mnist_load_data()`: no
#   download; the same arrays as Fashion-MNIST's (uint8 (N, 28, 28) images in 0..255, uint8 labels
#   0..9): the bundled 8x8 digits scaled to 28x28, `--train-images` of them (default 1,500) and 297
#   test images instead of 60,000 and 10,000.
# - `EPOCHS = 10` -> `--epochs`, default 2; `BATCH_SIZE_PER_REPLICA = 64` -> `--batch-size-per-replica`,
#   default 64.
# - `.shuffle(BUFFER_SIZE)` -> `.shuffle(BUFFER_SIZE, seed=0)`, and `tf.keras.utils.set_random_seed(0)`
#   first: the two runs see the same batches and start from the same weights.
# - `checkpoint_dir = './training_checkpoints'` -> under `--work-dir` (default: a new temporary
#   directory): never a fixed path.
# - Code style only: 4-space indents (the notebook uses 2) and f-strings for `str.format` (ruff).
# - The tutorial's later sections (restoring the checkpoint without a strategy, iterating with
#   `iter`) are kept; the prose and the "tf.data" discussion are not code and are left out.
# - Added (lines marked `# Added`): the final weights are written to `--work-dir/weights.npz` and
#   one RESULT line is printed, for a test.
#
# Run: python examples/tutorials/custom_training.py [--strategy mirrored|one_device] [--epochs 2]
#          [--train-images 1500] [--batch-size-per-replica 64] [--work-dir DIR]

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from offline_datasets import mnist_load_data  # noqa: E402

import tfdist  # noqa: E402

parser = argparse.ArgumentParser(description="TensorFlow's 'Custom training with tf.distribute.Strategy' on tfdist.")
parser.add_argument("--strategy", choices=["mirrored", "one_device"], default="mirrored")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--train-images", type=int, default=1500)
parser.add_argument("--batch-size-per-replica", type=int, default=64)
parser.add_argument("--work-dir", default=None, help="where checkpoints go (default: a new temp dir)")
args = parser.parse_args()
work_dir = args.work_dir or tempfile.mkdtemp(prefix="tfdist_tutorial_custom_training_")
os.makedirs(work_dir, exist_ok=True)

tfdist.configure_local_devices(2)
tf.keras.utils.set_random_seed(0)

(train_images, train_labels), (test_images, test_labels) = mnist_load_data()
train_images, train_labels = train_images[:args.train_images], train_labels[:args.train_images]

# Add a dimension to the array -> new shape == (28, 28, 1)
# This is done because the first layer in our model is a convolutional
# layer and it requires a 4D input (batch_size, height, width, channels).
# batch_size dimension will be added later on.
train_images = train_images[..., None]
test_images = test_images[..., None]

# Scale the images to the [0, 1] range.
train_images = train_images / np.float32(255)
test_images = test_images / np.float32(255)

# If the list of devices is not specified in
# `tf.distribute.MirroredStrategy` constructor, they will be auto-detected.
strategy = tfdist.get_strategy("mirrored") if args.strategy == "mirrored" else tf.distribute.get_strategy()

print(f"Number of devices: {strategy.num_replicas_in_sync}")

BUFFER_SIZE = len(train_images)

BATCH_SIZE_PER_REPLICA = args.batch_size_per_replica
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

EPOCHS = args.epochs

train_dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(
    BUFFER_SIZE, seed=0).batch(GLOBAL_BATCH_SIZE)
test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


def create_model():
    regularizer = tf.keras.regularizers.L2(1e-5)
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=regularizer),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
        tf.keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])

    return model


# Create a checkpoint directory to store the checkpoints.
checkpoint_dir = os.path.join(work_dir, "training_checkpoints")
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

with strategy.scope():
    # Set reduction to `NONE` so you can do the reduction yourself.
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True,
        reduction=tf.keras.losses.Reduction.NONE)

    def compute_loss(labels, predictions, model_losses):
        per_example_loss = loss_object(labels, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss)
        if model_losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        return loss

with strategy.scope():
    test_loss = tf.keras.metrics.Mean(name="test_loss")

    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
        name="train_accuracy")
    test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
        name="test_accuracy")

# A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
with strategy.scope():
    model = create_model()

    optimizer = tf.keras.optimizers.Adam(learning_rate=0.001)

    checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs):
    images, labels = inputs

    with tf.GradientTape() as tape:
        predictions = model(images, training=True)
        loss = compute_loss(labels, predictions, model.losses)

    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    train_accuracy.update_state(labels, predictions)
    return loss


def test_step(inputs):
    images, labels = inputs

    predictions = model(images, training=False)
    t_loss = loss_object(labels, predictions)

    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


# `run` replicates the provided computation and runs it
# with the distributed input.
@tf.function
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses,
                           axis=None)


@tf.function
def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


losses = []  # Added
for epoch in range(EPOCHS):
    # TRAIN LOOP
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches
    losses.append(float(train_loss))  # Added

    # TEST LOOP
    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

    template = ("Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, "
                "Test Accuracy: {}")
    print(template.format(epoch + 1, train_loss,
                          train_accuracy.result() * 100, test_loss.result(),
                          test_accuracy.result() * 100))
    last_test_accuracy = float(test_accuracy.result())  # Added

    test_loss.reset_state()
    train_accuracy.reset_state()
    test_accuracy.reset_state()

# Restore the latest checkpoint and test: a model without a strategy.
eval_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
    name="eval_accuracy")

new_model = create_model()
new_optimizer = tf.keras.optimizers.Adam()

test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)


@tf.function
def eval_step(images, labels):
    predictions = new_model(images, training=False)
    eval_accuracy(labels, predictions)


checkpoint = tf.train.Checkpoint(optimizer=new_optimizer, model=new_model)
checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

print(f"Accuracy after restoring the saved model without strategy: {eval_accuracy.result() * 100}")

# Alternate ways of iterating over a dataset: using iterators.
for _ in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)

    for _ in range(10):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, average_train_loss, train_accuracy.result() * 100))
    train_accuracy.reset_state()

# Added: the weights for a comparison with another run, and a summary line for a test.
np.savez(os.path.join(work_dir, "weights.npz"), *[np.asarray(w) for w in model.get_weights()])
print(f"RESULT replicas={strategy.num_replicas_in_sync} first_loss={losses[0]:.6f} last_loss={losses[-1]:.6f} "
      f"test_accuracy={last_test_accuracy:.4f} restored_accuracy={float(eval_accuracy.result()):.4f} "
      f"iterator_loss={float(average_train_loss):.6f}")

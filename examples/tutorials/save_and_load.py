# TensorFlow tutorial "Save and load a model using a distribution strategy", offline, on tfdist
# and Keras 3.
# Original: https://www.tensorflow.org/tutorials/distribute/save_and_load
#           (tensorflow/docs, site/en/tutorials/distribute/save_and_load.ipynb)
#
# Changed from the original, and why:
# - `tf.distribute.MirroredStrategy()` (three times) -> `tfdist.configure_local_devices(2)` once,
#   then `tfdist.get_strategy("mirrored")`: the strategy line is tfdist's; two logical CPU devices
#   stand in for the GPUs.
# - `tf.distribute.OneDeviceStrategy('/cpu:0')` -> `tfdist.get_strategy("mirrored",
#   devices=["/cpu:0"])`: tfdist's one-device strategy (tfdist has no "one_device" name).
# - `tfds.load(name='mnist', as_supervised=True)` -> `offline_datasets.tfds_mnist()`: no download;
#   same element structure (uint8 image (28, 28, 1), int64 label), 1,500 / 297 images instead of
#   60,000 / 10,000 (the bundled 8x8 digits scaled to 28x28). `BUFFER_SIZE` 10000 -> 1500 to match.
# - `keras_model_path = '/tmp/keras_save.keras'`, `saved_model_path = '/tmp/tf_save'` -> under
#   `--work-dir` (default: a new temporary directory): never a fixed /tmp path.
# - `fit(..., epochs=2)` -> `epochs=EPOCHS` (`--epochs`, default 2) and `verbose=2` (one line per
#   epoch in logs, no progress bars).
# - Keras 3 differences (the tutorial was written for Keras 2):
#   - `tf.saved_model.save(model, path)` and `tf.saved_model.load` work as in the tutorial, with a
#     `serving_default` signature. `model.export(path)` is Keras 3's own way to write a SavedModel
#     (endpoint `serve`, and `serving_default`); the script uses it where the tutorial calls
#     `model.save(saved_model_path)`, because Keras 3's `model.save` writes only `.keras` / `.h5`
#     and raises `ValueError: Invalid filepath extension for saving` for a directory (printed).
#   - `tf.keras.models.load_model(saved_model_path, options=...)`: Keras 3's `load_model` takes no
#     `options` and cannot load a SavedModel (it raises ValueError, printed: the script calls it
#     without `options` to show that); the local-device section loads it with
#     `tf.saved_model.load(saved_model_path, options=load_options)` instead, and saves it with
#     `tf.saved_model.save(model, saved_model_path, options=save_options)`.
#   - `hub.KerasLayer(loaded, trainable=True)` (tensorflow_hub, Keras 2 only) ->
#     `keras.layers.TFSMLayer(saved_model_path, call_endpoint="serving_default", trainable=True)`,
#     Keras 3's layer for a SavedModel; it is fine-tuned under the strategy as in the tutorial.
#     TFSMLayer loads from a path, so `build_model` gets `saved_model_path` and that cell's
#     `loaded = tf.saved_model.load(saved_model_path)` is dropped.
#   - Subclassed model: `my_model.save(saved_model_path)` before the model is called ->
#     `my_model.export(saved_model_path)`, which raises the Keras 3 analogue of the tutorial's
#     error (`The model provided has not yet been built`); `my_model.save_spec() is None` ->
#     `not my_model.built` (Keras 3 has no `save_spec`); after `fit` the export succeeds.
# - Code style only: 4-space indents (the notebook uses 2); `super(SubclassedModel, self)` -> `super()`.
# - Added (lines marked `# Added`): checks of what the tutorial shows (reloaded weights equal the
#   saved ones on one device and under the strategy; distributed inference through the loaded
#   signature equals inference on one device, and so does the SavedModel loaded through the local
#   device; the TFSMLayer model trains) and one RESULT line for a test to read.
#
# Run: python examples/tutorials/save_and_load.py [--epochs 2] [--work-dir DIR]

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from offline_datasets import tfds_mnist  # noqa: E402

import tfdist  # noqa: E402

parser = argparse.ArgumentParser(description="TensorFlow's 'Save and load a model using a distribution "
                                             "strategy' tutorial on tfdist.")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--work-dir", default=None, help="where models are saved (default: a new temp dir)")
args = parser.parse_args()
work_dir = args.work_dir or tempfile.mkdtemp(prefix="tfdist_tutorial_save_and_load_")
os.makedirs(work_dir, exist_ok=True)
EPOCHS = args.epochs

tfdist.configure_local_devices(2)

mirrored_strategy = tfdist.get_strategy("mirrored")


def get_data():
    datasets, _ = tfds_mnist()
    mnist_train, mnist_test = datasets['train'], datasets['test']

    BUFFER_SIZE = 1500

    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

    def scale(image, label):
        image = tf.cast(image, tf.float32)
        image /= 255

        return image, label

    train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

    return train_dataset, eval_dataset


def get_model():
    with mirrored_strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation='relu'),
            tf.keras.layers.Dense(10)
        ])

        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.Adam(),
                      metrics=[tf.metrics.SparseCategoricalAccuracy()])
        return model


def max_difference(a_weights, b_weights):  # Added: for the checks below.
    return max(float(np.max(np.abs(a - b))) for a, b in zip(a_weights, b_weights))


model = get_model()
train_dataset, eval_dataset = get_data()
model.fit(train_dataset, epochs=EPOCHS, verbose=2)

# ## The Keras API

keras_model_path = os.path.join(work_dir, 'keras_save.keras')
model.save(keras_model_path)

restored_keras_model = tf.keras.models.load_model(keras_model_path)
keras_restored_difference = max_difference(model.get_weights(), restored_keras_model.get_weights())  # Added
restored_keras_model.fit(train_dataset, epochs=EPOCHS, verbose=2)

another_strategy = tfdist.get_strategy("mirrored", devices=["/cpu:0"])
with another_strategy.scope():
    restored_keras_model_ds = tf.keras.models.load_model(keras_model_path)
    restored_ds_weights = restored_keras_model_ds.get_weights()  # Added
    restored_keras_model_ds.fit(train_dataset, epochs=EPOCHS, verbose=2)
# Added (outside the scope: TensorFlow refuses to read one strategy's variables in another's scope).
keras_restored_ds_difference = max_difference(model.get_weights(), restored_ds_weights)

# ## The tf.saved_model API

model = get_model()  # get a fresh model
saved_model_path = os.path.join(work_dir, 'tf_save')
tf.saved_model.save(model, saved_model_path)

DEFAULT_FUNCTION_KEY = 'serving_default'
loaded = tf.saved_model.load(saved_model_path)
inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

predict_dataset = eval_dataset.map(lambda image, label: image)
for batch in predict_dataset.take(1):
    one_device_batch, one_device_result = batch, inference_func(batch)  # Added: kept for a check.
    print(one_device_result)

another_strategy = tfdist.get_strategy("mirrored")
with another_strategy.scope():
    loaded = tf.saved_model.load(saved_model_path)
    inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

    dist_predict_dataset = another_strategy.experimental_distribute_dataset(
        predict_dataset)

    # Calling the function in a distributed manner
    for batch in dist_predict_dataset:
        result = another_strategy.run(inference_func, args=(batch,))
        print(result)
        break
# Added: the replicas' outputs, in order, are the one-device output of the same batch.
(output_key,) = one_device_result.keys()
distributed_rows = np.concatenate(
    [t.numpy() for t in another_strategy.experimental_local_results(result[output_key])])
inference_difference = float(np.max(np.abs(distributed_rows - one_device_result[output_key].numpy())))


def build_model(loaded):
    x = tf.keras.layers.Input(shape=(28, 28, 1), name='input_x')
    # Wrap what's loaded to a KerasLayer
    keras_layer = keras.layers.TFSMLayer(loaded, call_endpoint=DEFAULT_FUNCTION_KEY, trainable=True)(x)
    model = tf.keras.Model(x, keras_layer)
    return model


another_strategy = tfdist.get_strategy("mirrored")
with another_strategy.scope():
    model = build_model(saved_model_path)

    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(),
                  metrics=[tf.metrics.SparseCategoricalAccuracy()])
    tfsm_history = model.fit(train_dataset, epochs=EPOCHS, verbose=2)  # Added: `tfsm_history =`.

# ### Which API should I use?

model = get_model()

try:
    model.save(saved_model_path)
except ValueError as e:  # Keras 3: `.keras` or `.h5` only.
    print(f'{type(e).__name__}: ', *e.args)
model.export(saved_model_path)

another_strategy = tfdist.get_strategy("mirrored")
with another_strategy.scope():
    loaded = tf.saved_model.load(saved_model_path)

# ### Saving/Loading from a local device

model = get_model()

saved_model_path = os.path.join(work_dir, 'tf_save')
save_options = tf.saved_model.SaveOptions(experimental_io_device='/job:localhost')
tf.saved_model.save(model, saved_model_path, options=save_options)

another_strategy = tfdist.get_strategy("mirrored")
with another_strategy.scope():
    load_options = tf.saved_model.LoadOptions(experimental_io_device='/job:localhost')
    try:  # Keras 3's load_model reads `.keras` / `.h5` files only, and takes no `options`.
        loaded = tf.keras.models.load_model(saved_model_path)
    except ValueError as e:
        print(f'{type(e).__name__}: ', *e.args)
    loaded = tf.saved_model.load(saved_model_path, options=load_options)
# Added: the SavedModel loaded through the local device computes what the model does.
local_device_difference = float(np.max(np.abs(
    loaded.signatures[DEFAULT_FUNCTION_KEY](one_device_batch)[output_key].numpy()
    - model.predict(one_device_batch, verbose=0))))

# ### Caveats


class SubclassedModel(tf.keras.Model):
    """Example model defined by subclassing `tf.keras.Model`."""

    output_name = 'output_layer'

    def __init__(self):
        super().__init__()
        self._dense_layer = tf.keras.layers.Dense(
            5, dtype=tf.dtypes.float32, name=self.output_name)

    def call(self, inputs):
        return self._dense_layer(inputs)


my_model = SubclassedModel()
try:
    my_model.export(saved_model_path)
except ValueError as e:
    print(f'{type(e).__name__}: ', *e.args)

tf.saved_model.save(my_model, saved_model_path)
x = tf.saved_model.load(saved_model_path)
print(x.signatures)

print(not my_model.built)

BATCH_SIZE_PER_REPLICA = 4
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

dataset_size = 100
dataset = tf.data.Dataset.from_tensors(
    (tf.range(5, dtype=tf.float32), tf.range(5, dtype=tf.float32))
).repeat(dataset_size).batch(BATCH_SIZE)

my_model.compile(optimizer='adam', loss='mean_squared_error')
my_model.fit(dataset, epochs=2, verbose=2)

print(not my_model.built)
my_model.export(saved_model_path)

# Added: the tutorial's claims as numbers.
tfsm_losses = tfsm_history.history['loss']
print(f"RESULT keras_restored_difference={keras_restored_difference:g} "
      f"keras_restored_ds_difference={keras_restored_ds_difference:g} "
      f"inference_difference={inference_difference:g} local_device_difference={local_device_difference:g} "
      f"tfsm_first_loss={tfsm_losses[0]:.4f} tfsm_last_loss={tfsm_losses[-1]:.4f}")
assert keras_restored_difference == 0.0 and keras_restored_ds_difference == 0.0
assert inference_difference < 1e-5 and local_device_difference == 0.0
assert tfsm_losses[-1] < tfsm_losses[0]

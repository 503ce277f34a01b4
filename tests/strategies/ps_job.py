"""The training script of the parameter-server cluster tests: one script for every task.

Run by `tests/strategies/test_parameter_server.py` in separate processes with
TF_CONFIG set. Only the chief gets past `tfdist.get_strategy`; it prints one
line `RESULT <json>` with what the tests assert.

    python tests/strategies/ps_job.py main OUT_DIR
    python tests/strategies/ps_job.py faults OUT_DIR EPOCHS
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tfdist

scenario, out_dir = sys.argv[1], sys.argv[2]
strategy = tfdist.get_strategy("parameter_server", variable_partitioner="num_shards:2")

import keras  # noqa: E402

x, y = tfdist.datasets.load_digits()
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
VOCAB = 64 * 17  # token = pixel position * 17 + pixel value (0..16)
tokens = (np.arange(64) * 17 + np.round(x * 16)).astype("int32")
t_train, t_test = tokens[:1500], tokens[1500:]


def mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def embedding_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((64,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, name="table")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(h))
    model.compile(
        optimizer=keras.optimizers.Adam(2e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def main():
    result = {}
    train_ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(1500, seed=0).batch(32)

    # Synchronous reference: the same model, data and steps on one device.
    reference = mlp()
    reference.fit(train_ds, epochs=4, verbose=0)
    result["sync_eval"] = reference.evaluate(x_test, y_test, verbose=0)

    with strategy.scope():
        model = mlp()
    history = model.fit(train_ds, epochs=4, validation_data=(x_test, y_test), verbose=2)
    result["history"] = history.history
    result["iterations"] = int(model.optimizer.iterations.numpy())
    result["ps_eval"] = model.evaluate(x_test, y_test, verbose=0)
    before = int(model.optimizer.iterations.numpy())
    numpy_history = model.fit(x_train, y_train, batch_size=64, epochs=1, verbose=0)
    result["numpy_steps"] = int(model.optimizer.iterations.numpy()) - before
    result["numpy_loss"] = numpy_history.history["loss"]

    # A partitioned embedding, fed by a dataset function built on each worker.
    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((t_train, y_train)).shuffle(1500).repeat()
        return ds.batch(32)

    checkpoint = os.path.join(out_dir, "checkpoint.keras")
    with strategy.scope():
        emb = embedding_model()
    emb_history = emb.fit(
        tfdist.data.DatasetFn(dataset_fn), epochs=3, steps_per_epoch=30, verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(checkpoint)],
    )
    result["emb_loss"] = emb_history.history["loss"]
    result["emb_eval"] = emb.evaluate(t_test, y_test, verbose=0)
    result["emb_iterations"] = int(emb.optimizer.iterations.numpy())
    placement = {}
    for v in emb.variables + emb.optimizer.variables:
        parts = tfdist._compat.keras.variable_parts(v)
        placement[v.path] = [[tf.DeviceSpec.from_string(p.device).task, list(p.shape)] for p in parts]
    result["placement"] = placement
    table = emb.get_layer("table").embeddings
    shards = [p.numpy() for p in tfdist._compat.keras.variable_parts(table)]
    saved = os.path.join(out_dir, "embedding.keras")
    emb.save(saved)
    loaded = keras.models.load_model(saved)
    loaded_table = loaded.get_layer("table").embeddings.numpy()
    result["loaded_table_shape"] = list(loaded_table.shape)
    result["loaded_table_max_diff"] = float(np.abs(loaded_table - np.concatenate(shards)).max())
    result["loaded_predict_max_diff"] = float(np.abs(loaded.predict(t_test, verbose=0) - emb.predict(t_test, verbose=0)).max())
    result["loaded_eval"] = loaded.evaluate(t_test, y_test, verbose=0)
    result["checkpoint_eval"] = keras.models.load_model(checkpoint).evaluate(t_test, y_test, verbose=0)

    # tf-keras trains under the same strategy object with its own ParameterServerStrategy support.
    import tf_keras

    with strategy.scope():
        tf_keras.utils.set_random_seed(0)
        legacy = tf_keras.Sequential(
            [tf_keras.layers.Input((64,)), tf_keras.layers.Dense(32, activation="relu"), tf_keras.layers.Dense(10)]
        )
        legacy.compile(
            optimizer=tf_keras.optimizers.Adam(1e-2),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def legacy_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(1500).repeat().batch(32)

    legacy_history = legacy.fit(
        tf_keras.utils.experimental.DatasetCreator(legacy_fn), epochs=2, steps_per_epoch=20, verbose=0
    )
    result["tf_keras_loss"] = legacy_history.history["loss"]
    result["tf_keras_iterations"] = int(legacy.optimizer.iterations.numpy())

    # Bad input, each a clear error.
    def generator():
        yield from zip(x_train[:64], y_train[:64])

    unsafe = tf.data.Dataset.from_generator(
        generator, output_signature=(tf.TensorSpec((64,), tf.float32), tf.TensorSpec((), tf.int32))
    ).batch(32)
    result["unsafe_error"] = error_of(lambda: model.fit(unsafe, epochs=1, verbose=0))
    result["infinite_error"] = error_of(lambda: model.fit(train_ds.repeat(), epochs=1, verbose=0))
    print("RESULT " + json.dumps(result), flush=True)


class Progress(keras.callbacks.Callback):
    """Appends each finished epoch to a file the test watches."""

    def on_epoch_end(self, epoch, logs=None):
        with open(os.path.join(out_dir, "epochs.txt"), "a") as f:
            f.write(f"{epoch} {logs['loss']:.6f}\n")


def faults(epochs: int):
    def mark(a, b):
        # Runs on the worker that reads the batch: its log shows it is training.
        with tf.control_dependencies([tf.print("BATCH", output_stream=sys.stderr)]):
            return tf.identity(a), b

    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(1500).repeat().batch(32)
        return ds.map(mark)

    with strategy.scope():
        model = mlp()
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), Progress()]
    history = model.fit(dataset_fn, epochs=epochs, steps_per_epoch=20, callbacks=callbacks, verbose=2)
    result = {
        "epochs_run": len(history.history["loss"]),
        "final_loss": history.history["loss"][-1],
        "iterations": int(model.optimizer.iterations.numpy()),
        "eval": model.evaluate(x_test, y_test, verbose=0),
    }
    print("RESULT " + json.dumps(result), flush=True)


if scenario == "main":
    main()
else:
    faults(int(sys.argv[3]))

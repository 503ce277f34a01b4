"""A custom training loop over a partitioned Embedding under strategy 'parameter_server'.

Run by `tests/strategies/test_parameter_server.py` in a child process, like
`ps_in_process_job.py` (whose `create_in_process_cluster` starts 1 worker and
2 ps servers in this process; the coordinator connects this process's eager
context to the cluster). The loop is TensorFlow's parameter_server_training
tutorial's: `tf.GradientTape` over `model.trainable_variables`,
`optimizer.apply_gradients`, scheduled with a `ClusterCoordinator`. With one
worker the closures run in order, so `STEPS` steps of the loop and `STEPS`
steps of `model.fit` on the same batches must give the same weights.

Also takes, in this same process, a tape over ordinary variables before the
strategy exists and again after (with tfdist's patches installed): the
gradients must be identical. Prints one line `RESULT <json>`; exits with
`os._exit`, since in-process servers cannot be stopped.

    python tests/strategies/ps_custom_loop_job.py
"""

from __future__ import annotations

import json
import os
import sys

os.environ["GRPC_FAIL_FAST"] = "use_caller"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tests.strategies.ps_in_process_job import create_in_process_cluster  # noqa: E402
from tfdist._compat import keras as kc  # noqa: E402
from tfdist._compat import patches  # noqa: E402

STEPS = 4
VOCAB, DIM, BATCH = 20, 8, 8


def ordinary_gradients() -> tuple:
    """A tape over plain variables: a Keras Embedding and Dense (no strategy) and a tf.Variable."""
    import keras

    emb = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=keras.initializers.RandomUniform(seed=3))
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=4))
    scale = tf.Variable(1.5)
    ids = tf.constant([[1, 2, 2], [7, 0, 19]])
    with tf.GradientTape() as tape:
        y = scale * tf.reduce_sum(dense(keras.ops.mean(emb(ids), axis=1)) ** 2)
    grads = tape.gradient(y, {"emb": emb.embeddings, "dense": dense.trainable_variables, "scale": scale})
    flat = tf.nest.flatten(grads)
    return [type(g).__name__ for g in flat], [tf.convert_to_tensor(g).numpy() for g in flat]


def data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(BATCH * STEPS, 3))
    labels = (ids.min(axis=1) < 5).astype("float32")[:, None]
    return ids, labels


def dataset_fn(_=None):
    ids, labels = data()
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH).repeat()


def make_model(strategy):
    import keras

    with strategy.scope():
        inputs = keras.Input((3,), dtype="int64")
        emb = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=keras.initializers.RandomUniform(seed=1))
        out = keras.layers.Dense(
            1, activation="sigmoid", kernel_initializer=keras.initializers.GlorotUniform(seed=2),
            kernel_regularizer=keras.regularizers.L2(1e-3),
        )(keras.ops.mean(emb(inputs), axis=1))
        model = keras.Model(inputs, out)
        optimizer = keras.optimizers.Adam(0.05)
    return model, emb, optimizer


def weights(model) -> list:
    return [np.asarray(w) for w in model.get_weights()]


def main() -> dict:
    patched = lambda: patches.is_installed("GradientTape.gradient")  # noqa: E731
    before, patched_before = ordinary_gradients(), patched()
    resolver, _servers = create_in_process_cluster(1, 2)
    strategy = tfdist.get_strategy(
        "parameter_server",
        cluster_resolver=resolver,
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=256, max_shards=2
        ),
    )
    import keras

    # The tutorial's custom training loop.
    model, emb, optimizer = make_model(strategy)
    initial = weights(model)
    seen = {}

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                per_example_loss = keras.losses.BinaryCrossentropy(reduction=None)(labels, pred)
                loss = tf.nn.compute_average_loss(per_example_loss)
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            gradients = tape.gradient(loss, model.trainable_variables)
            seen["types"] = [type(g).__name__ for g in gradients]
            seen["dense_shape"] = tf.get_static_value(gradients[0].dense_shape).tolist()
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        batch_data, labels = next(iterator)
        return strategy.run(replica_fn, args=(batch_data, labels))

    coordinator = strategy.coordinator
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)
    ))
    for _ in range(STEPS):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    loop_weights = weights(model)

    # The same steps through model.fit, on a fresh model with the same initial weights.
    fit_model, _, fit_optimizer = make_model(strategy)
    with strategy.scope():
        fit_model.compile(optimizer=fit_optimizer, loss=keras.losses.BinaryCrossentropy())
    fit_initial = weights(fit_model)
    fit_model.fit(dataset_fn, epochs=1, steps_per_epoch=STEPS, verbose=0)
    fit_weights = weights(fit_model)

    after, patched_after = ordinary_gradients(), patched()
    return {
        "shards": [list(v.shape) for v in emb.embeddings.value.variables],
        "kernel_sharded": kc.is_sharded(model.layers[-1].kernel),
        "gradient_types": seen["types"],
        "embedding_dense_shape": seen["dense_shape"],
        "same_initial": all(np.array_equal(a, b) for a, b in zip(initial, fit_initial)),
        "moved": max(float(np.abs(a - b).max()) for a, b in zip(loop_weights, initial)),
        "max_diff_loop_vs_fit": max(float(np.abs(a - b).max()) for a, b in zip(loop_weights, fit_weights)),
        "loop_iterations": int(optimizer.iterations.numpy()),
        "fit_iterations": int(fit_optimizer.iterations.numpy()),
        "patched": [patched_before, patched_after],
        "ordinary_types": [before[0], after[0]],
        "ordinary_identical": all(np.array_equal(a, b) for a, b in zip(before[1], after[1])),
    }


if __name__ == "__main__":
    result = main()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)

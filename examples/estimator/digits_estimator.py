"""A classic Estimator-shaped script on the bundled digits: input_fn, model_fn, RunConfig, train_and_evaluate.

The same file runs on one machine and as every process of a cluster job:

    # locally (no TF_CONFIG): mirrored over the local devices, evaluating as checkpoints appear
    python examples/estimator/digits_estimator.py --model-dir /tmp/digits_estimator

    # a parameter-server job: chief, 2 workers, 1 ps and an evaluator, each with its own TF_CONFIG
    tfdist launch --chief --workers 2 --ps 1 --evaluator -- \\
        python examples/estimator/digits_estimator.py --model-dir /tmp/digits_estimator

Compared with the TF1 script it was ported from, only the lines marked "TF2:" changed
(see docs/estimator_migration.md).
"""

from __future__ import annotations

import argparse
import json
import os

import keras  # TF2: layers, losses, metrics and optimizers come from Keras 3
import tensorflow as tf

import tfdist
from tfdist import estimator as tf_estimator  # TF2: was `tf.estimator`

TRAIN_EXAMPLES = 1500  # the remaining 297 of the 1797 digits are the evaluation set


def input_fn(params, mode, input_context=None):
    x, y = tfdist.datasets.load_digits()
    if mode == tf_estimator.ModeKeys.TRAIN:
        dataset = tf.data.Dataset.from_tensor_slices((x[:TRAIN_EXAMPLES], y[:TRAIN_EXAMPLES]))
        if input_context is not None:  # one input pipeline per worker: each reads its own shard
            dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.shuffle(TRAIN_EXAMPLES, seed=params["seed"]).repeat()
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x[TRAIN_EXAMPLES:], y[TRAIN_EXAMPLES:]))
    batch_size = params["batch_size"]
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(batch_size)
    return dataset.batch(batch_size)


def model_fn(features, labels, mode, params):
    hidden = keras.layers.Dense(params["hidden"], activation="relu")(features)  # TF2: was tf.layers.dense
    logits = keras.layers.Dense(10)(hidden)
    if mode == tf_estimator.ModeKeys.PREDICT:
        predictions = {"class": tf.argmax(logits, axis=1), "probabilities": tf.nn.softmax(logits)}
        return tf_estimator.EstimatorSpec(mode, predictions=predictions)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)  # TF2
    if mode == tf_estimator.ModeKeys.EVAL:
        accuracy = keras.metrics.SparseCategoricalAccuracy()  # TF2: was tf.metrics.accuracy
        accuracy.update_state(labels, logits)
        return tf_estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
    # TF2: optimizer= replaces train_op=optimizer.minimize(loss, global_step)
    optimizer = keras.optimizers.SGD(params["learning_rate"], momentum=0.9)
    return tf_estimator.EstimatorSpec(mode, loss=loss, optimizer=optimizer)


def serving_input_receiver_fn():
    # TF2: a tf.TensorSpec where TF1 had a tf.placeholder; features are built from what is received.
    return tf_estimator.ServingInputReceiver(
        features=lambda received: received["pixels"],
        receiver_tensors={"pixels": tf.TensorSpec([None, 64], tf.float32)},
    )


def default_strategy() -> str:
    """parameter_server in a job with ps tasks, multi_worker in any other job, else mirrored."""
    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
    if cluster.get("ps"):
        return "parameter_server"
    return "multi_worker" if cluster else "mirrored"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--strategy", default=None, help="tfdist strategy name (default: from TF_CONFIG)")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--save-checkpoints-steps", type=int, default=100)
    parser.add_argument("--throttle-secs", type=int, default=0)
    parser.add_argument("--export", action="store_true", help="export a SavedModel after the final evaluation")
    args = parser.parse_args(argv)

    params = {"hidden": 64, "learning_rate": 0.05, "batch_size": args.batch_size, "seed": 0}
    config = tf_estimator.RunConfig(
        model_dir=args.model_dir,
        # A name, not a strategy object: the evaluator then never joins the training cluster.
        train_distribute=args.strategy or default_strategy(),
        save_checkpoints_steps=args.save_checkpoints_steps,
        save_summary_steps=50,
        log_step_count_steps=50,
        tf_random_seed=0,
    )
    estimator = tf_estimator.Estimator(model_fn, config=config, params=params)
    exporters = [tf_estimator.FinalExporter("digits", serving_input_receiver_fn)] if args.export else None
    train_spec = tf_estimator.TrainSpec(input_fn, max_steps=args.max_steps)
    eval_spec = tf_estimator.EvalSpec(input_fn, steps=None, exporters=exporters, throttle_secs=args.throttle_secs)
    result, exports = tf_estimator.train_and_evaluate(estimator, train_spec, eval_spec)
    if result is not None:
        print(f"final evaluation: {json.dumps(result)}")
    for path in exports:
        print(f"exported: {path}")
    return result


if __name__ == "__main__":
    main()

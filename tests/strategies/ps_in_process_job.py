"""TensorFlow's parameter_server_training tutorial, under tfdist: no chief, coordinator in-process.

Run by `tests/strategies/test_parameter_server.py` in a child process (the
coordinator connects the process's eager context to the cluster, which a
test process must not keep). As in the tutorial's `create_in_process_cluster`,
the worker and ps servers are `tf.distribute.Server`s started in this
process on free ports, and the resolver lists only `worker` and `ps` jobs and
names no task. Prints one line `RESULT <json>`; exits with `os._exit`, since
in-process servers cannot be stopped and can hang interpreter shutdown.

    python tests/strategies/ps_in_process_job.py WORKERS PS
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

os.environ["GRPC_FAIL_FAST"] = "use_caller"  # as the tutorial sets it

import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tests.strategies.ps_cluster import free_ports  # noqa: E402


def create_in_process_cluster(num_workers: int, num_ps: int):
    """The tutorial's function: starts the servers here, returns the coordinator's resolver."""
    ports = free_ports(num_workers + num_ps)
    cluster_dict = {
        "worker": [f"localhost:{port}" for port in ports[:num_workers]],
        "ps": [f"localhost:{port}" for port in ports[num_workers:]],
    }
    cluster_spec = tf.train.ClusterSpec(cluster_dict)
    # Workers need some inter-op threads to work properly.
    worker_config = tf.compat.v1.ConfigProto()
    if multiprocessing.cpu_count() < num_workers + 1:
        worker_config.inter_op_parallelism_threads = num_workers + 1
    servers = [
        tf.distribute.Server(cluster_spec, job_name="worker", task_index=i, config=worker_config, protocol="grpc")
        for i in range(num_workers)
    ]
    servers += [tf.distribute.Server(cluster_spec, job_name="ps", task_index=i, protocol="grpc") for i in range(num_ps)]
    return tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, rpc_layer="grpc"), servers


def main(num_workers: int, num_ps: int) -> dict:
    resolver, _servers = create_in_process_cluster(num_workers, num_ps)
    strategy = tfdist.get_strategy("parameter_server", cluster_resolver=resolver)

    import keras

    x, y = tfdist.datasets.load_digits()

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500])).shuffle(1500).repeat().batch(32)

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(dataset_fn, epochs=3, steps_per_epoch=20, verbose=0)
    devices = sorted({tf.DeviceSpec.from_string(v.value.device).job for v in model.trainable_variables})
    return {
        "task_type": strategy.task_type,
        "num_workers": strategy.num_workers,
        "num_ps": strategy.num_ps,
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "variable_jobs": devices,
        "eval": model.evaluate(x[1500:], y[1500:], verbose=0, return_dict=True),
    }


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)

"""One process of the multi-worker sharded-optimizer test job (started by `tfdist.launch.run_job`).

For `--stage k` (1 or 2): trains `build()` (the digits classifier, Adam)
for 20 steps under `tfdist.get_strategy("sharded_optimizer", stage=k)`,
which TF_CONFIG (stage 1) or `cluster_resolver=` (stage 2) turns into the
multi-worker variant, and writes to `--out`:
`<task>_stage<k>.npz` (final weights `w_i` and the canonical optimizer state
`opt_i`, gathered across workers), `<task>_stage<k>.json` (replicas,
iterations, memory report, loss, collectives) and, from every worker but
kept by the chief only, `stage<k>.keras` and the `tf.train.Checkpoint`
`ckpt_stage<k>`.

One stage per job: a second multi-worker strategy in the same processes
re-enables TensorFlow's collective ops ("Enabling collective ops after
program startup may cause error"), and under load one worker's first
collective group request could reach the other before it had, and wait
forever (1 run in about 10 under a loaded host hung so).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS = 20
BATCH = 32


def build():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data():
    import tfdist

    x, y = tfdist.datasets.load_digits()
    return x[:STEPS * BATCH], y[:STEPS * BATCH]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, choices=(1, 2), required=True)
    args = p.parse_args()
    # Two cores for the whole machine: one op thread per worker.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    import tfdist
    from tfdist.collectives import collective_ops_in
    from tfdist.strategies.sharded import sharded_state

    x, y = data()
    result = {}
    for stage in (args.stage,):
        # Stage 1 finds the job in TF_CONFIG; stage 2 is given a TensorFlow cluster resolver.
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver() if stage == 2 else None
        strategy = tfdist.get_strategy(
            "sharded_optimizer", stage=stage, cluster_resolver=resolver, collective_timeout=120.0
        )
        cfg = strategy.cluster_config
        task = f"{cfg.task_type}{cfg.task_id}"
        with strategy.scope():
            model = build()
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        state = sharded_state(model.optimizer)
        # Collectives: every worker gathers, saves and checkpoints, in the same order.
        canonical = state.canonical_values()
        path = strategy.write_dir(os.path.join(args.out, f"stage{stage}.keras"))
        model.save(path)
        strategy.remove_write_dir(path)
        ckpt = strategy.write_dir(os.path.join(args.out, f"ckpt_stage{stage}"))
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(ckpt)
        strategy.remove_write_dir(ckpt)
        arrays = {f"w_{i}": w for i, w in enumerate(model.get_weights())}
        arrays.update({f"opt_{i}": v for i, v in enumerate(canonical)})
        np.savez(os.path.join(args.out, f"{task}_stage{stage}.npz"), **arrays)
        result[f"stage{stage}"] = {
            "class": type(strategy).__name__,
            "is_sharded": isinstance(strategy, tfdist.strategies.ShardedOptimizerStrategy),
            "is_chief": strategy.is_chief,
            "replicas": strategy.num_replicas_in_sync,
            "iterations": int(model.optimizer.iterations.numpy()),
            "shard_size": state.layout.shard_size,
            "memory": tfdist.memory_report(model),
            "loss": history.history["loss"],
            "collectives": collective_ops_in(model.train_function.traced_graphs[-1]),
        }
    with open(os.path.join(args.out, f"{task}_stage{args.stage}.json"), "w") as f:
        json.dump(result, f)
    print(f"done: {task}", flush=True)


if __name__ == "__main__":
    main()

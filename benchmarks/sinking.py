"""Data sinking and input staging: steps/s against steps per host call, TransferManager on/off.

    python benchmarks/sinking.py [--repeats 5] [--steps 1024] [--input-steps 64]

Part 1 (sinking): the bundled digits classifier under a 2-replica mirrored
strategy on 2 logical CPU devices, trained with `sink_size` 1, 8, 32, 128 and
"epoch" (an epoch is `--steps` steps of global batch 32). Steps/s is measured
over one epoch after a warm-up epoch (which traces), best of `--repeats` with
the configurations taking turns, and shown as a ratio to sink_size=1. Beside it, the upper bound: the same
training step (`tfdist.engine.TrainStep`) in one `tf.while_loop` over the
whole epoch on one batch already on the devices, with no input pipeline and
no Keras, measured in turn with the fits; each row also shows its share of
it. Steps/s of a fit is the epoch's steps over the epoch's time, from
`on_epoch_begin` to `on_epoch_end` (the epoch's iterator is made inside it;
Keras's set-up of each `fit` call, paid once per call, is not), as in
`benchmarks/overhead.py`. With more than one step per call the
batches reach the loop in chunks (`tfdist.data.sinking`). The rows marked
`tf.data` feed the same batches from a cached `tf.data` pipeline instead of
NumPy arrays (`CACHED_SINK_SIZES`), which leaves out the cost of Keras's own
pipeline for arrays.

Part 2 (input-bound): the same model fed by a tf.data pipeline that waits as
long as one step takes before each batch (tf.data's testing `sleep`, standing
in for I/O; the step time is measured in part 1), with tf.data's own prefetch
injection turned off: `transfer=True` (default, prefetch_depth=2) against
`transfer=False`. TensorFlow's multi-device iterator keeps a host-side buffer
in both cases, so `off` still overlaps some input with compute; on a CPU host
the replicas' "devices" share host memory, so the copy itself costs little.

Prints tables and writes benchmarks/results/sinking.json. Never asserts:
timing depends on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfdist  # noqa: E402

DEVICES = tfdist.configure_local_devices(2)

import common  # noqa: E402 (benchmarks/common.py, beside this script)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.data.experimental.ops import testing as tf_data_testing  # noqa: E402

BATCH = 32
SINK_SIZES = (1, 8, 32, 128, "epoch")
# Also fed by a cached `tf.data` pipeline of whole batches: the input's own
# cost per batch is then a few microseconds, where Keras's pipeline for NumPy
# arrays (one element per batch: an index slice, a zip and a parallel gather)
# takes about 40 us of CPU per batch on this model, a third of its step.
CACHED_SINK_SIZES = (32, "epoch")


def build(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def epoch_data(steps):
    x, y = tfdist.datasets.load_digits()
    reps = -(-steps * BATCH // len(x))
    return np.tile(x, (reps, 1))[: steps * BATCH], np.tile(y, reps)[: steps * BATCH]


def prepared_fit(sink_size, x, y, cached=False):
    """A traced model under `sink_size`; returns `measure() -> steps/s` of one epoch.

    NumPy input (Keras's own pipeline, one `tf.data` element per batch), or
    with `cached` a `tf.data` pipeline of whole batches cached in memory.
    """
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES, sink_size=sink_size)
    model = build(strategy)
    if cached:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True).cache()
        kwargs = {}
    else:
        data, kwargs = x, {"y": y, "batch_size": BATCH, "shuffle": False}
    model.fit(data, epochs=1, verbose=0, **kwargs)  # traces (and fills the cache)

    timer = EpochTimer()

    def measure():
        model.fit(data, epochs=1, verbose=0, callbacks=[timer], **kwargs)
        return len(x) // BATCH / timer.seconds

    return measure


class EpochTimer(keras.callbacks.Callback):
    """Seconds from `on_epoch_begin` to `on_epoch_end`: the epoch, without `fit`'s own set-up."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


def best_interleaved(measures: dict, repeats: int) -> dict:
    """Best of `repeats` per configuration, the configurations taking turns.

    Taking turns spreads changes in the machine's load (other processes) over
    every configuration instead of biasing whichever ran during them.
    """
    best = {name: 0.0 for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            best[name] = max(best[name], measure())
    return best


def prepared_upper_bound(x, y, steps):
    """The same step in one on-device loop over the epoch, on one batch already on the devices.

    Returns `measure() -> steps/s`, measured in turn with the fits.
    """
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES)
    model = build(strategy)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)  # builds the optimizer
    step = tfdist.engine.TrainStep(model)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:BATCH], y[:BATCH])).batch(BATCH)
    )))

    @tf.function
    def epoch(batch):
        def body(i):
            step(batch)
            return (i + 1,)

        return tf.while_loop(lambda i: i < steps, body, (tf.constant(0),))

    epoch(batch)

    def measure():
        start = time.perf_counter()
        epoch(batch)[0].numpy()
        return steps / (time.perf_counter() - start)

    return measure


def prepared_input_bound(transfer, x, y, delay):
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES, transfer=transfer)
    model = build(strategy)
    # The input's cost is a wait per batch, standing in for reading from disk or
    # network: it takes no core from the step (this host has two) and no GIL.
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    ds = ds.apply(tf_data_testing.sleep(int(delay * 1e6)))
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    ds = ds.with_options(options)
    model.fit(ds.take(4), epochs=1, verbose=0)  # traces

    def measure():
        start = time.perf_counter()
        model.fit(ds, epochs=1, verbose=0)
        return len(x) // BATCH / (time.perf_counter() - start)

    return measure


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--input-steps", type=int, default=64)
    args = parser.parse_args(argv)
    x, y = epoch_data(args.steps)

    measures = {sink_size: prepared_fit(sink_size, x, y) for sink_size in SINK_SIZES}
    for sink_size in CACHED_SINK_SIZES:
        measures[f"{sink_size}, tf.data"] = prepared_fit(sink_size, x, y, cached=True)
    measures["bound"] = prepared_upper_bound(x, y, args.steps)
    best = best_interleaved(measures, args.repeats)
    bound = best.pop("bound")
    rows = [{"sink_size": sink_size, "steps_per_s": best[sink_size]} for sink_size in SINK_SIZES]
    rows += [{"sink_size": sink_size, "input": "cached tf.data", "steps_per_s": best[f"{sink_size}, tf.data"]}
             for sink_size in CACHED_SINK_SIZES]
    base = rows[0]["steps_per_s"]
    for row in rows:
        row["ratio_to_1"] = row["steps_per_s"] / base
        row["ratio_to_bound"] = row["steps_per_s"] / bound

    print(f"Sinking: digits MLP, mirrored over 2 logical CPU devices, global batch {BATCH}, {args.steps} steps/epoch")
    print(f"{'sink_size':>14} {'steps/s':>10} {'ratio to 1':>11} {'of bound':>9}")
    for row in rows:
        label = f"{row['sink_size']}" + (", tf.data" if "input" in row else "")
        print(f"{label:>14} {row['steps_per_s']:>10.1f} {row['ratio_to_1']:>11.2f} {row['ratio_to_bound']:>9.2f}")
    print(f"{'bound':>14} {bound:>10.1f} {bound / base:>11.2f} {1.0:>9.2f}   (same step, one on-device loop, no input)")

    # Input-bound: the pipeline costs as much as a step at sink_size=1.
    delay = 1.0 / base
    xi, yi = x[: args.input_steps * BATCH], y[: args.input_steps * BATCH]
    best = best_interleaved(
        {transfer: prepared_input_bound(transfer, xi, yi, delay) for transfer in (True, False)}, args.repeats
    )
    on, off = best[True], best[False]
    print()
    print(f"Input-bound: input costs {delay * 1e3:.1f} ms per batch (= one step), {args.input_steps} steps")
    print(f"{'transfer':>10} {'steps/s':>10} {'ratio':>11}")
    print(f"{'off':>10} {off:>10.1f} {1.0:>11.2f}")
    print(f"{'on':>10} {on:>10.1f} {on / off:>11.2f}")

    result = {
        "config": {"devices": DEVICES, "global_batch": BATCH, "steps_per_epoch": args.steps, "repeats": args.repeats},
        "sinking": rows,
        "upper_bound": {"steps_per_s": bound, "ratio_to_1": bound / base},
        "input_bound": {
            "input_ms_per_batch": delay * 1e3,
            "steps": args.input_steps,
            "transfer_off_steps_per_s": off,
            "transfer_on_steps_per_s": on,
            "ratio_on_to_off": on / off,
        },
    }
    common.write_results("sinking", result)
    return result


if __name__ == "__main__":
    main()

"""Memory per device and step time: mirrored against the sharded optimizer (ZeRO stages 1 and 2).

    python benchmarks/sharded_optimizer.py [--replicas 4] [--batch 64] [--steps 8]

A digits classifier of 10.77M parameters (64 -> 4096 -> 2048 -> 1024 -> 10,
ReLU), Adam, trained with Keras `fit` on the bundled digits on `--replicas`
logical CPU devices under mirrored, sharded_optimizer stage 1 and stage 2.
Each configuration runs in its own process, so its peak resident memory
(`ru_maxrss`) is its own.

Reported per configuration:

* bytes per device, measured by `tfdist.memory_report` from the variables
  the model holds (weights, optimizer state, parameter shard) and the reduced
  gradient each replica receives per step;
* the ZeRO formula beside it: for float32 Adam (what runs here: 4 bytes of
  weights, 4 of gradient, 8 of Adam state and, sharded, 4 of parameter
  shard per parameter) and the paper's mixed-precision figures (16, 4 + 12/N,
  2 + 14/N bytes per parameter; Rajbhandari et al. 2020);
* the process's peak resident memory (all N logical devices share one host);
* the median step time after `--warmup` steps, and its ratio to mirrored.

Prints a table and writes benchmarks/results/sharded_optimizer.json. Never
asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import common  # noqa: E402 (benchmarks/common.py, beside this script)

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [("mirrored", None), ("sharded_optimizer", 1), ("sharded_optimizer", 2)]
LAYERS = (4096, 2048, 1024)


def run_one(name: str, stage, replicas: int, batch: int, steps: int, warmup: int) -> dict:
    """Runs in the child process: one configuration, returns its measurements."""
    import resource
    import time

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(HERE))
    import tfdist

    tfdist.configure_local_devices(replicas)
    import keras
    import numpy as np

    x, y = tfdist.datasets.load_digits()
    n = batch * (steps + warmup)
    repeat = -(-n // len(x))
    x, y = np.concatenate([x] * repeat)[:n], np.concatenate([y] * repeat)[:n]
    options = {"stage": stage} if stage else {}
    strategy = tfdist.get_strategy(name, **options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,))]
            + [keras.layers.Dense(width, activation="relu") for width in LAYERS]
            + [keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    report = tfdist.memory_report(model)
    timed = sorted(times[warmup:])
    return {
        "strategy": name,
        "stage": stage,
        "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        "replicas": strategy.num_replicas_in_sync,
        "per_device": report,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_seconds_median": timed[len(timed) // 2],
        "step_seconds": times,
    }


def formulas(params: int, n: int) -> dict:
    """Bytes per device predicted by the ZeRO accounting (paper: mixed precision; here: float32)."""
    return {
        "mirrored": {"float32": 16 * params, "paper_mixed_precision": 16 * params},
        "stage1": {"float32": 8 * params + 12 * params / n, "paper_mixed_precision": 4 * params + 12 * params / n},
        "stage2": {"float32": 4 * params + 16 * params / n, "paper_mixed_precision": 2 * params + 14 * params / n},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("NAME", "STAGE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, stage = args.child[0], int(args.child[1]) or None
        print(json.dumps(run_one(name, stage, args.replicas, args.batch, args.steps, args.warmup)))
        return

    runs = []
    for name, stage in CONFIGS:
        cmd = [sys.executable, __file__, "--child", name, str(stage or 0), "--replicas", str(args.replicas),
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name} stage={stage} failed:\n{out.stderr[-3000:]}")
            continue
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if not runs:
        return
    params, n = runs[0]["parameters"], runs[0]["replicas"]
    predicted = formulas(params, n)
    base_time = next((r["step_seconds_median"] for r in runs if r["strategy"] == "mirrored"), None)
    mib = 1024 * 1024
    print(f"{params / 1e6:.2f}M parameters, Adam, {n} replicas on logical CPU devices, global batch {args.batch}")
    header = (
        f"{'run':<9} {'weights':>9} {'opt state':>10} {'param shard':>12} {'grad bufs':>10} "
        f"{'total':>9} {'fp32 formula':>13} {'paper (mp)':>11} {'peak RSS':>9} {'step s':>7} {'ratio':>6}"
    )
    print("bytes per device, MiB (device 1; every device measures the same)")
    print(header)
    for run in runs:
        key = "mirrored" if run["strategy"] == "mirrored" else f"stage{run['stage']}"
        device = sorted(run["per_device"])[min(1, len(run["per_device"]) - 1)]
        d = run["per_device"][device]
        ratio = run["step_seconds_median"] / base_time if base_time else float("nan")
        run["label"] = key
        run["formula_bytes_per_device"] = predicted[key]
        run["step_time_ratio_to_mirrored"] = ratio
        print(
            f"{key:<9} {d['weights'] / mib:>9.1f} {d['optimizer_state'] / mib:>10.1f} "
            f"{d['parameter_shard'] / mib:>12.1f} {d['gradient_buffers'] / mib:>10.1f} {d['total'] / mib:>9.1f} "
            f"{predicted[key]['float32'] / mib:>13.1f} {predicted[key]['paper_mixed_precision'] / mib:>11.1f} "
            f"{run['peak_rss_bytes'] / mib:>9.0f} {run['step_seconds_median']:>7.3f} {ratio:>6.2f}"
        )
    print(
        "grad bufs: the reduced gradient a replica receives per step. On CPU, TensorFlow 2.21 has no "
        "reduce-scatter kernel, so stage 2 reduces in chunked all-reduces and receives the whole "
        "(padded) gradient transiently, like stage 1; the float32 formula assumes a true reduce-scatter."
    )
    common.write_results(
        "sharded_optimizer",
        {"batch": args.batch, "steps": args.steps, "warmup": args.warmup, "runs": runs},
    )


if __name__ == "__main__":
    main()

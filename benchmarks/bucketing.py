"""Gradient bucketing (tensor fusion): per-variable collectives versus fused buckets.

    python benchmarks/bucketing.py [--layers 60] [--steps 40] [--no-workers]

A model with many small variables (`--layers` Dense(8) layers: 2 variables
each, 120 by default) is trained with `bucket_bytes=0` (one collective per
variable and step) and with the default `bucket_bytes` (25 MiB: one bucket
here), on 4 logical CPU devices of this process (mirrored and central_storage)
and on 2 worker processes started with `tfdist.launch.run_job` (multi_worker,
one replica each, gRPC ring between them). Step time is measured over the
epochs after the first (which includes tracing), and

    speed-up = step time with per-variable collectives / step time with buckets.

Prints a table and writes benchmarks/results/bucketing.json. Never asserts:
timing depends on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import common  # noqa: E402 (benchmarks/common.py, beside this script)

DEFAULT = 25 * 1024 * 1024


def _model(keras, layers: int):
    keras.utils.set_random_seed(0)
    stack = [keras.Input((64,))]
    stack += [keras.layers.Dense(8, activation="tanh") for _ in range(layers)]
    stack.append(keras.layers.Dense(10))
    model = keras.Sequential(stack)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _time_steps(keras, tf, strategy, layers: int, steps: int, batch: int) -> float:
    """Seconds per step, over the epochs after the first."""
    import tfdist

    x, y = tfdist.datasets.load_digits()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    with strategy.scope():
        model = _model(keras, layers)
    from tfdist.timing import EpochTimer

    timer = EpochTimer()
    times = timer.times

    model.fit(dataset, epochs=4, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    return min(times[1:]) / steps


def local(args) -> list[dict]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfdist

    tfdist.configure_local_devices(4)
    import keras
    import tensorflow as tf

    devices = [f"/cpu:{i}" for i in range(4)]
    rows = []
    for name, kwargs in (("mirrored", {"devices": devices}), ("central_storage", {"compute_devices": devices})):
        per_step = {}
        for bucket_bytes in (0, DEFAULT):
            strategy = tfdist.get_strategy(name, bucket_bytes=bucket_bytes, **kwargs)
            per_step[bucket_bytes] = _time_steps(keras, tf, strategy, args.layers, args.steps, 64)
        rows.append(_row(f"{name}, 4 logical devices", args.layers, per_step))
    return rows


def worker(args) -> None:
    """One process of the 2-worker job (TF_CONFIG is set by the launcher)."""
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    common.pin_to_one_core(index)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import tfdist

    strategy = tfdist.get_strategy("multi_worker", bucket_bytes=args.bucket_bytes)
    seconds = _time_steps(keras, tf, strategy, args.layers, args.steps, 64)
    if strategy.is_chief:
        with open(args.out, "w") as f:
            json.dump({"seconds_per_step": seconds}, f)


def workers(args) -> list[dict]:
    from tfdist.launch import run_job

    per_step = {}
    for bucket_bytes in (0, DEFAULT):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            command = [
                sys.executable, os.path.abspath(__file__), "--worker",
                "--bucket-bytes", str(bucket_bytes), "--layers", str(args.layers),
                "--steps", str(args.steps), "--out", out,
            ]
            status = run_job(command, workers=2, timeout=900)
            if status != 0 or not os.path.exists(out):
                print(f"2-worker job with bucket_bytes={bucket_bytes} failed (status {status})")
                return []
            with open(out) as f:
                per_step[bucket_bytes] = json.load(f)["seconds_per_step"]
    return [_row("multi_worker, 2 workers", args.layers, per_step)]


def _row(setup: str, layers: int, per_step: dict) -> dict:
    return {
        "setup": setup,
        "variables": 2 * layers + 2,
        "per_variable_ms": 1000 * per_step[0],
        "bucketed_ms": 1000 * per_step[DEFAULT],
        "speedup": per_step[0] / per_step[DEFAULT],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-workers", action="store_true", help="skip the 2-worker job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.local_only:
        print(json.dumps(local(args)))
        return
    # The local measurement splits this process into 4 logical devices; the
    # 2-worker job needs processes of their own, so each runs apart.
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--local-only", "--layers", str(args.layers),
         "--steps", str(args.steps)],
        check=True, capture_output=True, text=True,
    ).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    if not args.no_workers:
        rows += workers(args)
    print(f"{'setup':34} {'variables':>9} {'per-variable ms':>16} {'bucketed ms':>12} {'speed-up':>9}")
    for r in rows:
        print(
            f"{r['setup']:34} {r['variables']:>9} {r['per_variable_ms']:>16.2f} "
            f"{r['bucketed_ms']:>12.2f} {r['speedup']:>8.2f}x"
        )
    common.write_results("bucketing", {"rows": rows})


if __name__ == "__main__":
    main()

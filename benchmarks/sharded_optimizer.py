"""Peak memory and step time: mirrored against the sharded optimizer (ZeRO stages 1, 2 and 3), at N = 2 and 4.

    python benchmarks/sharded_optimizer.py [--replicas 2 4] [--batch 64] [--steps 3] [--width 2048]
                                           [--depth 3] [--bucket-bytes B]

An MLP of `--depth` hidden layers of `--width` (default three: 64 -> W -> W
-> W -> 10, ReLU; 8.55M parameters at W = 2048), trained with Keras `fit` on random digits-
shaped data under mirrored with SGD (the baseline: weights, gradients and the
step, no optimizer state), mirrored with Adam, and sharded_optimizer stages 1,
2 and 3 with Adam, on N logical devices. Every configuration runs in its
own process, so each peak is its own.

What is measured:

* on GPU: TensorFlow's allocator peak per device
  (`tf.config.experimental.get_memory_info(device)["peak"]`), the largest
  over the replicas' devices; a host with fewer GPUs than N splits each into
  N logical GPUs of `--gpu-memory-mb` (default 20000) MiB;
* on CPU, in two runs of each configuration: the process's peak resident
  memory (`VmHWM` in /proc/self/status, `ru_maxrss` where there is no
  /proc), and the peak of TensorFlow's CPU allocator (the bytes of tensors
  and variables alive at once), read with `get_memory_info("CPU:0")` in a
  run with `TF_CPU_ALLOCATOR_USE_BFC=true` (the one allocator every logical
  CPU device of the process uses). Resident memory also holds the graphs,
  the runtime and what the C allocator keeps after tensors are freed; the
  allocator peak is the tensors alone. All N logical devices share the one
  process, so each growth above the baseline is N devices' worth.

Reported beside it: the growth above the same N's SGD baseline, its ratio to
mirrored Adam's growth, and ZeRO's accounting per device (Rajbhandari et al.
2020, float32 as run here): mirrored 4Φ weights + 4Φ gradients + 8Φ Adam =
16Φ; stage 1 4Φ + 4Φ + 8Φ/N; stage 2 4Φ + 12Φ/N; stage 3 16Φ/N, plus
buffers (stage 3 here also holds, per replica, about one layer's gathered
weights and its local gradient at a time during its forward and backward
pass); the baseline is 8Φ.
On the allocator (and GPU) measure, the peak's own ratio to mirrored's is
printed too: there the peak is the tensors alone, so it is the ratio the
issue's targets name (stage 1 <= 0.70, stage 2 <= 0.55, stage 3 <= 0.35 at
N = 4).

Step time: after the measured epoch, epochs of `--timed-steps` steps (the
same batches repeated) are run, one warm-up then `--timed-epochs`, and each
step is timed from the start to the end of its batch (a Keras callback; the
median), in the RSS run (on GPU, the device run) and in `--timing-runs` - 1
more processes per configuration, run in turn (default 3 in all: one
process's median moves by 10-20% from the next on this shared host); the
step time is the median of the processes' medians: `fit`'s own set-up per
call, 3-4 s here and varying by whole 100 ms steps from call to call, is not
a step's cost. The ratio to mirrored Adam's is printed. "stage 2 sbb=0" is
stage 2 with `shard_bucket_bytes=0` (buckets of `bucket_bytes`, the update
on the whole slice): the faster, larger-peak setting. On the shared 2-core CPU host the N
logical devices share the cores, so these are the cost of the step's
structure, not of its arithmetic. `tfdist.memory_report`'s per-kind bytes of
the variables are recorded in the JSON.

A run that cannot measure (a child that fails, no peak reported) stops the
benchmark with an error naming it. Prints a table and writes
benchmarks/results/sharded_optimizer.json. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import common  # noqa: E402 (benchmarks/common.py, beside this script)

HERE = os.path.dirname(os.path.abspath(__file__))
# (label, strategy, stage, optimizer)
CONFIGS = [
    ("sgd baseline", "mirrored", None, "sgd"),
    ("mirrored", "mirrored", None, "adam"),
    ("stage 1", "sharded_optimizer", 1, "adam"),
    ("stage 2", "sharded_optimizer", 2, "adam"),
    # shard_bucket_bytes=0: the layout in bucket_bytes buckets and the whole-slice update (faster, more memory).
    ("stage 2 sbb=0", "sharded_optimizer", 2, "adam"),
    ("stage 3", "sharded_optimizer", 3, "adam"),
]
SHARD_BUCKET_BYTES = {"stage 2 sbb=0": 0}


def peak_rss_bytes() -> int:
    """The process's peak resident set size: VmHWM, else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(
    strategy_name: str, stage, optimizer: str, replicas: int, batch: int, steps: int, width: int, measure: str,
    timed_epochs: int = 3, timed_steps: int = 12, depth: int = 3, shard_bucket_bytes: int | None = None,
    gpu_memory_mb: int = 20000,
) -> dict:
    """Runs in the child process: one configuration, returns its measurements."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(HERE))
    import tensorflow as tf

    import tfdist

    gpus = tf.config.list_physical_devices("GPU")
    on_gpu = bool(gpus)
    if not on_gpu:
        tfdist.configure_local_devices(replicas)
    elif len(gpus) < replicas:
        # Fewer GPUs than replicas (one GPU host): each GPU split into N logical GPUs, which
        # TensorFlow connects with RING collectives (docs/gpu.md); peaks are per logical GPU.
        tfdist.configure_local_devices(replicas, memory_limit_mb=gpu_memory_mb)
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * steps, 64)).astype("float32")
    y = rng.integers(0, 10, batch * steps).astype("int32")
    options = {"stage": stage} if stage else {}
    if shard_bucket_bytes is not None:
        options["shard_bucket_bytes"] = shard_bucket_bytes
    if on_gpu:
        options["devices"] = [f"/gpu:{i}" for i in range(replicas)]
    strategy = tfdist.get_strategy(strategy_name, **options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
            + [keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4) if optimizer == "adam" else keras.optimizers.SGD(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    report = tfdist.memory_report(model)
    step_seconds = None
    if measure != "allocator":
        import time

        # More steps than the measured epoch, so fit's per-call cost is a small share.
        reps = -(-timed_steps // steps)
        tx, ty = np.concatenate([x] * reps)[: batch * timed_steps], np.concatenate([y] * reps)[: batch * timed_steps]
        model.fit(tx, ty, batch_size=batch, epochs=1, shuffle=False, verbose=0)  # warm-up

        class StepTimes(keras.callbacks.Callback):
            """Each training step's wall time, begin to end of the batch (not fit's own set-up)."""

            times: list = []

            def on_train_batch_begin(self, batch, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self.start)

        timer = StepTimes()
        for _ in range(timed_epochs):
            model.fit(tx, ty, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        step_seconds = statistics.median(timer.times)
    result = {
        "strategy": strategy_name,
        "stage": stage,
        "optimizer": optimizer,
        "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        "replicas": strategy.num_replicas_in_sync,
        "per_device": report,
        "step_seconds": step_seconds,
    }
    if on_gpu:
        peaks = [entry.get("peak") for entry in report.values()]
        if not peaks or any(p is None for p in peaks):
            raise RuntimeError(f"TensorFlow reported no allocator peak for some device: {report}")
        result.update(measure="peak per device (GPU allocator)", peak_bytes=max(peaks))
    elif measure == "time":
        result.update(measure="step time only")
    elif measure == "allocator":
        result.update(measure="TensorFlow CPU allocator peak", peak_bytes=tf.config.experimental.get_memory_info("CPU:0")["peak"])
    else:
        result.update(measure="process peak RSS (CPU)", peak_bytes=peak_rss_bytes())
    return result


def formulas(params: int, n: int) -> dict:
    """Bytes per device by ZeRO's accounting, float32 Adam (the baseline: SGD, no state)."""
    p = params
    return {
        "sgd baseline": 8 * p,
        "mirrored": 16 * p,
        "stage 1": 8 * p + 8 * p / n,
        "stage 2": 4 * p + 12 * p / n,
        "stage 3": 16 * p / n,
    }


def _shard_bucket_bytes_args(label: str, name: str, args) -> list:
    """The child's `--shard-bucket-bytes`: the row's own (sbb=0), else the command line's for the sharded rows."""
    value = SHARD_BUCKET_BYTES.get(label)
    if value is None and name == "sharded_optimizer":
        value = args.shard_bucket_bytes
    return [] if value is None else ["--shard-bucket-bytes", str(value)]


def run_child(config: tuple, replicas: int, args, measure: str) -> dict:
    label, name, stage, optimizer = config
    cmd = [
        sys.executable, __file__, "--child", name, str(stage or 0), optimizer, measure,
        *_shard_bucket_bytes_args(label, name, args),
        "--replicas", str(replicas), "--batch", str(args.batch), "--steps", str(args.steps),
        "--width", str(args.width), "--depth", str(args.depth), "--timed-epochs", str(args.timed_epochs),
        "--timed-steps", str(args.timed_steps), "--gpu-memory-mb", str(args.gpu_memory_mb),
    ]
    env = dict(os.environ)
    if args.bucket_bytes is not None:
        env["TFDIST_BUCKET_BYTES"] = str(args.bucket_bytes)
    if measure == "allocator":
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(
            f"{label} at N={replicas} could not be measured (exit {out.returncode}):\n{out.stderr[-3000:]}"
        )
    run = json.loads(out.stdout.strip().splitlines()[-1])
    if measure != "time" and not run.get("peak_bytes"):
        raise SystemExit(f"{label} at N={replicas} reported no peak ({measure}): {run}")
    run["label"] = label
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--bucket-bytes", type=int, default=None, help="step option bucket_bytes (default: tfdist's)")
    parser.add_argument("--timed-epochs", type=int, default=3, help="epochs timed for the step time (median)")
    parser.add_argument("--timed-steps", type=int, default=12, help="steps per timed epoch (default 12)")
    parser.add_argument(
        "--timing-runs", type=int, default=3,
        help="processes per configuration whose step times are taken (median of their medians; default 3)",
    )
    parser.add_argument(
        "--shard-bucket-bytes", type=int, default=None,
        help="strategy option shard_bucket_bytes for stages 1, 2 and 3 (default: tfdist's)",
    )
    parser.add_argument(
        "--gpu-memory-mb", type=int, default=20000,
        help="memory of each logical GPU where one GPU is split into the N replicas (default 20000)",
    )
    parser.add_argument("--child", nargs=4, metavar=("NAME", "STAGE", "OPTIMIZER", "MEASURE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, stage, optimizer, measure = args.child[0], int(args.child[1]) or None, args.child[2], args.child[3]
        replicas = args.replicas[0]
        print(json.dumps(run_one(
            name, stage, optimizer, replicas, args.batch, args.steps, args.width, measure, args.timed_epochs,
            args.timed_steps, args.depth, args.shard_bucket_bytes, args.gpu_memory_mb,
        )))
        return

    mib = 1024 * 1024
    import tensorflow as tf

    on_gpu = bool(tf.config.list_physical_devices("GPU"))
    measures = ["device"] if on_gpu else ["rss", "allocator"]
    rows = []
    for n in args.replicas:
        measured = {m: {c[0]: run_child(c, n, args, m) for c in CONFIGS} for m in measures}
        first = measured[measures[0]]
        # Step time moves by 10-20% from one process to the next on a shared host (each
        # configuration's median, mirrored's too): more processes per configuration, in turn.
        timings = {label: [run["step_seconds"]] for label, run in first.items()}
        for _ in range(args.timing_runs - 1):
            for c in CONFIGS:
                timings[c[0]].append(run_child(c, n, args, "time")["step_seconds"])
        predicted = formulas(first["mirrored"]["parameters"], n)
        for label in first:
            formula = predicted[label.split(" sbb=")[0]]
            row = {"label": label, "replicas": n, "parameters": first[label]["parameters"],
                   "per_device": first[label]["per_device"], "formula_bytes_per_device": formula,
                   "formula_ratio_to_mirrored": formula / predicted["mirrored"],
                   "formula_growth_ratio_to_mirrored": (formula - predicted["sgd baseline"])
                   / (predicted["mirrored"] - predicted["sgd baseline"])}
            for m in measures:
                base = measured[m]["sgd baseline"]["peak_bytes"]
                mirrored_growth = measured[m]["mirrored"]["peak_bytes"] - base
                growth = measured[m][label]["peak_bytes"] - base
                row[m] = {"measure": measured[m][label]["measure"], "peak_bytes": measured[m][label]["peak_bytes"],
                          "growth_bytes": growth, "growth_ratio_to_mirrored": growth / mirrored_growth,
                          "peak_ratio_to_mirrored": measured[m][label]["peak_bytes"]
                          / measured[m]["mirrored"]["peak_bytes"]}
            timed = statistics.median(timings[label])
            row["step_seconds"] = timed
            row["step_seconds_per_process"] = timings[label]
            row["step_ratio_to_mirrored"] = timed / statistics.median(timings["mirrored"])
            rows.append(row)
    print(
        f"{rows[0]['parameters'] / 1e6:.2f}M parameters, {args.depth} x {args.width} MLP, Adam, global batch {args.batch}, "
        f"{args.steps} steps, bucket_bytes {args.bucket_bytes or 'default (25 MiB)'}, shard_bucket_bytes "
        f"{args.shard_bucket_bytes if args.shard_bucket_bytes is not None else 'default'}; peaks in MiB, "
        "growth above the same N's mirrored-SGD baseline"
    )
    header = f"{'run':<14} {'N':>2}"
    for m in measures:
        header += f" {m + ' peak':>15} {'growth':>8} {'/mirrored':>9}"
        if m != "rss":
            header += f" {'peak/mirr':>9}"
    header += f" {'step ms':>8} {'/mirr':>6}"
    print(header + f" {'formula/dev':>12} {'/mirrored':>9} {'growth/mirr':>12}")
    for row in rows:
        line = f"{row['label']:<14} {row['replicas']:>2}"
        for m in measures:
            r = row[m]
            line += f" {r['peak_bytes'] / mib:>15.0f} {r['growth_bytes'] / mib:>8.1f} {r['growth_ratio_to_mirrored']:>9.2f}"
            if m != "rss":
                line += f" {r['peak_ratio_to_mirrored']:>9.2f}"
        line += f" {row['step_seconds'] * 1000:>8.1f} {row['step_ratio_to_mirrored']:>6.2f}"
        line += (
            f" {row['formula_bytes_per_device'] / mib:>12.1f} {row['formula_ratio_to_mirrored']:>9.2f}"
            f" {row['formula_growth_ratio_to_mirrored']:>12.2f}"
        )
        print(line)
    print(
        "formula: ZeRO's bytes per device (fp32 Adam: mirrored 16Φ, stage 1 8Φ+8Φ/N, stage 2 4Φ+12Φ/N, "
        "stage 3 16Φ/N, baseline 8Φ), without buffers; growth/mirr: (formula - 8Φ) / 8Φ (stage 2 is negative where its "
        "4Φ(1-1/N) gradient saving exceeds its 8Φ/N Adam state; TensorFlow's backward pass still holds every "
        "local gradient, in the baseline too)."
    )
    common.write_results(
        "sharded_optimizer",
        {"batch": args.batch, "steps": args.steps, "width": args.width, "depth": args.depth,
         "bucket_bytes": args.bucket_bytes, "shard_bucket_bytes": args.shard_bucket_bytes,
         "runs": rows},
    )


if __name__ == "__main__":
    main()

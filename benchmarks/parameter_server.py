"""Parameter-server throughput: training steps per second with 1 and with 2 workers.

    python benchmarks/parameter_server.py [--epochs 4] [--steps-per-epoch 100] [--batch 128]

Each job is a chief, 1 ps task and N workers, started with `tfdist launch`
(real TensorFlow servers in separate processes on 127.0.0.1). Workers are not
pinned to cores: a worker pinned to one core with `sched_setaffinity` hung in
its first closure on TensorFlow 2.21 (not investigated). Workers train asynchronously, each step on its own batch of
`--batch` examples, so the job's steps per second is what a second worker
should raise. The chief measures over the epochs after the first (which
includes tracing and building the per-worker datasets):

    steps/s = steps_per_epoch / seconds per epoch      (steps summed over workers)
    speed-up = steps/s with 2 workers / steps/s with 1 worker

`--steps-per-execution K` schedules K steps per closure (fewer round trips
from the chief). Prints a table and writes
benchmarks/results/parameter_server.json. Never asserts: timing depends on the
machine and on what else runs on it (on a 2-core host the chief and the ps
task share the cores with the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import common  # noqa: E402 (benchmarks/common.py, beside this script)


def task(args) -> None:
    """One process of the job (TF_CONFIG is set by the launcher)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import tfdist
    from tfdist.timing import EpochTimer

    strategy = tfdist.get_strategy("parameter_server")  # workers and the ps block here

    x, y = tfdist.datasets.load_digits()

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat().batch(args.batch).prefetch(2)

    with strategy.scope():
        model = common.digits_mlp(args.steps_per_execution)
    timer = EpochTimer()

    history = model.fit(
        dataset_fn, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=0, callbacks=[timer]
    )
    steady = timer.steady_times()
    with open(args.out, "w") as f:
        json.dump(
            {
                "workers": strategy.num_workers,
                "ps": strategy.num_ps,
                "steps_per_epoch": args.steps_per_epoch,
                "steps_per_s": args.steps_per_epoch * len(steady) / sum(steady),
                "samples_per_s": args.steps_per_epoch * args.batch * len(steady) / sum(steady),
                "final_loss": history.history["loss"][-1],
            },
            f,
        )


def run(workers: int, args) -> dict:
    from tfdist.launch import run_job

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--task", "--out", out,
                   "--epochs", str(args.epochs), "--steps-per-epoch", str(args.steps_per_epoch),
                   "--batch", str(args.batch), "--steps-per-execution", str(args.steps_per_execution)]
        status = run_job(command, workers=workers, chief=True, ps=1,
                         env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=args.timeout)
        if status != 0:
            raise SystemExit(f"the {workers}-worker job failed with status {status}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4, help="epochs per run; the first is not timed (default 4)")
    p.add_argument("--steps-per-epoch", type=int, default=100, help="steps per epoch over all workers (default 100)")
    p.add_argument("--batch", type=int, default=128, help="batch of each step (default 128)")
    p.add_argument("--steps-per-execution", type=int, default=1, help="steps per scheduled closure (default 1)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job (default 600)")
    p.add_argument("--task", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.task:
        task(args)
        return

    rows = [run(1, args), run(2, args)]
    header = f"{'workers':>7} {'ps':>3} {'batch':>6} {'steps/s':>8} {'samples/s':>10} {'speed-up':>8} {'loss':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        speed_up = r["steps_per_s"] / rows[0]["steps_per_s"]
        print(f"{r['workers']:>7} {r['ps']:>3} {args.batch:>6} {r['steps_per_s']:>8.1f} "
              f"{r['samples_per_s']:>10.0f} {speed_up:>8.2f} {r['final_loss']:>7.4f}")
    common.write_results(
        "parameter_server",
        {
            "epochs": args.epochs,
            "batch": args.batch,
            "steps_per_execution": args.steps_per_execution,
            "runs": rows,
            "speed_up_2_workers": rows[1]["steps_per_s"] / rows[0]["steps_per_s"],
        },
    )


if __name__ == "__main__":
    main()

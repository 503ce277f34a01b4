"""Multi-worker scaling: the same model with 1 worker and with 2 workers, each pinned to one core.

    python benchmarks/multi_worker.py [--epochs 4] [--per-worker-batch 128]

Weak scaling, as multi-worker jobs are run: every worker keeps its batch
(`--per-worker-batch`), so the global batch grows with the workers. The job is
started with `tfdist launch` (real TensorFlow servers in separate processes on
127.0.0.1); worker i is pinned to core i. Throughput is measured by the chief
over the epochs after the first (which includes tracing), in samples per
second of the whole job, and

    scaling efficiency = samples/s with 2 workers / (2 * samples/s with 1 worker).

Beside each row, where the chief's step goes: a `tfdist.callbacks.StepReport`
runs in every job (its warm-up and window in the first, untimed epoch; the
1-worker job split by TensorFlow's profiler, the 2-worker job by timed
ablations of the step: docs/performance.md), and the table gives its input,
compute, exchange, update and other per step, the exchange's wait for the
peer (exchange less the exchange timed alone) and the model FLOPs
utilisation.

Prints a table and writes benchmarks/results/multi_worker.json. Never asserts:
timing depends on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import common  # noqa: E402 (benchmarks/common.py, beside this script)


def worker(args) -> None:
    """One process of the job (TF_CONFIG is set by the launcher)."""
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    common.pin_to_one_core(index)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    import tfdist
    from tfdist.callbacks import StepReport
    from tfdist.timing import EpochTimer

    strategy = tfdist.get_strategy("multi_worker")
    x, y = tfdist.datasets.load_digits()
    global_batch = args.per_worker_batch * strategy.num_workers
    steps = len(x) // global_batch
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    with strategy.scope():
        model = common.digits_mlp(args.steps_per_execution)
    timer = EpochTimer()
    report = StepReport(verbose=0)
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer, report])
    steady = timer.steady_times()
    result = report.result
    if strategy.is_chief:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "workers": strategy.num_workers,
                    "replicas": strategy.num_replicas_in_sync,
                    "global_batch": global_batch,
                    "steps_per_epoch": steps,
                    "samples_per_s": steps * global_batch * len(steady) / sum(steady),
                    "step_ms": 1000 * sum(steady) / (len(steady) * steps),
                    "phases_ms": {k: 1000 * v for k, v in (result["phases_s"] or {}).items()},
                    "phases_method": result["phases_method"],
                    "exchange_wait_ms": None if result.get("exchange_wait_s") is None
                    else 1000 * result["exchange_wait_s"],
                    "mfu": result["mfu"],
                },
                f,
            )


def run(workers: int, args) -> dict:
    from tfdist.launch import run_job

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
                   "--epochs", str(args.epochs), "--per-worker-batch", str(args.per_worker_batch),
                   "--steps-per-execution", str(args.steps_per_execution)]
        status = run_job(command, workers=workers, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=args.timeout)
        if status != 0:
            raise SystemExit(f"the {workers}-worker job failed with status {status}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4, help="epochs per run; the first is not timed (default 4)")
    p.add_argument("--per-worker-batch", type=int, default=128, help="batch per worker (default 128)")
    p.add_argument("--steps-per-execution", type=int, default=1,
                   help="steps per host call; the loss metric is all-reduced once per call (default 1)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job (default 600)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    rows = [run(1, args), run(2, args)]
    efficiency = rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"])
    phases = ("input", "compute", "exchange", "update", "other")
    header = (f"{'workers':>7} {'replicas':>8} {'global batch':>12} {'step ms':>8} {'samples/s':>10} {'speed-up':>8}  "
              + " ".join(f"{p:>8}" for p in phases) + f" {'(wait)':>7} {'MFU':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        speed_up = r["samples_per_s"] / rows[0]["samples_per_s"]
        cells = " ".join(f"{r['phases_ms'][p]:>8.2f}" if p in r["phases_ms"] else f"{'-':>8}" for p in phases)
        wait = f"{r['exchange_wait_ms']:>7.2f}" if r["exchange_wait_ms"] is not None else f"{'-':>7}"
        mfu = f"{100 * r['mfu']:>5.1f}%" if r["mfu"] else f"{'-':>6}"
        print(f"{r['workers']:>7} {r['replicas']:>8} {r['global_batch']:>12} {r['step_ms']:>8.1f} "
              f"{r['samples_per_s']:>10.0f} {speed_up:>8.2f}  {cells} {wait} {mfu}")
    print("phases: ms of the chief's median step (tfdist.callbacks.StepReport; 1 worker: profiler, 2 workers: timed "
          "ablations, input counted in exchange); (wait) = exchange less the exchange timed alone")
    print(f"scaling efficiency (2 workers): {efficiency:.2f}")
    common.write_results(
        "multi_worker",
        {
            "epochs": args.epochs,
            "per_worker_batch": args.per_worker_batch,
            "steps_per_execution": args.steps_per_execution,
            "runs": rows,
            "scaling_efficiency": efficiency,
        },
    )


if __name__ == "__main__":
    main()

"""tfdist multi_worker against PyTorch DDP: the same jobs at 1 and 2 workers, beside the host's ceiling.

    python benchmarks/vs_ddp.py [--quick] [--epochs 4] [--steps 20] [--per-worker-batch 128]
                                [--models M ...] [--bucket-mib MIB ...] [--devices-per-worker K]

Weak scaling, as multi-worker jobs run: every worker keeps its batch
(`--per-worker-batch`, default 128), SGD, synthetic data, on three models:
the MLPs 64-512-512-10 and 64-2048-2048-2048-10 and a small convnet
(16x16x3 images, two 3x3 convolutions of 16 and 32 channels, each followed by
2x2 max pooling, then Dense(10)). Every worker process is pinned to one core
(`os.sched_setaffinity`, worker i on core i) and runs one thread
(TensorFlow's intra/inter-op threads 1, `torch.set_num_threads(1)`).

* tfdist: `multi_worker` jobs started with `tfdist.launch.run_job` (real
  TF_CONFIG, separate processes, free 127.0.0.1 ports), and the same jobs
  under `sharded_optimizer` (stage 1 and 2) across workers as extra rows;
  timed by the chief over the epochs after the first (which traces).
* PyTorch: `DistributedDataParallel` over gloo on CPU, one process per
  worker (`torch.distributed` on a free 127.0.0.1 port), timed by rank 0 over
  the same number of steps after one untimed epoch. Skipped, with a message,
  when torch is not installed (`pip install -e .[bench]` installs the CPU
  wheel, torch==2.13.0).

`--sink-sizes 8 32` adds tfdist multi_worker rows that run K steps per host
call (`sink_size`; Keras's `steps_per_execution`). `--bucket-mib 1 4 16 64` adds tfdist multi_worker rows with those bucket sizes
(the step option `bucket_bytes`, default 25 MiB), to tune it for gRPC ring
collectives. `--devices-per-worker 2` adds rows where every worker trains 2
logical CPU devices on its one core (`tfdist launch --devices-per-worker 2`;
"1 worker" is then one worker of 2 devices): the hierarchical exchange (each
bucket summed in the worker, then across workers; the default) against one
ring through all 4 devices (`hierarchical=False`).

Beside the jobs, the exchange alone (`--no-exchange` skips it): the same
2-worker set-up (pinned, one thread) sums stand-ins for a model's gradients
(buffers of its variables' shapes, read from variables: no fill pass timed)
20 times in a row with nothing else to do:
TensorFlow's collective on one flat float32 buffer, tfdist's
`collectives.all_reduce_sum` as the step calls it (buckets packed, summed,
unpacked; float32 and `allreduce_dtype="bfloat16"`), and gloo's
`all_reduce` of one flat buffer (what DDP's buckets go through). Each is
given as wall time and as the CPU time of the worker's process (all its
threads, on its one core) per exchange. Since a worker's one core both
computes and exchanges, `step / (step + exchange CPU)`, with `step` the
1-worker tfdist job's step time, bounds the efficiency that exchange allows
even if it overlapped backprop perfectly.

Beside the ratios, where each step's time goes (a table after the main one):
tfdist's jobs carry a `tfdist.callbacks.StepReport` (its window in the
untimed first epoch; split by TensorFlow's profiler in a 1-worker job and by
timed ablations across workers, docs/performance.md), DDP's loop times its
forward-backward (the all-reduce runs inside `backward()`) and its
optimizer step.

Throughput is samples/s of the whole job, and

    efficiency = samples/s with 2 workers / (2 * samples/s with 1 worker).

Two single-thread processes on this host do not get two cores' worth of
work (shared caches, memory bandwidth, frequency, other load): the host's
ceiling is measured in the same run as two independent single-thread
float32 matmul processes against one (`ceiling = their rate / (2 * one's
rate)`), before the jobs and again after them, and each efficiency is also
given as a fraction of the mean of the two.

Prints a table and writes benchmarks/results/vs_ddp.json (with the load
average before and after). Never asserts: timing depends on the machine and
on what else runs on it. Every process started here is stopped on every exit
path (`run_job` stops its tasks; DDP and matmul processes run in their own
process groups, killed in a `finally`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import common  # noqa: E402 (benchmarks/common.py, beside this script)

MODELS = ("mlp_small", "mlp_large", "convnet")
MODEL_NAMES = {"mlp_small": "64-512-512-10", "mlp_large": "64-2048-2048-2048-10", "convnet": "convnet 16x16x3"}
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
              "PYTHONWARNINGS": "ignore::UserWarning"}
SAMPLES = 1024  # rows of synthetic data per worker, cycled


def synthetic(model: str, rows: int, seed: int = 0):
    """Synthetic inputs and int labels for `model` (NumPy, channels last for images)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (rows, 16, 16, 3) if model == "convnet" else (rows, 64)
    return rng.standard_normal(shape).astype("float32"), rng.integers(0, 10, rows).astype("int32")


# --- tfdist ----------------------------------------------------------------
def keras_model(name: str):
    import keras

    keras.utils.set_random_seed(0)
    if name == "convnet":
        layers = [keras.Input((16, 16, 3)),
                  keras.layers.Conv2D(16, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
                  keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
                  keras.layers.Flatten(), keras.layers.Dense(10)]
    else:
        hidden = [512, 512] if name == "mlp_small" else [2048, 2048, 2048]
        layers = [keras.Input((64,))] + [keras.layers.Dense(h, activation="relu") for h in hidden]
        layers.append(keras.layers.Dense(10))
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tf_process() -> tuple:
    """A tfdist job's process (TF_CONFIG set by the launcher) pinned to its core, one thread: `(index, workers, tf)`."""
    config = json.loads(os.environ["TF_CONFIG"])
    index, workers = config["task"]["index"], len(config["cluster"]["worker"])
    common.pin_to_one_core(index)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return index, workers, tf


def tf_worker(args) -> None:
    """One process of a tfdist job (TF_CONFIG is set by the launcher)."""
    index, workers, tf = tf_process()
    import tfdist
    from tfdist.callbacks import StepReport
    from tfdist.timing import EpochTimer

    kwargs = {"stage": args.stage} if args.strategy == "sharded_optimizer" else {}
    if args.flat:
        kwargs["hierarchical"] = False
    if args.sink_size:
        kwargs["sink_size"] = args.sink_size
    strategy = tfdist.get_strategy(args.strategy, **kwargs)
    # A one-worker sharded_optimizer job is the local strategy, which has no num_workers.
    global_batch = args.per_worker_batch * workers
    x, y = synthetic(args.model, SAMPLES * workers)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch, drop_remainder=True)
    with strategy.scope():
        model = keras_model(args.model)
    timer = EpochTimer()
    # An epoch runs whole host calls (as Keras's steps_per_execution does): with
    # sink_size K it runs `--steps` rounded up to a multiple of K, and the rate
    # counts the steps it ran (counting `--steps` understated sink 32's by 20/32).
    steps = math.ceil(args.steps / args.sink_size) * args.sink_size if args.sink_size else args.steps
    # The step report records the first epoch (untimed): warm-up, then its window (profiled on one
    # worker, split by timed ablations across workers); the timed epochs pay only its per-call read.
    report = StepReport(verbose=0)
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer, report])
    steady = timer.steady_times()
    if index == 0:  # the chief (no `chief` task in these jobs)
        with open(args.out, "w") as f:
            json.dump({"samples_per_s": steps * global_batch * len(steady) / sum(steady), "steps_per_epoch": steps,
                       "report": breakdown_of(report.result)}, f)


PHASES = ("input", "compute", "exchange", "update", "other")


def breakdown_of(result: dict) -> dict:
    """The step report's figures a row of the breakdown table shows (`tfdist.callbacks.StepReport.result`)."""
    return {"step_s": result["step_s"]["median"], "phases_s": result["phases_s"],
            "method": "profiler" if str(result.get("phases_method", "")).startswith("TensorFlow profiler")
            else "ablations", "ablation_s": result.get("ablation_s"), "exchange_wait_s": result.get("exchange_wait_s"),
            "flops_per_step": result.get("flops_per_step"), "mfu": result.get("mfu")}


BREAKDOWNS: dict = {}  # (framework, model, workers) -> breakdown of one run (the last)


def run_tfdist(strategy: str, model: str, workers: int, args, stage: int = 1, env: dict | None = None,
               flat: bool = False, sink: int = 0, label: str = "") -> float:
    from tfdist.launch import run_job

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--tf-worker", "--out", out,
                   "--strategy", strategy, "--stage", str(stage), "--model", model,
                   "--epochs", str(args.epochs), "--steps", str(args.steps),
                   "--per-worker-batch", str(args.per_worker_batch), "--sink-size", str(sink)]
        command += ["--flat"] if flat else []
        status = run_job(command, workers=workers, env={**THREAD_ENV, **(env or {})}, timeout=args.timeout)
        if status != 0 or not os.path.exists(out):
            print(f"  {strategy} {model} {workers} worker(s): job failed with status {status}", flush=True)
            return float("nan")
        with open(out) as f:
            result = json.load(f)
        if label:
            BREAKDOWNS[(label, model, workers)] = result["report"]
        return result["samples_per_s"]


def torch_process() -> tuple:
    """A gloo job's process (RANK, WORLD_SIZE, MASTER_ADDR/PORT from `gloo_envs`), pinned, one thread, joined.

    Returns `(rank, world, torch, torch.distributed)`; the caller destroys the process group.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    common.pin_to_one_core(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, torch, dist


def gloo_envs(workers: int) -> list:
    """The environment of each process of a `workers`-process gloo job on a free 127.0.0.1 port."""
    port = str(free_port())
    return [{**THREAD_ENV, "RANK": str(r), "WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port} for r in range(workers)]


# --- the exchange alone ----------------------------------------------------
EXCHANGE_REPEATS = 20


def _timed(fn) -> dict:
    """Wall and process CPU milliseconds per exchange of `fn()`, which runs `EXCHANGE_REPEATS` of them."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return {"wall_ms": 1000 * (time.perf_counter() - wall) / EXCHANGE_REPEATS,
            "cpu_ms": 1000 * (time.process_time() - cpu) / EXCHANGE_REPEATS}


def tf_exchange_worker(args) -> None:
    """One process of a 2-worker job that only sums the model's gradients (TF_CONFIG set by the launcher)."""
    index, _, tf = tf_process()
    import tfdist
    from tfdist import collectives
    from tfdist.options import TrainingOptions

    strategy = tfdist.get_strategy("multi_worker")
    with strategy.scope():
        model = keras_model(args.model)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    elements = sum(math.prod(shape) for shape in shapes)
    bucket_bytes = TrainingOptions().bucket_bytes
    # Stand-ins for the gradients, read without a copy: no fill pass in the timing.
    with tf.device("/cpu:0"):
        parts = [tf.Variable(tf.ones(shape)) for shape in shapes]
        flat = tf.Variable(tf.ones([elements]))

    def loop(exchange):
        @tf.function
        def run():
            def body(i, total):
                def replica():
                    sums = exchange()
                    return tf.add_n([tf.reshape(t, [-1])[0] for t in sums])
                return i + 1, total + strategy.experimental_local_results(strategy.run(replica))[0]
            return tf.while_loop(lambda i, _: i < EXCHANGE_REPEATS, body, [0, 0.0])[1]
        run()  # traced, and the collectives' groups formed
        return _timed(run)

    def one_buffer():
        return [tf.distribute.get_replica_context().all_reduce("sum", flat.read_value())]

    def tfdist_sum(dtype):
        return lambda: collectives.all_reduce_sum([v.read_value() for v in parts], bucket_bytes, dtype)

    result = {
        "elements": elements,
        "tf_one_buffer_float32": loop(one_buffer),
        "tfdist_float32": loop(tfdist_sum("float32")),
        "tfdist_bfloat16": loop(tfdist_sum("bfloat16")),
    }
    if index == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


def gloo_exchange_worker(args) -> None:
    """One process of a 2-process gloo job that all-reduces one flat buffer of the model's size."""
    rank, _, torch, dist = torch_process()
    try:
        elements = sum(p.numel() for p in torch_model(args.model).parameters())
        flat = torch.zeros(elements)
        dist.all_reduce(flat)
        dist.barrier()

        def run():
            for _ in range(EXCHANGE_REPEATS):
                dist.all_reduce(flat)

        result = {"elements": elements, "gloo_float32": _timed(run)}
        dist.barrier()
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def measure_exchange(model: str, args, have_torch: bool) -> dict:
    """The exchange alone on 2 pinned workers: `{variant: {"wall_ms", "cpu_ms"}, "elements": n}`."""
    from tfdist.launch import run_job

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tf.json")
        command = [sys.executable, os.path.abspath(__file__), "--tf-exchange-worker", "--out", path,
                   "--model", model]
        if run_job(command, workers=2, env=THREAD_ENV, timeout=args.timeout) == 0 and os.path.exists(path):
            with open(path) as f:
                out.update(json.load(f))
        else:
            print(f"  exchange {model}: the TensorFlow job failed", flush=True)
        if have_torch:
            path = os.path.join(tmp, "gloo.json")
            command = [sys.executable, os.path.abspath(__file__), "--gloo-exchange-worker", "--out", path,
                       "--model", model]
            run_processes([command] * 2, gloo_envs(2), args.timeout)
            if os.path.exists(path):
                with open(path) as f:
                    gloo = json.load(f)
                out["gloo_float32"] = gloo["gloo_float32"]
                out.setdefault("elements", gloo["elements"])
            else:
                print(f"  exchange {model}: the gloo job failed", flush=True)
    return out


EXCHANGES = (("tf_one_buffer_float32", "TF collective, one float32 buffer"),
             ("tfdist_float32", "tfdist all_reduce_sum, float32"),
             ("tfdist_bfloat16", "tfdist all_reduce_sum, bfloat16"),
             ("gloo_float32", "gloo all_reduce, one float32 buffer"))


def print_exchanges(exchanges: dict, rows: list, args) -> list:
    """Prints the exchange table; returns its rows (with each variant's efficiency bound)."""
    header = (f"{'model':<22} {'exchange':<36} {'wall ms':>8} {'CPU ms':>8} {'1w step ms':>10} "
              f"{'efficiency bound':>16}")
    print()
    print("The exchange alone: 2 workers, each pinned to one core, summing the model's gradients")
    print(header)
    print("-" * len(header))
    table = []
    for model, measured in exchanges.items():
        one = next((r["samples_per_s_1"] for r in rows
                    if r["model"] == MODEL_NAMES[model] and r["framework"] == "tfdist multi_worker"), None)
        step_ms = 1000 * args.per_worker_batch / one if one else None
        for key, label in EXCHANGES:
            if key not in measured:
                continue
            m = measured[key]
            bound = step_ms / (step_ms + m["cpu_ms"]) if step_ms else None
            table.append({"model": MODEL_NAMES[model], "exchange": label, "elements": measured["elements"],
                          **m, "tfdist_step_ms_1_worker": step_ms, "efficiency_bound": bound})
            step = f"{step_ms:>10.1f}" if step_ms else f"{'-':>10}"
            print(f"{MODEL_NAMES[model]:<22} {label:<36} {m['wall_ms']:>8.1f} {m['cpu_ms']:>8.1f} {step} "
                  f"{(f'{bound:.2f}' if bound else '-'):>16}")
    print("efficiency bound = 1-worker step / (1-worker step + the exchange's CPU time on the same core)")
    return table


def print_breakdowns(args) -> list:
    """Where a step's time goes, tfdist's 1- and 2-worker steps (the step report) beside DDP's (timed segments)."""
    table = []
    print()
    print("Where the step's time goes (ms per step, on the chief; tfdist: tfdist.callbacks.StepReport, split by the")
    print("profiler in a 1-worker job and by timed ablations across workers; DDP: its loop's timed segments)")
    header = (f"{'model':<22} {'framework':<22} {'workers':>7} {'step':>7} {'input':>6} {'compute':>8} "
              f"{'exchange':>8} {'(wait)':>7} {'update':>7} {'other':>6} {'MFU':>6}")
    print(header)
    print("-" * len(header))
    for (framework, model, workers), b in sorted(BREAKDOWNS.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        name = MODEL_NAMES[model]
        if "segments_s" in b:  # DDP: forward+backward (its all-reduce beside it) and the optimizer's step
            seg = b["segments_s"]
            row = {"model": name, "framework": framework, "workers": workers, "step_ms": 1e3 * b["step_s"],
                   "compute_and_exchange_ms": 1e3 * seg["compute_and_exchange"], "update_ms": 1e3 * seg["update"],
                   "other_ms": 1e3 * (b["step_s"] - seg["step"])}
            print(f"{name:<22} {framework:<22} {workers:>7} {row['step_ms']:>7.2f} {'-':>6} "
                  f"{'fwd+bwd+allreduce ' + format(row['compute_and_exchange_ms'], '.2f'):>26} {row['update_ms']:>7.2f} "
                  f"{row['other_ms']:>6.2f} {'-':>6}")
        else:
            phases = b["phases_s"] or {}
            wait = b.get("exchange_wait_s")
            row = {"model": name, "framework": framework, "workers": workers, "step_ms": 1e3 * b["step_s"],
                   "method": b["method"], **{f"{p}_ms": 1e3 * phases[p] for p in PHASES if p in phases},
                   "exchange_wait_ms": None if wait is None else 1e3 * wait, "mfu": b.get("mfu")}
            cells = " ".join(f"{1e3 * phases[p]:>{w}.2f}" if p in phases else f"{'-':>{w}}"
                             for p, w in (("input", 6), ("compute", 8), ("exchange", 8)))
            wait_cell = f"{1e3 * wait:>7.2f}" if wait is not None else f"{'-':>7}"
            rest = " ".join(f"{1e3 * phases[p]:>{w}.2f}" if p in phases else f"{'-':>{w}}"
                            for p, w in (("update", 7), ("other", 6)))
            mfu = f"{100 * b['mfu']:>5.1f}%" if b.get("mfu") else f"{'-':>6}"
            print(f"{name:<22} {framework:<22} {workers:>7} {row['step_ms']:>7.2f} {cells} {wait_cell} {rest} {mfu}")
        table.append(row)
    print("tfdist 2 workers: input is not told apart from exchange (ablations); (wait) = exchange less the exchange")
    print("timed alone. DDP: fwd+bwd+allreduce overlap inside loss.backward(); other = the loop between steps")
    return table


# --- PyTorch DDP -----------------------------------------------------------
def torch_model(name: str):
    import torch.nn as nn

    if name == "convnet":
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    hidden = [512, 512] if name == "mlp_small" else [2048, 2048, 2048]
    layers, width = [], 64
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 10))


def ddp_worker(args) -> None:
    """One process of a DDP job (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by `run_ddp`)."""
    rank, world, torch, dist = torch_process()
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    try:
        model = DistributedDataParallel(torch_model(args.model))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = torch.nn.CrossEntropyLoss()
        x, y = synthetic(args.model, SAMPLES, seed=rank)
        x = torch.from_numpy(x.transpose(0, 3, 1, 2).copy() if x.ndim == 4 else x)
        y = torch.from_numpy(y).long()
        batches = [(x[i:i + args.per_worker_batch], y[i:i + args.per_worker_batch])
                   for i in range(0, SAMPLES - args.per_worker_batch + 1, args.per_worker_batch)]

        segments = {"compute_and_exchange": [], "update": [], "step": []}

        def run(steps: int, timed: bool = False) -> None:
            for s in range(steps):
                began = time.perf_counter()
                xb, yb = batches[s % len(batches)]
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(xb), yb).backward()  # DDP's bucketed all-reduce runs inside, beside backprop
                backward = time.perf_counter()
                optimizer.step()
                if timed:
                    ended = time.perf_counter()
                    segments["compute_and_exchange"].append(backward - began)
                    segments["update"].append(ended - backward)
                    segments["step"].append(ended - began)

        run(args.steps)  # the untimed first epoch, as tfdist's
        dist.barrier()
        start = time.perf_counter()
        run(args.steps * (args.epochs - 1), timed=True)
        dist.barrier()
        elapsed = time.perf_counter() - start
        if rank == 0:
            # Means, so that the loop's time between steps is the mean step less the segments' sum.
            median = {k: statistics.fmean(v) for k, v in segments.items()}
            with open(args.out, "w") as f:
                json.dump({"samples_per_s": args.steps * (args.epochs - 1) * args.per_worker_batch * world
                           / elapsed, "segments_s": median,
                           "step_s": elapsed / (args.steps * (args.epochs - 1))}, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(commands: list, envs: list, timeout: float) -> list:
    """Starts each command in its own process group; waits; kills every group left on any exit."""
    procs = []
    try:
        for command, env in zip(commands, envs):
            procs.append(subprocess.Popen(command, env={**os.environ, **env}, start_new_session=True))
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        return codes
    except subprocess.TimeoutExpired:
        return [124] * len(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_ddp(model: str, workers: int, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--ddp-worker", "--out", out, "--model", model,
                   "--epochs", str(args.epochs), "--steps", str(args.steps),
                   "--per-worker-batch", str(args.per_worker_batch)]
        codes = run_processes([command] * workers, gloo_envs(workers), args.timeout)
        if not os.path.exists(out):
            print(f"  ddp {model} {workers} worker(s): job failed with status {codes}", flush=True)
            return float("nan")
        if any(codes):
            # Rank 0 writes its result after the timed steps and the closing barrier;
            # gloo's teardown sometimes aborts a rank afterwards ("terminate called
            # without an active exception", status -6). The timing stands; say so.
            print(f"  ddp {model} {workers} worker(s): exit statuses {codes} after the result was written "
                  "(teardown); the result is kept", flush=True)
        with open(out) as f:
            result = json.load(f)
        BREAKDOWNS[("PyTorch DDP (gloo)", model, workers)] = {"step_s": result["step_s"],
                                                             "segments_s": result["segments_s"]}
        return result["samples_per_s"]


# --- the host's ceiling ----------------------------------------------------
def matmul_worker(args) -> None:
    """Single-thread float32 matmuls on one core for `args.seconds`; writes matmuls per second."""
    common.pin_to_one_core(args.core)
    import numpy as np

    a = np.random.default_rng(0).standard_normal((256, 256)).astype("float32")
    b = a.copy()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        np.matmul(a, b, out=b)
        b *= 1e-3
        done += 1
    with open(args.out, "w") as f:
        json.dump({"per_s": done / (time.perf_counter() - start)}, f)


def measure_ceiling(seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        def rates(cores):
            outs = [os.path.join(tmp, f"{len(cores)}-{c}.json") for c in cores]
            commands = [[sys.executable, os.path.abspath(__file__), "--matmul-worker", "--core", str(c),
                         "--seconds", str(seconds), "--out", o] for c, o in zip(cores, outs)]
            run_processes(commands, [THREAD_ENV] * len(cores), timeout=seconds + 60)
            return [json.load(open(o))["per_s"] for o in outs]

        one = rates([0])[0]
        two = sum(rates([0, 1]))
    return {"one_process_per_s": one, "two_processes_per_s": two, "speed_up": two / one,
            "efficiency_ceiling": two / (2 * one)}


def torch_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 epochs of 6 steps, 2 s ceiling runs (a smoke run)")
    p.add_argument("--epochs", type=int, default=4, help="epochs per run; the first is not timed (default 4)")
    p.add_argument("--steps", type=int, default=20, help="steps per epoch (default 20)")
    p.add_argument("--per-worker-batch", type=int, default=128, help="batch per worker (default 128)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to run (default all)")
    p.add_argument("--no-sharded", action="store_true", help="leave out the sharded_optimizer rows")
    p.add_argument("--no-compressed", action="store_true", help="leave out the allreduce_dtype='bfloat16' row")
    p.add_argument("--bucket-mib", type=float, nargs="+", default=[], metavar="MIB",
                   help="extra tfdist multi_worker rows with bucket_bytes of these sizes (e.g. 1 4 16 64)")
    p.add_argument("--sink-sizes", type=int, nargs="+", default=[], metavar="K",
                   help="extra tfdist multi_worker rows with sink_size K (K steps per host call)")
    p.add_argument("--devices-per-worker", type=int, default=0, metavar="K",
                   help="extra rows: every worker trains K logical CPU devices on its one core, with the "
                        "hierarchical exchange (default) and with one ring through every device (K >= 2)")
    p.add_argument("--no-exchange", action="store_true", help="leave out the exchange-alone table")
    p.add_argument("--ceiling-seconds", type=float, default=6.0, help="seconds per ceiling run (default 6)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job (default 600)")
    for hidden in ("--tf-worker", "--ddp-worker", "--matmul-worker", "--flat", "--tf-exchange-worker",
                   "--gloo-exchange-worker"):
        p.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    for hidden, kind in (("--out", str), ("--strategy", str), ("--model", str), ("--core", int),
                         ("--seconds", float), ("--stage", int), ("--sink-size", int)):
        p.add_argument(hidden, type=kind, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tf_worker:
        return tf_worker(args)
    if args.ddp_worker:
        return ddp_worker(args)
    if args.matmul_worker:
        return matmul_worker(args)
    if args.tf_exchange_worker:
        return tf_exchange_worker(args)
    if args.gloo_exchange_worker:
        return gloo_exchange_worker(args)
    if args.quick:
        args.epochs, args.steps, args.ceiling_seconds = 3, 6, 2.0

    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
        print("PyTorch is not installed: the DDP rows are skipped. Install the CPU wheel with "
              "`pip install torch==2.13.0` (or `pip install -e .[bench]`) to compare against DDP.")
    load_before = os.getloadavg()
    ceiling = measure_ceiling(args.ceiling_seconds)
    print(f"host ceiling: two single-thread matmul processes run {ceiling['speed_up']:.2f}x one alone "
          f"-> efficiency ceiling {ceiling['efficiency_ceiling']:.2f}", flush=True)

    frameworks = [("tfdist multi_worker", lambda m, w: run_tfdist("multi_worker", m, w, args,
                                                                  label="tfdist multi_worker"))]
    if have_torch:
        frameworks.append(("PyTorch DDP (gloo)", lambda m, w: run_ddp(m, w, args)))
    if not args.no_compressed:
        # One worker has one replica and no all-reduce: its row is multi_worker's 1-worker run.
        bf16 = {"TFDIST_ALLREDUCE_DTYPE": "bfloat16"}
        frameworks.append(("tfdist multi_worker bfloat16 exchange",
                           lambda m, w: None if w == 1 else run_tfdist("multi_worker", m, w, args, env=bf16)))
    for mib in args.bucket_mib:
        # One worker has no all-reduce: its row is multi_worker's 1-worker run.
        sized = {"TFDIST_BUCKET_BYTES": str(int(mib * 2**20))}
        frameworks.append((f"tfdist multi_worker, {mib:g} MiB buckets",
                           lambda m, w, env=sized: None if w == 1 else run_tfdist("multi_worker", m, w, args, env=env)))
    for k in args.sink_sizes:
        frameworks.append((f"tfdist multi_worker, sink_size {k}",
                           lambda m, w, k=k: run_tfdist("multi_worker", m, w, args, sink=k)))
    if args.devices_per_worker >= 2:
        from tfdist.launch import devices_per_worker_environment

        k = args.devices_per_worker
        split = devices_per_worker_environment(k, environ={})
        one_worker: dict = {}  # model -> 1 worker of K devices: no cross-worker exchange, the same both ways

        def hierarchical(m, w):
            rate = run_tfdist("multi_worker", m, w, args, env=split)
            if w == 1:
                one_worker[m] = rate
            return rate

        frameworks.append((f"tfdist multi_worker {k} dev/worker, hierarchical", hierarchical))
        frameworks.append((f"tfdist multi_worker {k} dev/worker, one ring",
                           lambda m, w: one_worker[m] if w == 1 else run_tfdist("multi_worker", m, w, args,
                                                                                 env=split, flat=True)))
    if not args.no_sharded:
        for stage in (1, 2):
            frameworks.append((f"tfdist sharded_optimizer stage {stage}",
                               lambda m, w, s=stage: run_tfdist("sharded_optimizer", m, w, args, stage=s)))
    rows = []
    for model in args.models:
        first = len(rows)  # this model's tfdist multi_worker row
        for framework, run in frameworks:
            one, two = run(model, 1), run(model, 2)
            one = rows[first]["samples_per_s_1"] if one is None else one
            efficiency = two / (2 * one)
            rows.append({"model": MODEL_NAMES[model], "framework": framework, "samples_per_s_1": one,
                         "samples_per_s_2": two, "efficiency": efficiency})
            print(f"  {MODEL_NAMES[model]:<22} {framework:<38} {one:>9.0f} {two:>9.0f} {efficiency:>5.2f}",
                  flush=True)
    exchanges = {} if args.no_exchange else {model: measure_exchange(model, args, have_torch) for model in args.models}
    load_after = os.getloadavg()
    # Load from other programs moves the ceiling during a run: measured again at the end, the
    # efficiencies are given as fractions of the mean of the two.
    ceiling_after = measure_ceiling(args.ceiling_seconds)
    reference = (ceiling["efficiency_ceiling"] + ceiling_after["efficiency_ceiling"]) / 2
    for r in rows:
        r["of_ceiling"] = r["efficiency"] / reference

    header = (f"{'model':<22} {'framework':<38} {'1 worker':>9} {'2 workers':>9} {'efficiency':>10} "
              f"{'of ceiling':>10} {'2w vs DDP':>9}")
    print()
    print(header)
    print("-" * len(header))
    ddp = {r["model"]: r["samples_per_s_2"] for r in rows if r["framework"].startswith("PyTorch")}
    for r in rows:
        versus = f"{r['samples_per_s_2'] / ddp[r['model']]:>9.2f}" if r["model"] in ddp else f"{'-':>9}"
        r["vs_ddp_2_workers"] = r["samples_per_s_2"] / ddp[r["model"]] if r["model"] in ddp else None
        print(f"{r['model']:<22} {r['framework']:<38} {r['samples_per_s_1']:>9.0f} {r['samples_per_s_2']:>9.0f} "
              f"{r['efficiency']:>10.2f} {r['of_ceiling']:>10.2f} {versus}")
    print(f"host ceiling (two single-thread matmul processes / 2x one): {ceiling['efficiency_ceiling']:.2f} "
          f"before, {ceiling_after['efficiency_ceiling']:.2f} after (mean {reference:.2f}); "
          f"1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print("samples/s of the whole job; efficiency = 2-worker / (2 x 1-worker); of ceiling = efficiency / host ceiling")
    breakdown_rows = print_breakdowns(args)
    exchange_rows = print_exchanges(exchanges, rows, args) if exchanges else []
    common.write_results("vs_ddp", {
        "epochs": args.epochs, "steps_per_epoch": args.steps, "per_worker_batch": args.per_worker_batch,
        "quick": args.quick, "torch": torch_version(), "ceiling": ceiling,
        "ceiling_after": ceiling_after, "ceiling_mean": reference,
        "load_average_before": load_before, "load_average_after": load_after, "rows": rows,
        "exchange_repeats": EXCHANGE_REPEATS, "exchanges": exchange_rows, "breakdowns": breakdown_rows,
    })


if __name__ == "__main__":
    main()

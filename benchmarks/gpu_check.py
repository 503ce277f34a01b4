"""One command for a GPU host: tfdist's overhead, parity, sinking and ZeRO figures on one GPU, in minutes.

    python3 benchmarks/gpu_check.py                 # a GPU host: about 7 minutes on one H100/H200
    python3 benchmarks/gpu_check.py --cpu-smoke     # a tiny version of every section on CPU (the suite runs it)
    make gpu-check                                  # the same through the project's virtualenv

On a GPU host without a package index (../shared/gpu/README.md) it runs as
`bash .gpu/tools/on-device.sh N python3 benchmarks/gpu_check.py` with nothing
installed: it needs TensorFlow, Keras and NumPy, and tfdist from the
working tree. Where no GPU is found (no `/proc/driver/nvidia/gpus`, or
`--cpu-smoke`), every section runs at toy sizes on logical CPU devices,
TensorFlow's GPU-only strategy branches forced where they can be
(`tfdist._compat.tf.devices_read_as_gpu`): the check itself cannot rot.

Sections (each in a process of its own, so each configures its devices and
each ZeRO peak is its own):

1. one device, plain Keras against tfdist mirrored with one replica, the
   issue-36 rows (`benchmarks/overhead.py`'s models, sizes `--gpu`): wide MLP
   4x4096 float32, with XLA, mixed_bfloat16 + XLA, mixed_float16; digits MLP
   at sink 1 and 32; the Transformer in mixed_bfloat16 (and the sharded
   optimizer's stage 2). Target: >= 0.95 of Keras (XLA rows: of Keras's XLA).
2. two logical devices (`tfdist.configure_local_devices(2, memory_limit_mb=...)`):
   * zoo parity, TF32 off: every model of `tests/models/zoo.py` under
     mirrored, central_storage and sharded_optimizer stages 1-3 against one
     device, max over weights of max|a-b|/max|a| (target: the zoo's own
     tolerance). The recurrent and convolutional models need cuDNN's RNN
     library and precompiled engines, which the bundle carries only when
     built with `CUDNN_FULL=1`: without them they are "skipped: needs
     CUDNN_FULL=1";
   * sinking: mirrored, digits MLP, sink 32 against sink 1 and against the
     on-device bound (`overhead.prepare_bound`; target >= 0.9 of the bound);
   * tfdist mirrored against stock `tf.distribute.MirroredStrategy` on the
     same 2 devices, plain Keras `fit` under it (target >= 1.0).
3. ZeRO on two logical devices, one process per configuration: the 4x4096
   MLP (input 1024, 54.6M parameters), batch 512, TF32 off: peak allocator
   bytes per device (`tf.config.experimental.get_memory_info`) and step
   time for mirrored with SGD, mirrored with Adam, stages 1, 2, 3, and stage
   2 with `shard_bucket_bytes=0` (buckets of `bucket_bytes`: 9 collectives
   each way instead of about 100). Targets: stage 2 >= 0.9x mirrored Adam's
   samples/s, stage 3 >= 0.75x.

Prints one table and writes one JSON: `$OUT/gpu_check.json` where `OUT` is
set (the device tool's output folder), else benchmarks/results/gpu_check.json
(or `--out`). A section's process that fails or runs out of time is named in
both; the rest still run. The whole run keeps to `--budget` seconds (480):
sections that no longer fit are reported as skipped. Never asserts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import common  # noqa: E402 (benchmarks/common.py)
import overhead  # noqa: E402 (benchmarks/overhead.py: models, data, timing)

# Zoo models that need cuDNN's RNN library or its precompiled convolution engines on a GPU.
NEEDS_CUDNN_FULL = ("convnet", "resnet", "rnn")
CUDNN_FULL_LIBRARIES = ("libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9")
ZOO_STRATEGIES = {
    "mirrored": ("mirrored", {}),
    "central_storage": ("central_storage", {}),
    "stage 1": ("sharded_optimizer", {"stage": 1}),
    "stage 2": ("sharded_optimizer", {"stage": 2}),
    "stage 3": ("sharded_optimizer", {"stage": 3}),
}
# (label, strategy, options, optimizer) of the ZeRO section, in run order (most telling first).
ZERO_CONFIGS = [
    ("mirrored sgd", "mirrored", {}, "sgd"),
    ("mirrored adam", "mirrored", {}, "adam"),
    ("stage 2", "sharded_optimizer", {"stage": 2}, "adam"),
    ("stage 3", "sharded_optimizer", {"stage": 3}, "adam"),
    ("stage 1", "sharded_optimizer", {"stage": 1}, "adam"),
    ("stage 2 sbb=0", "sharded_optimizer", {"stage": 2, "shard_bucket_bytes": 0}, "adam"),
]
TARGETS = {"one_replica": 0.95, "sinking": 0.9, "vs_stock": 1.0, "stage 2": 0.9, "stage 3": 0.75}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one mode runs at: full sizes on a GPU, toy sizes for the CPU smoke."""

    smoke: bool

    @property
    def overhead_args(self) -> argparse.Namespace:
        # The fields `overhead.sizes` and `overhead.run_setting` read.
        return argparse.Namespace(
            gpu=not self.smoke, quick=self.smoke, steps=2 if self.smoke else None,
            repeats=1 if self.smoke else 3, no_bound=False, status=None, verbose=False,
        )

    @property
    def zoo_models(self) -> tuple:
        return ("mlp",) if self.smoke else ()  # () = every zoo model

    @property
    def zero_configs(self) -> list:
        labels = [label for label, *_ in ZERO_CONFIGS]
        return ["mirrored adam", "stage 2", "stage 3"] if self.smoke else labels

    @property
    def stock_rows(self) -> tuple:
        return (("wide", "float32"),) if self.smoke else (("wide", "float32"), ("transformer", "mixed_bfloat16"))

    @property
    def zero(self) -> dict:
        if self.smoke:
            return {"width": 64, "depth": 2, "input": 32, "batch": 16, "steps": 2, "epochs": 1}
        return {"width": 4096, "depth": 4, "input": 1024, "batch": 512, "steps": 8, "epochs": 3}


def gpu_present() -> bool:
    """Whether this host has an NVIDIA GPU, without importing TensorFlow (which would claim it)."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def cudnn_full() -> bool:
    """Whether cuDNN's RNN library and precompiled engines can be loaded (the bundle's `CUDNN_FULL=1`)."""
    for name in CUDNN_FULL_LIBRARIES:
        found = False
        try:
            ctypes.CDLL(name)
            found = True
        except OSError:
            # A pip install keeps them in site-packages/nvidia/cudnn/lib, where TensorFlow looks.
            found = any(os.path.exists(os.path.join(p, "nvidia", "cudnn", "lib", name)) for p in sys.path)
        if not found:
            return False
    return True


# ---------------------------------------------------------------------------
# Child processes: each section.
# ---------------------------------------------------------------------------


def _modules(devices_wanted: int, memory_mb: int, smoke: bool, bfc: bool = False):
    """Configures the devices (before TensorFlow starts) and imports what the sections use."""
    if bfc:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import tfdist

    if devices_wanted > 1:
        devices = tfdist.configure_local_devices(devices_wanted, memory_limit_mb=None if smoke else memory_mb)
    else:
        devices = ["/device:CPU:0"] if smoke else ["/device:GPU:0"]
    import keras
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    # Parity and ZeRO's step times with float32 matmuls, as on CPU (TF32 is on by default on Ampere and later).
    tf.config.experimental.enable_tensor_float_32_execution(False)
    return (keras, tf, np, tfdist), devices


def _forced_branch(smoke: bool):
    """On the CPU smoke, TensorFlow's GPU-only strategy branches (`devices_read_as_gpu`); else nothing."""
    import contextlib

    from tfdist._compat import tf as tfc

    return tfc.devices_read_as_gpu() if smoke else contextlib.nullcontext()


ONE_DEVICE_ROWS = [
    # (label, row, sink, precision, xla, tfdist strategies)
    ("wide MLP float32", "wide", 32, "float32", False, ("mirrored",)),
    ("wide MLP XLA", "wide", 32, "float32", True, ("mirrored",)),
    ("wide MLP mixed_bfloat16 + XLA", "wide", 32, "mixed_bfloat16", True, ("mirrored",)),
    ("wide MLP mixed_float16", "wide", 32, "mixed_float16", False, ("mirrored",)),
    ("digits MLP sink 1", "digits", 1, "float32", False, ("mirrored",)),
    ("digits MLP sink 32", "digits", 32, "float32", False, ("mirrored",)),
    ("Transformer mixed_bfloat16", "transformer", 32, "mixed_bfloat16", False, ("mirrored", "sharded_optimizer:2")),
]


# The CPU smoke's rows: XLA with mixed_bfloat16 through the forced GPU branch (one replica's
# whole step, which crashed on the H200), and sinking with one replica.
SMOKE_ONE_DEVICE_ROWS = ("wide MLP mixed_bfloat16 + XLA", "digits MLP sink 32")


def section_one(sizes: Sizes, memory_mb: int) -> dict:
    """One device: plain Keras against tfdist with one replica, per issue-36 row."""
    modules, devices = _modules(1, memory_mb, sizes.smoke)
    args = sizes.overhead_args
    rows, failures = [], []
    for label, row, sink, precision, xla, strategies in ONE_DEVICE_ROWS:
        if sizes.smoke and label not in SMOKE_ONE_DEVICE_ROWS:
            continue
        setting = overhead.Setting(row, sink, precision, xla, "numpy")
        configs = [overhead.Config(overhead.KERAS, 1)] + [overhead.Config(s, 1) for s in strategies]
        with _forced_branch(sizes.smoke):
            measured = overhead.run_setting(modules, setting, configs, args, devices, failures)
        keras_rate = measured.get(overhead.KERAS, {}).get("samples_per_s")
        for config in configs[1:]:
            m = measured.get(config.label())
            rows.append({
                "row": label, "setting": setting.label(), "config": config.label(),
                "keras_samples_per_s": keras_rate, "samples_per_s": m and m["samples_per_s"],
                "ratio": (m["samples_per_s"] / keras_rate) if m and keras_rate else None,
                "windows": m and m["windows"], "keras_windows": measured.get(overhead.KERAS, {}).get("windows"),
            })
    return {"devices": devices, "rows": rows, "failures": failures, "forced_gpu_branch": sizes.smoke}


def _max_relative_difference(np, reference, model) -> float:
    worst = 0.0
    for a, b in zip(reference.get_weights(), model.get_weights()):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-12)))
    return worst


def zoo_parity(modules, devices, sizes: Sizes, full_cudnn: bool, on_gpu: bool) -> list:
    keras, tf, np, tfdist = modules
    from tests.models.zoo import ZOO

    results = []
    for name in sizes.zoo_models or tuple(ZOO):
        entry = ZOO[name]
        if on_gpu and name in NEEDS_CUDNN_FULL and not full_cudnn:
            results.append({"model": name, "status": "skipped: needs CUDNN_FULL=1"})
            continue
        x, y = entry.data()
        try:
            reference = entry.make(0)
            reference.fit(x, y, batch_size=entry.batch_size, shuffle=False, verbose=0)
        except Exception as error:  # named, and the other models still run
            results.append({"model": name, "status": f"reference failed: {type(error).__name__}: {error}"[:500]})
            continue
        for label, (strategy_name, options) in ZOO_STRATEGIES.items():
            key = "compute_devices" if strategy_name == "central_storage" else "devices"
            try:
                strategy = tfdist.get_strategy(strategy_name, **{key: devices[:2]}, **options)
                with strategy.scope():
                    model = entry.make(0)
                model.fit(x, y, batch_size=entry.batch_size, shuffle=False, verbose=0)
            except NotImplementedError as error:
                results.append({"model": name, "strategy": label, "status": f"refused: {error}"[:500]})
                continue
            except Exception as error:
                results.append({"model": name, "strategy": label,
                                "status": f"failed: {type(error).__name__}: {error}"[:500]})
                continue
            difference = _max_relative_difference(np, reference, model)
            results.append({
                "model": name, "strategy": label, "difference": difference, "tolerance": entry.tolerance,
                "status": "ok" if difference <= entry.tolerance else "outside tolerance",
            })
    return results


def prepare_stock(modules, strategy, setting, s: dict, data):
    """Plain Keras `fit` under stock `tf.distribute.MirroredStrategy` (`strategy`); its timing window."""
    keras, tf, np, tfdist = modules
    x, y = data
    batch, steps = s["batch"], overhead.epoch_steps(setting, s)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        if setting.precision != "float32":
            keras.config.set_dtype_policy(setting.precision)
        try:
            model = overhead.build_layers(keras, setting.row, s)
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        finally:
            keras.config.set_dtype_policy("float32")
    model.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, epochs=1, verbose=0)

    def window() -> float:
        clock = overhead._Clock.make()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
        return steps * batch / clock.seconds

    return overhead.Prepared(window, lambda: None)


def vs_stock(modules, devices, sizes: Sizes, failures: list) -> list:
    """tfdist mirrored (sink 1 and 32) against stock MirroredStrategy (sink 1) on the same 2 devices."""
    args = sizes.overhead_args
    out = []
    # One stock strategy for every row: each new MirroredStrategy starts its collective keys
    # at 1 and would join the first one's groups (tensorflow/tensorflow#61314).
    stock_strategy = modules[1].distribute.MirroredStrategy(devices=devices[:2])
    mirrored = overhead.Config("mirrored", 2)
    for row, precision in sizes.stock_rows:
        setting = overhead.Setting(row, 1, precision, False, "numpy")
        s = overhead.sizes(row, args)
        data = overhead.make_data(modules[2], modules[3], row, s, overhead.epoch_steps(setting, s) * s["batch"])
        builders = {
            "stock MirroredStrategy": lambda setting=setting, s=s, data=data: prepare_stock(
                modules, stock_strategy, setting, s, data),
            "tfdist mirrored": lambda setting=setting, s=s, data=data: overhead.prepare(
                modules, mirrored, setting, s, data, devices),
            "tfdist mirrored sink 32": lambda setting=setting, s=s, data=data: overhead.prepare(
                modules, mirrored, dataclasses.replace(setting, sink=32), s, data, devices,
                steps=overhead.epoch_steps(setting, s)),
        }
        prepared, windows = {}, {}
        for label, build in builders.items():
            try:
                prepared[label] = build()
                windows[label] = []
            except Exception as error:
                failures.append({"section": "vs_stock", "config": f"{row} {label}",
                                 "error": f"{type(error).__name__}: {error}"[:1000]})
        for _ in range(args.repeats):
            for label, p in prepared.items():
                windows[label].append(p.window())
        medians = {label: statistics.median(w) for label, w in windows.items() if w}
        stock = medians.get("stock MirroredStrategy")
        for label, rate in medians.items():
            out.append({"row": f"{row} {precision}", "config": label, "samples_per_s": rate,
                        "ratio_to_stock": rate / stock if stock else None, "windows": windows[label]})
    return out


def section_two(sizes: Sizes, memory_mb: int, on_gpu: bool) -> dict:
    """Two logical devices: zoo parity, the sinking ratio and its bound, against stock MirroredStrategy.

    The CPU smoke also runs its ZeRO configurations here (one process less to start).
    """
    modules, devices = _modules(2, memory_mb, sizes.smoke, bfc=sizes.smoke)
    failures: list = []
    full_cudnn = cudnn_full()
    parity = zoo_parity(modules, devices, sizes, full_cudnn, on_gpu)
    setting = overhead.Setting("digits", 32, "float32", False, "numpy")
    configs = [overhead.Config(overhead.KERAS, 1), overhead.Config("mirrored", 2)]
    sinking = overhead.run_setting(modules, setting, configs, sizes.overhead_args, devices, failures)
    stock = vs_stock(modules, devices, sizes, failures)
    result = {"devices": devices, "cudnn_full": full_cudnn, "zoo_parity": parity, "sinking": sinking,
              "vs_stock": stock, "failures": failures}
    if sizes.smoke:
        result["zero"] = _zero_configs(modules, devices, sizes, sizes.zero_configs, on_gpu, failures)
    return result


def zero_config(modules, devices, sizes: Sizes, label: str, on_gpu: bool) -> dict:
    """One ZeRO configuration: peak allocator bytes per device and step time."""
    keras, tf, np, tfdist = modules
    _, strategy_name, options, optimizer = next(c for c in ZERO_CONFIGS if c[0] == label)
    z = sizes.zero
    rng = np.random.default_rng(0)
    samples = z["batch"] * z["steps"]
    x = rng.standard_normal((samples, z["input"]), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype("int32")
    strategy = tfdist.get_strategy(strategy_name, devices=devices[:2], **options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((z["input"],))]
            + [keras.layers.Dense(z["width"], activation="relu") for _ in range(z["depth"])]
            + [keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4) if optimizer == "adam" else keras.optimizers.SGD(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=z["batch"], epochs=1, shuffle=False, verbose=0)  # builds, traces
    memory_devices = [f"GPU:{i}" for i in range(2)] if on_gpu else ["CPU:0"]
    held = {}
    for d in memory_devices:
        held[d] = tf.config.experimental.get_memory_info(d)["current"]
        tf.config.experimental.reset_memory_stats(d)
    seconds = []
    for _ in range(z["epochs"]):
        clock = overhead._Clock.make()
        model.fit(x, y, batch_size=z["batch"], epochs=1, shuffle=False, verbose=0, callbacks=[clock])
        seconds.append(clock.seconds)
    peaks = {d: tf.config.experimental.get_memory_info(d)["peak"] for d in memory_devices}
    step = statistics.median(seconds) / z["steps"]
    return {
        "config": label, "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        "peak_bytes": max(peaks.values()), "peaks": peaks, "step_seconds": step,
        # Above what was held when the timed steps began (weights, optimizer state, earlier configurations).
        "peak_growth_bytes": max(peaks[d] - held[d] for d in memory_devices),
        "samples_per_s": z["batch"] / step, "epoch_seconds": seconds,
        "measure": "peak allocator bytes per device" if on_gpu
        else "peak of the CPU allocator shared by the logical devices (smoke: not per device)",
    }


def _zero_configs(modules, devices, sizes: Sizes, labels: list, on_gpu: bool, failures: list) -> list:
    results = []
    for label in labels:
        try:
            results.append(zero_config(modules, devices, sizes, label, on_gpu))
        except Exception as error:
            failures.append({"section": "zero", "config": label, "error": f"{type(error).__name__}: {error}"[:1000]})
    return results


def section_zero(sizes: Sizes, memory_mb: int, on_gpu: bool, labels: list) -> dict:
    modules, devices = _modules(2, memory_mb, sizes.smoke, bfc=not on_gpu)
    failures: list = []
    return {"devices": devices, "results": _zero_configs(modules, devices, sizes, labels, on_gpu, failures),
            "failures": failures}


def child(args) -> None:
    """Runs one section in this (child) process; writes its result as JSON to `args.result`."""
    sizes = Sizes(smoke=args.mode == "smoke")
    on_gpu = args.mode == "gpu"
    try:
        if args.child == "one":
            result = section_one(sizes, args.memory_mb)
        elif args.child == "two":
            result = section_two(sizes, args.memory_mb, on_gpu)
        else:
            labels = args.child.split(":", 1)[1].split(",")
            result = section_zero(sizes, args.memory_mb, on_gpu, labels)
    except Exception as error:
        result = {"failures": [{"section": args.child, "error": "".join(
            traceback.format_exception(type(error), error, error.__traceback__))[-3000:]}]}
    with open(args.result, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # TensorFlow's teardown of many strategies is not what is measured


# ---------------------------------------------------------------------------
# The parent: runs the sections within the budget, prints the table, writes the JSON.
# ---------------------------------------------------------------------------


def run_section(name: str, mode: str, args, deadline: float, default_timeout: float) -> dict:
    remaining = deadline - time.monotonic()
    if remaining < 20:
        return {"failures": [{"section": name, "error": f"skipped: out of time ({args.budget:.0f}s budget)"}]}
    timeout = min(default_timeout, remaining)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--mode", mode,
               "--result", result_path, "--memory-mb", str(args.memory_mb)]
    start = time.monotonic()
    try:
        run = subprocess.run(command, timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with open(result_path) as f:
            result = json.load(f) if os.path.getsize(result_path) else None
        if result is None:
            tail = "\n".join(run.stdout.splitlines()[-20:])
            result = {"failures": [{"section": name, "error": f"exit status {run.returncode}: {tail}"}]}
    except subprocess.TimeoutExpired:
        result = {"failures": [{"section": name, "error": f"timed out after {timeout:.0f}s"}]}
    finally:
        os.unlink(result_path)
    result["seconds"] = time.monotonic() - start
    print(f"  {name}: {result['seconds']:.0f}s", flush=True)
    return result


def _fmt(value, spec=".2f", empty="-"):
    return empty if value is None else format(value, spec)


def table(results: dict, mode: str) -> list[list[str]]:
    """One table: section, row, configuration, measured value, ratio, target, status."""
    lines = []

    def add(section, row, config, value, ratio, target, status):
        lines.append([section, row, config, value, ratio, target, status])

    for r in results.get("one", {}).get("rows", []):
        ok = r["ratio"] is not None and r["ratio"] >= TARGETS["one_replica"]
        add("1 device", r["row"], r["config"], f"{_fmt(r['samples_per_s'], '.0f')} vs Keras "
            f"{_fmt(r['keras_samples_per_s'], '.0f')} samples/s", _fmt(r["ratio"]), ">= 0.95",
            "met" if ok else ("gap" if r["ratio"] is not None else "not measured"))
    two = results.get("two", {})
    for r in two.get("zoo_parity", []):
        if "difference" in r:
            add("2 devices: zoo parity", r["model"], r["strategy"], f"{r['difference']:.1e}", "",
                f"<= {r['tolerance']:.0e}", "met" if r["status"] == "ok" else r["status"])
        else:
            add("2 devices: zoo parity", r["model"], r.get("strategy", "every strategy"), "", "", "", r["status"])
    sinking = two.get("sinking", {})
    if "mirrored x2" in sinking and overhead.BOUND in sinking:
        s32, bound = sinking["mirrored x2"]["samples_per_s"], sinking[overhead.BOUND]["samples_per_s"]
        s1 = sinking.get(overhead.SINK_1, {}).get("samples_per_s")
        ratio = s32 / bound
        add("2 devices: sinking", "digits MLP", "mirrored sink 32",
            f"{s32:.0f} samples/s; sink 1 {_fmt(s1, '.0f')}; bound {bound:.0f}", f"{ratio:.2f} of bound",
            ">= 0.9", "met" if ratio >= TARGETS["sinking"] else "gap")
    for r in two.get("vs_stock", []):
        if r["config"] == "stock MirroredStrategy":
            continue
        ratio = r["ratio_to_stock"]
        add("2 devices: vs stock", r["row"], r["config"], f"{r['samples_per_s']:.0f} samples/s", _fmt(ratio),
            ">= 1.0", "met" if ratio is not None and ratio >= TARGETS["vs_stock"] else "gap")
    zero = results.get("zero", [])
    adam = next((z for z in zero if z["config"] == "mirrored adam"), None)
    for z in zero:
        speed = z["samples_per_s"] / adam["samples_per_s"] if adam else None
        memory = z["peak_bytes"] / adam["peak_bytes"] if adam else None
        target = TARGETS.get(z["config"])
        status = ("met" if speed >= target else "gap") if target and speed is not None else ""
        add("2 devices: ZeRO", f"{z['parameters'] / 1e6:.1f}M MLP", z["config"],
            f"peak {z['peak_bytes'] / 2**20:.0f} MiB ({_fmt(memory)}x); {z['samples_per_s']:.0f} samples/s",
            f"{_fmt(speed)}x speed", f">= {target}" if target else "", status)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny version of every section on CPU")
    p.add_argument("--gpu", action="store_true", help="run the GPU sizes even if no GPU was detected")
    p.add_argument("--memory-mb", type=int, default=20000, help="memory of each logical GPU (default 20000)")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole run (default 480)")
    p.add_argument("--out", help="JSON path (default $OUT/gpu_check.json, else benchmarks/results/gpu_check.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
    on_gpu = (args.gpu or gpu_present()) and not args.cpu_smoke
    mode = "gpu" if on_gpu else "smoke"
    deadline = time.monotonic() + args.budget
    start = time.monotonic()
    print(f"gpu_check: {'GPU' if on_gpu else 'CPU smoke (no GPU found or --cpu-smoke)'}; budget {args.budget:.0f}s",
          flush=True)
    results: dict = {"mode": mode, "failures": [], "zero": []}
    sections = [("one", 240), ("two", 240)]
    if on_gpu:
        # One after another: timings on one GPU must not overlap, and each ZeRO peak is its process's own.
        sections += [(f"zero:{label}", 90) for label, *_ in ZERO_CONFIGS]
        outcomes = [(name, run_section(name, mode, args, deadline, timeout)) for name, timeout in sections]
    else:
        # The smoke's two processes side by side (it times nothing that matters).
        with concurrent.futures.ThreadPoolExecutor(len(sections)) as pool:
            futures = [(name, pool.submit(run_section, name, mode, args, deadline, timeout))
                       for name, timeout in sections]
            outcomes = [(name, future.result()) for name, future in futures]
    for name, result in outcomes:
        results["failures"] += result.pop("failures", [])
        if name.startswith("zero:"):
            results["zero"].extend(result.get("results", []))
        else:
            results["zero"].extend(result.pop("zero", []))
            results[name] = result
    lines = table(results, mode)
    header = ["section", "row", "configuration", "measured", "ratio", "target", "status"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)] if lines else [len(h) for h in header]
    print()
    for line in [header, ["-" * w for w in widths]] + lines:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
    for failure in results["failures"]:
        print(f"\nFAILED {failure.get('section', '')} {failure.get('config', '')}: {failure['error']}")
    results["table"] = [dict(zip(header, line)) for line in lines]
    results["seconds"] = time.monotonic() - start
    print(f"\n{results['seconds']:.0f}s")
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"benchmark": "gpu_check", "machine": common.machine(), **results}, f, indent=2)
        print(f"wrote {out}")
    else:
        common.write_results("gpu_check", results)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

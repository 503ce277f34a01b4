"""Overhead: every one-host tfdist strategy against plain Keras, same model, data, seed and global batch.

    python benchmarks/overhead.py                      # the default subset (~10 min on 2 CPU cores)
    python benchmarks/overhead.py --quick              # smaller models and epochs: a smoke run
    python benchmarks/overhead.py --full               # every row x setting x strategy
    python benchmarks/overhead.py --rows digits --sinks 32 --strategies mirrored --replicas 1
    python benchmarks/overhead.py --gpu                # sized for a GPU, split into 2 logical GPUs

Rows (models; generated data, never downloaded, except the bundled digits):

* digits: the 64-512-512-10 digits MLP on the bundled digits, batch 256 (host-bound);
* wide: a 4-layer MLP, 1024 wide on CPU (4096 with --gpu), input 1024, batch 1024 (compute-bound);
* conv: a small convolutional net on 32x32x3 images, batch 128;
* transformer: a 2-block Transformer encoder, d_model 256, sequence 128, over token ids, batch 32.

Settings: sink 1 / 32 (plain Keras: `compile(steps_per_execution=k)`; tfdist:
the `sink_size` option), precision float32 / mixed_bfloat16 (mixed_float16 too
with --gpu; Keras: the global dtype policy while the model is built; tfdist:
the `precision` option), XLA off / on (Keras: `compile(jit_compile=True)`;
tfdist: the `jit_compile` option) and input as NumPy arrays / as a cached
`tf.data` pipeline. Every model is compiled with Adam(1e-3) and sparse
categorical cross-entropy, no metrics; weights start from seed 0.

Strategies: mirrored, central_storage, sharded_optimizer stage 1 and 2,
multi_worker (one local worker, no TF_CONFIG), each with one replica
(`/cpu:0`) and with two (`/cpu:0`, `/cpu:1`: logical devices on the same
cores). multi_worker runs one replica per worker on CPU and on one GPU, so it
has no 2-replica row.

Method: each setting (row, sink, precision, XLA, input) runs in a process of
its own. There every configuration is built and warmed up (traced, compiled; a
cached pipeline filled), then timed in windows, the configurations taking
turns (the order rotating each round) so that changes in the machine's load
fall on all of them alike; a window is one `fit` epoch (`--steps` steps, at
least one host call), timed from `on_epoch_begin` to `on_epoch_end` (the
epoch's iterator is made inside it, as in any training run). Samples/s is the
median window. Ratios are to plain Keras in the same setting, timed in the
same rounds. multi_worker runs in a further process beside its own plain-Keras
baseline: it has crashed its process (SIGSEGV, TensorFlow 2.21) after a few
consecutive `fit` calls, when Keras drops the distributed iterator its
symbolic build took one batch from. A crashed process is run again
(`--retries`), and the crash is reported. Beside the table:

* for 2 replicas at sink 32 on the compute-bound rows (wide, conv,
  transformer), the ratio to the same strategy on one replica;
* sinking: mirrored on 2 logical devices, digits, sink 32 against sink 1 (on
  the same epoch, timed in the same rounds), and the on-device upper bound of
  `benchmarks/sinking.py`: the same `tfdist.engine.TrainStep` in one
  `tf.while_loop` over the epoch's steps on one batch already on the devices
  (no input fetch, no Keras).

Prints tables and writes benchmarks/results/overhead.json (or --out). Exits
with status 1 when a configuration failed (named, with its error; the others
are still measured and written) or a process crashed. Never asserts: timing
depends on the machine and on what else runs on it (the load average is
recorded in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import common  # noqa: E402 (benchmarks/common.py, beside this script)

ROWS = ("digits", "wide", "conv", "transformer")
COMPUTE_BOUND = ("wide", "conv", "transformer")
# (registry name, strategy parameters besides the devices) per strategy label.
STRATEGIES = {
    "mirrored": ("mirrored", {}),
    "central_storage": ("central_storage", {}),
    "sharded_optimizer:1": ("sharded_optimizer", {"stage": 1}),
    "sharded_optimizer:2": ("sharded_optimizer", {"stage": 2}),
    "multi_worker": ("multi_worker", {}),
}
KERAS = "keras"
CPU_PRECISIONS = ("float32", "mixed_bfloat16")
GPU_PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
BOUND = "bound"  # the on-device upper bound's label in a setting's measurements
SINK_1 = "mirrored x2 @ sink 1"  # mirrored x2 at sink 1, timed in the sink-32 rounds for the sinking ratio


# ---------------------------------------------------------------------------
# What runs: settings, configurations, the default subset.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything plain Keras and the strategies share in one comparison."""

    row: str
    sink: int
    precision: str
    xla: bool
    input: str  # "numpy" or "dataset"

    def label(self) -> str:
        return (
            f"{self.row} · sink {self.sink} · {self.precision} · XLA {'on' if self.xla else 'off'} · "
            f"{self.input}"
        )


@dataclasses.dataclass(frozen=True)
class Config:
    """One strategy (or plain Keras) with a number of replicas."""

    strategy: str
    replicas: int

    def label(self) -> str:
        return KERAS if self.strategy == KERAS else f"{self.strategy} x{self.replicas}"


def _groups(args) -> list[dict]:
    """The cross products to run: the default subset, `--full`, or the flags' selection."""
    precisions = GPU_PRECISIONS if args.gpu else CPU_PRECISIONS
    everything = {
        "rows": ROWS,
        "sinks": (1, 32),
        "precisions": precisions,
        "xla": (False, True),
        "inputs": ("numpy", "dataset"),
        "strategies": tuple(STRATEGIES),
        "replicas": (1, 2),
    }
    selected = {
        "rows": args.rows,
        "sinks": args.sinks,
        "precisions": args.precisions,
        "xla": args.xla,
        "inputs": args.inputs,
        "strategies": args.strategies,
        "replicas": args.replicas,
    }
    if args.full or any(v is not None for v in selected.values()):
        base = dict(everything) if args.full else {
            "rows": ("digits", "wide"),
            "sinks": (1, 32),
            "precisions": ("float32",),
            "xla": (False,),
            "inputs": ("numpy",),
            "strategies": tuple(STRATEGIES),
            "replicas": (1, 2),
        }
        base.update({k: v for k, v in selected.items() if v is not None})
        return [base]
    # The default subset (about 10 minutes on 2 CPU cores): every strategy on
    # the host-bound row; on the compute-bound row, 2 replicas against 1; XLA,
    # bfloat16 and the tf.data input on the host-bound row, one replica; the
    # conv net and the Transformer at sink 32, one replica.
    one = {"precisions": ("float32",), "xla": (False,), "inputs": ("numpy",)}
    return [
        {**one, "rows": ("digits",), "sinks": (1, 32), "strategies": tuple(STRATEGIES), "replicas": (1, 2)},
        {**one, "rows": ("wide",), "sinks": (1, 32), "strategies": ("mirrored",), "replicas": (1, 2)},
        {**one, "rows": ("digits",), "sinks": (32,), "xla": (True,), "strategies": ("mirrored",), "replicas": (1,)},
        {**one, "rows": ("digits",), "sinks": (32,), "precisions": ("mixed_bfloat16",), "strategies": ("mirrored",),
         "replicas": (1,)},
        {**one, "rows": ("digits",), "sinks": (1, 32), "inputs": ("dataset",), "strategies": ("mirrored",),
         "replicas": (1,)},
        {**one, "rows": ("conv", "transformer"), "sinks": (32,), "strategies": ("mirrored",), "replicas": (1,)},
    ]


def plan(args) -> tuple[dict, list[dict]]:
    """`{setting: [configs]}` in run order, and the configurations not measured, with why."""
    settings: dict[Setting, list[Config]] = {}
    skipped = []
    for group in _groups(args):
        for row, sink, precision, xla, inp in itertools.product(
            group["rows"], group["sinks"], group["precisions"], group["xla"], group["inputs"]
        ):
            setting = Setting(row, sink, precision, xla, inp)
            configs = settings.setdefault(setting, [Config(KERAS, 1)])
            for strategy, replicas in itertools.product(group["strategies"], group["replicas"]):
                config = Config(strategy, replicas)
                if config in configs:
                    continue
                reason = _not_measured(config, setting)
                if reason:
                    entry = {"setting": setting.label(), "config": config.label(), "reason": reason}
                    if entry not in skipped:
                        skipped.append(entry)
                    continue
                configs.append(config)
    return settings, skipped


def _not_measured(config: Config, setting: Setting) -> str | None:
    """Why a configuration cannot run by design (never a failure), or None."""
    if config.strategy == "multi_worker" and config.replicas > 1:
        return "multi_worker runs one replica per worker process on CPU and on one GPU"
    if config.strategy.startswith("sharded_optimizer") and setting.precision == "mixed_float16":
        return "sharded_optimizer refuses LossScaleOptimizer (mixed_float16) by design"
    return None


# ---------------------------------------------------------------------------
# Models and data.
# ---------------------------------------------------------------------------


def sizes(row: str, args) -> dict:
    """The row's model sizes, global batch and steps per epoch (`--quick`, `--gpu` aware)."""
    table = {
        "digits": {"batch": 256, "steps": 128},
        "wide": {"batch": 1024, "steps": 16, "width": 4096 if args.gpu else 1024, "depth": 4, "input": 1024},
        "conv": {"batch": 256 if args.gpu else 128, "steps": 16, "filters": (32, 64), "dense": 128},
        "transformer": {"batch": 64 if args.gpu else 32, "steps": 16, "seq": 128, "d_model": 256,
                        "heads": 4, "ffn": 512, "blocks": 2, "vocab": 1000},
    }
    quick = {
        "digits": {"steps": 64},
        "wide": {"batch": 256, "width": 256},
        "conv": {"batch": 64, "filters": (8, 16), "dense": 32},
        "transformer": {"batch": 16, "seq": 32, "d_model": 64, "ffn": 128},
    }
    s = dict(table[row])
    if args.quick:
        s.update(quick[row])
    if args.steps:
        s["steps"] = args.steps
    return s


def build_layers(keras, row: str, s: dict):
    """The row's model (uncompiled). The last layer computes in float32 under mixed precision."""
    out = keras.layers.Dense(10, dtype="float32")
    if row == "digits":
        return keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
             keras.layers.Dense(512, activation="relu"), out]
        )
    if row == "wide":
        return keras.Sequential(
            [keras.Input((s["input"],))]
            + [keras.layers.Dense(s["width"], activation="relu") for _ in range(s["depth"])]
            + [out]
        )
    if row == "conv":
        f1, f2 = s["filters"]
        conv = lambda f: keras.layers.Conv2D(f, 3, padding="same", activation="relu")  # noqa: E731
        return keras.Sequential(
            [keras.Input((32, 32, 3)), conv(f1), conv(f1), keras.layers.MaxPooling2D(), conv(f2), conv(f2),
             keras.layers.MaxPooling2D(), keras.layers.Flatten(),
             keras.layers.Dense(s["dense"], activation="relu"), out]
        )
    if row == "transformer":
        d = s["d_model"]
        tokens = keras.Input((s["seq"],), dtype="int32")
        x = keras.layers.Embedding(s["vocab"], d)(tokens)
        x = _position_embedding(keras)(x)
        for _ in range(s["blocks"]):
            attention = keras.layers.MultiHeadAttention(s["heads"], d // s["heads"])(x, x)
            x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attention]))
            h = keras.layers.Dense(s["ffn"], activation="gelu")(x)
            x = keras.layers.LayerNormalization()(keras.layers.Add()([x, keras.layers.Dense(d)(h)]))
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(tokens, out(x))
    raise ValueError(f"Argument 'row' must be one of {ROWS}. Received: row={row!r}")


def _position_embedding(keras):
    """A learned embedding per position, added to the tokens' (its gradient is dense)."""

    class PositionEmbedding(keras.layers.Layer):
        def build(self, shape):
            self.positions = self.add_weight(
                shape=(shape[1], shape[2]), initializer=keras.initializers.RandomNormal(stddev=0.02)
            )

        def call(self, x):
            return x + keras.ops.cast(self.positions, x.dtype)

    return PositionEmbedding()


def make_data(np, tfdist, row: str, s: dict, samples: int):
    """`(x, y)` of `samples` examples: the digits tiled, or generated from seed 0."""
    rng = np.random.default_rng(0)
    if row == "digits":
        x, y = tfdist.datasets.load_digits()
        reps = -(-samples // len(x))
        return np.tile(x, (reps, 1))[:samples], np.tile(y, reps)[:samples]
    y = rng.integers(0, 10, samples).astype("int32")
    if row == "wide":
        return rng.standard_normal((samples, s["input"]), dtype=np.float32), y
    if row == "conv":
        return rng.standard_normal((samples, 32, 32, 3), dtype=np.float32), y
    return rng.integers(0, s["vocab"], (samples, s["seq"])).astype("int32"), y


# ---------------------------------------------------------------------------
# Building and timing one configuration.
# ---------------------------------------------------------------------------


class Prepared:
    """A built, warmed-up configuration: `window()` trains one epoch and returns samples/s."""

    def __init__(self, window, release):
        self.window = window
        self.release = release


def make_strategy(tfdist, config: Config, setting: Setting, devices: list[str]):
    name, params = STRATEGIES[config.strategy]
    options = {"sink_size": setting.sink, "precision": setting.precision, "jit_compile": setting.xla}
    chosen = devices[: config.replicas]
    if name == "central_storage":
        params = {**params, "compute_devices": chosen}
    elif name != "multi_worker":
        params = {**params, "devices": chosen}
    return tfdist.get_strategy(name, **params, **options)


def compiled_model(keras, setting: Setting, s: dict, strategy=None):
    """The row's model, built and compiled under `strategy` (None: plain Keras) from seed 0."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        if strategy is None and setting.precision != "float32":
            # Plain Keras: the global policy while the layers are built (and
            # while compile wraps the optimizer for mixed_float16).
            keras.config.set_dtype_policy(setting.precision)
        try:
            model = build_layers(keras, setting.row, s)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                # Under a strategy the `jit_compile` option decides (Keras's "auto" is off there).
                jit_compile=setting.xla if strategy is None else "auto",
                steps_per_execution=setting.sink if strategy is None else 1,
            )
        finally:
            keras.config.set_dtype_policy("float32")
    return model


class _Clock:
    """A Keras callback timing the epoch of a one-epoch `fit` (made on first use: imports Keras)."""

    cls = None

    @classmethod
    def make(cls):
        if cls.cls is None:
            import keras

            class Clock(keras.callbacks.Callback):
                def on_epoch_begin(self, epoch, logs=None):
                    self.begin = time.perf_counter()

                def on_epoch_end(self, epoch, logs=None):
                    self.seconds = time.perf_counter() - self.begin

            cls.cls = Clock
        return cls.cls()


def prepare(modules, config: Config, setting: Setting, s: dict, data, devices, steps: int | None = None) -> Prepared:
    """Builds `config` in `setting`, warms it up, and returns its timing window.

    `steps`: the epoch's length when it is not the setting's own (a sink-1 run
    on a sink-32 setting's epoch).
    """
    keras, tf, np, tfdist = modules
    x, y = data
    batch, steps = s["batch"], steps or epoch_steps(setting, s)
    strategy = None if config.strategy == KERAS else make_strategy(tfdist, config, setting, devices)
    model = compiled_model(keras, setting, s, strategy)
    if setting.input == "dataset":
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).cache()
            .prefetch(tf.data.AUTOTUNE)
        )
        fit_args, fit_kwargs = (dataset,), {"shuffle": False}
        # A whole epoch: traces the step and fills the cache.
        model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    else:
        fit_args, fit_kwargs = (x, y), {"batch_size": batch, "shuffle": False}
        # One host call traces (and compiles) the step.
        warm = max(2, setting.sink) * batch
        model.fit(x[:warm], y[:warm], epochs=1, verbose=0, **fit_kwargs)
    samples = steps * batch

    def window() -> float:
        clock = _Clock.make()
        before = int(model.optimizer.iterations.numpy())
        model.fit(*fit_args, epochs=1, verbose=0, callbacks=[clock], **fit_kwargs)
        ran = int(model.optimizer.iterations.numpy()) - before
        if ran != steps:
            # Samples/s would be wrong, not just slow.
            raise RuntimeError(f"The epoch ran {ran} optimizer steps; expected {steps}.")
        return samples / clock.seconds

    def release():
        nonlocal model
        del model

    return Prepared(window, release)


def prepare_bound(modules, setting: Setting, s: dict, data, devices) -> Prepared:
    """The on-device upper bound of `benchmarks/sinking.py` for mirrored on 2 devices.

    The same training step (`tfdist.engine.TrainStep`) in one `tf.while_loop`
    over an epoch's steps, on one distributed batch already on the devices:
    no input pipeline, no host call per chunk, no Keras.
    """
    keras, tf, np, tfdist = modules
    x, y = data
    batch, steps = s["batch"], epoch_steps(setting, s)
    strategy = tfdist.get_strategy("mirrored", devices=devices[:2], precision=setting.precision)
    model = compiled_model(keras, dataclasses.replace(setting, sink=1), s, strategy)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # builds the optimizer
    step = tfdist.engine.TrainStep(model)
    # The iterator lives as long as the bound: dropping a distributed iterator
    # that still prefetches is not what is measured.
    iterator = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:batch], y[:batch])).batch(batch)
    ))
    one = next(iterator)

    @tf.function
    def epoch(data):
        def body(i):
            step(data)
            return (i + 1,)

        return tf.while_loop(lambda i: i < steps, body, (tf.constant(0),))

    epoch(one)[0].numpy()

    def window() -> float:
        start = time.perf_counter()
        epoch(one)[0].numpy()
        return steps * batch / (time.perf_counter() - start)

    def release():
        nonlocal model, step, epoch, iterator
        del model, step, epoch, iterator

    return Prepared(window, release)


def epoch_steps(setting: Setting, s: dict) -> int:
    """Steps per timed epoch: the row's, rounded up to whole host calls of `sink` steps."""
    k = setting.sink
    return max(k, -(-s["steps"] // k) * k)


def wants_bound(setting: Setting, configs: list[Config]) -> bool:
    return (
        setting.row == "digits" and setting.sink == 32 and not setting.xla and setting.input == "numpy"
        and setting.precision == "float32" and Config("mirrored", 2) in configs
    )


def run_setting(modules, setting: Setting, configs: list[Config], args, devices, failures: list) -> dict:
    """Measures every configuration of `setting`, interleaved; returns `{label: result}`."""
    np, tfdist = modules[2], modules[3]
    s = sizes(setting.row, args)
    data = make_data(np, tfdist, setting.row, s, epoch_steps(setting, s) * s["batch"])
    prepared: dict[str, Prepared] = {}
    builders = [(c.label(), lambda c=c: prepare(modules, c, setting, s, data, devices)) for c in configs]
    if wants_bound(setting, configs) and not args.no_bound:
        builders.append((BOUND, lambda: prepare_bound(modules, setting, s, data, devices)))
        # Sink 1 on the same epoch, in the same rounds: the sinking ratio compares like with like.
        builders.append((SINK_1, lambda: prepare(modules, Config("mirrored", 2), dataclasses.replace(setting, sink=1),
                                                 s, data, devices, steps=epoch_steps(setting, s))))
    for label, build in builders:
        start = time.perf_counter()
        _status(args, f"{label} (build/warm-up)")
        try:
            prepared[label] = build()
        except Exception as error:  # a configuration that fails is named and the run goes on
            _record_failure(failures, setting, label, "build/warm-up", error)
            continue
        if args.verbose:
            print(f"  prepared {label} in {time.perf_counter() - start:.1f}s", flush=True)
    windows: dict[str, list[float]] = {label: [] for label in prepared}
    order = list(prepared)
    for round_ in range(args.repeats):
        # Rotate who goes first, so no configuration always follows the same one.
        turn = order[round_ % len(order):] + order[: round_ % len(order)] if order else []
        for label in turn:
            if label not in prepared:
                continue
            try:
                _status(args, f"{label} (timed epoch {round_ + 1})")
                windows[label].append(prepared[label].window())
            except Exception as error:
                _record_failure(failures, setting, label, "timed epoch", error)
                prepared.pop(label).release()
                windows.pop(label)
    for p in prepared.values():
        p.release()
    gc.collect()
    return {
        label: {"samples_per_s": statistics.median(w), "windows": w}
        for label, w in windows.items()
        if w
    }


def _status(args, text: str) -> None:
    """Notes what the child is doing, for the parent to name if the process crashes."""
    if args.status:
        with open(args.status, "w") as f:
            f.write(text)
    if args.verbose:
        print(f"  {text}", flush=True)


def _record_failure(failures: list, setting: Setting, label: str, phase: str, error: Exception) -> None:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    print(f"\nFAILED: {label} in [{setting.label()}] during {phase}:\n{text}", file=sys.stderr, flush=True)
    failures.append({"setting": setting.label(), "config": label, "phase": phase,
                     "error": f"{type(error).__name__}: {error}"[:2000]})


# ---------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------


def row_title(setting: Setting, args) -> str:
    s = sizes(setting.row, args)
    what = {
        "digits": "digits MLP 64-512-512-10",
        "wide": f"wide MLP {s.get('depth')}x{s.get('width')}, input {s.get('input')}",
        "conv": f"conv net {s.get('filters')}",
        "transformer": f"Transformer encoder {s.get('blocks')} blocks, d_model {s.get('d_model')}, "
                       f"seq {s.get('seq')}",
    }[setting.row]
    return f"{what}, batch {s['batch']}, {epoch_steps(setting, s)} steps/epoch"


def report(results: list[dict], args) -> dict:
    """Prints the tables and the summaries; returns the summaries."""
    print("\nsamples/s (median of interleaved one-epoch windows) and ratio to plain Keras in the same setting")
    for entry in results:
        setting = entry["setting_obj"]
        print(f"\n{setting.label()}  ({row_title(setting, args)})")
        print(f"  {'configuration':<24} {'samples/s':>10} {'vs Keras':>9} {'vs x1':>7}  windows")
        shared_base = entry["measured"].get(KERAS, {}).get("samples_per_s")
        for label, m in entry["measured"].items():
            if label in (BOUND, SINK_1):
                continue
            base = m["keras_baseline"]["samples_per_s"] if "keras_baseline" in m else shared_base
            ratio = m["samples_per_s"] / base if base else float("nan")
            m["ratio_to_keras"] = ratio
            one = _one_replica_label(label)
            vs_one = ""
            if one and one in entry["measured"]:
                m["ratio_to_one_replica"] = m["samples_per_s"] / entry["measured"][one]["samples_per_s"]
                vs_one = f"{m['ratio_to_one_replica']:.2f}"
            spread = " ".join(f"{w:.0f}" for w in m["windows"])
            if "keras_baseline" in m:
                spread += f"  (own process; its Keras: {m['keras_baseline']['samples_per_s']:.0f})"
            print(f"  {label:<24} {m['samples_per_s']:>10.0f} {ratio:>9.2f} {vs_one:>7}  {spread}")
        for label, title in ((SINK_1, SINK_1), (BOUND, "on-device bound (x2)")):
            if label in entry["measured"]:
                m = entry["measured"][label]
                print(f"  {title:<24} {m['samples_per_s']:>10.0f} {'':>9} {'':>7}  "
                      + " ".join(f"{w:.0f}" for w in m["windows"]))

    summary = {"one_replica": {}, "two_vs_one_at_sink_32": [], "sinking": None}
    # One replica against plain Keras: the worst ratio per strategy.
    print("\nOne replica against plain Keras (target >= 0.95 everywhere): worst ratio per strategy")
    for strategy in STRATEGIES:
        ratios = [
            (e["measured"][f"{strategy} x1"]["ratio_to_keras"], e["setting"])
            for e in results
            if not math.isnan(e["measured"].get(f"{strategy} x1", {}).get("ratio_to_keras", math.nan))
        ]
        if not ratios:
            continue
        worst, where = min(ratios)
        below = sum(r < 0.95 for r, _ in ratios)
        summary["one_replica"][strategy] = {"worst": worst, "worst_setting": where, "settings": len(ratios),
                                            "below_0_95": below}
        print(f"  {strategy:<22} worst {worst:.2f} ({where}); {below} of {len(ratios)} settings below 0.95")

    print("\n2 logical devices at sink 32 against 1, compute-bound rows (target >= 0.9)")
    for e in results:
        setting = e["setting_obj"]
        if setting.row not in COMPUTE_BOUND or setting.sink != 32:
            continue
        for label, m in e["measured"].items():
            if "ratio_to_one_replica" in m:
                summary["two_vs_one_at_sink_32"].append(
                    {"setting": e["setting"], "config": label, "ratio": m["ratio_to_one_replica"]}
                )
                print(f"  {label:<22} {m['ratio_to_one_replica']:.2f}  ({e['setting']})")
    if not summary["two_vs_one_at_sink_32"]:
        print("  not measured in this run")

    sink = {}
    for e in results:
        setting = e["setting_obj"]
        if (setting.row, setting.precision, setting.xla, setting.input) != ("digits", "float32", False, "numpy"):
            continue
        m = e["measured"]
        if SINK_1 in m and "mirrored x2" in m:
            # Timed in the same rounds: preferred.
            sink.update({1: m[SINK_1]["samples_per_s"], 32: m["mirrored x2"]["samples_per_s"], "same_rounds": True})
        elif "mirrored x2" in m and not sink.get("same_rounds"):
            sink[setting.sink] = m["mirrored x2"]["samples_per_s"]
        if BOUND in m:
            sink["bound"] = m[BOUND]["samples_per_s"]
    print("\nSinking: mirrored on 2 logical devices, digits MLP (target: sink 32 >= 3x sink 1; "
          "sink 32 within 10% of the bound at 'epoch')")
    if 1 in sink and 32 in sink:
        where = "timed in the same rounds" if sink.get("same_rounds") else "timed in separate processes"
        summary["sinking"] = {"sink_1": sink[1], "sink_32": sink[32], "ratio_32_to_1": sink[32] / sink[1],
                              "same_rounds": bool(sink.get("same_rounds"))}
        print(f"  sink 32 / sink 1: {sink[32] / sink[1]:.2f}x  ({sink[32]:.0f} / {sink[1]:.0f} samples/s; {where})")
        if "bound" in sink:
            summary["sinking"].update(
                bound=sink["bound"], bound_to_1=sink["bound"] / sink[1], sink_32_to_bound=sink[32] / sink["bound"]
            )
            print(f"  on-device bound / sink 1: {sink['bound'] / sink[1]:.2f}x; sink 32 reaches "
                  f"{sink[32] / sink['bound']:.2f} of the bound")
    else:
        print("  not measured in this run (needs mirrored x2 on digits at sink 32, float32, XLA off, numpy)")
    return summary


def _one_replica_label(label: str) -> str | None:
    if label.endswith(" x2"):
        return label[:-3] + " x1"
    return None


# ---------------------------------------------------------------------------


def _csv(kind):
    def parse(text: str):
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        return tuple(kind(v) for v in values)

    return parse


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected 'on' or 'off'. Received: {value!r}")
    return value == "on"


def _choices(allowed):
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}. Received: {value!r}")
        return value

    return check


def _strategy(value: str) -> str:
    # "sharded_optimizer" alone means both stages.
    if value == "sharded_optimizer":
        return value
    return _choices(tuple(STRATEGIES))(value)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Selection flags take comma-separated lists; any of them (or --full) replaces the default "
               "subset by their cross product (unset ones: digits,wide / 1,32 / float32 / off / numpy / every "
               "strategy / 1,2; with --full: everything).",
    )
    p.add_argument("--rows", type=_csv(_choices(ROWS)), help=f"models: {','.join(ROWS)}")
    p.add_argument("--strategies", type=_csv(_strategy),
                   help=f"{','.join(STRATEGIES)} (sharded_optimizer = both stages); plain Keras always runs")
    p.add_argument("--replicas", type=_csv(int), help="1,2")
    p.add_argument("--sinks", type=_csv(int), help="steps per host call, e.g. 1,32")
    p.add_argument("--precisions", type=_csv(_choices(GPU_PRECISIONS)), help=",".join(GPU_PRECISIONS))
    p.add_argument("--xla", type=_csv(_on_off), help="off,on")
    p.add_argument("--inputs", type=_csv(_choices(("numpy", "dataset"))), help="numpy,dataset")
    p.add_argument("--full", action="store_true", help="every row, setting and strategy (hours on CPU)")
    p.add_argument("--quick", action="store_true", help="smaller models and epochs, for smoke runs")
    p.add_argument("--gpu", action="store_true",
                   help="size the rows for a GPU and split it into 2 logical GPUs (mixed_float16 included)")
    p.add_argument("--gpu-memory-mb", type=int, default=30000, help="memory of each logical GPU (default 30000)")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per configuration (default 3)")
    p.add_argument("--steps", type=int, help="steps per timed epoch for every row (default: per row)")
    p.add_argument("--no-bound", action="store_true", help="skip the on-device upper bound")
    p.add_argument("--out", help="JSON path (default benchmarks/results/overhead.json)")
    p.add_argument("--verbose", action="store_true", help="print build and warm-up times")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per setting before it counts as failed")
    p.add_argument("--retries", type=int, default=1,
                   help="times a setting whose process crashed is run again (default 1); crashes still fail the run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--status", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.strategies:
        expanded = []
        for s in args.strategies:
            expanded += ["sharded_optimizer:1", "sharded_optimizer:2"] if s == "sharded_optimizer" else [s]
        args.strategies = tuple(dict.fromkeys(expanded))
    for name in ("replicas", "sinks"):
        values = getattr(args, name)
        if values and any(v < 1 for v in values):
            p.error(f"--{name} takes positive integers. Received: {values}")
    if args.replicas and any(r > 2 for r in args.replicas):
        p.error(f"--replicas takes 1 and/or 2 (2 logical devices are configured). Received: {args.replicas}")
    return args


def child(args) -> None:
    """Runs in a child process: measures one setting, writes `{measured, failures}` as JSON."""
    spec = json.loads(args.child)
    import tfdist

    if args.gpu:
        devices = tfdist.configure_local_devices(2, memory_limit_mb=args.gpu_memory_mb)
    else:
        devices = tfdist.configure_local_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    # Every configuration traces its own functions; TensorFlow's retracing hint is noise here.
    tf.get_logger().setLevel("ERROR")
    setting = Setting(**spec["setting"])
    configs = [Config(**c) for c in spec["configs"]]
    failures: list[dict] = []
    measured = run_setting((keras, tf, np, tfdist), setting, configs, args, devices, failures)
    with open(spec["out"], "w") as f:
        json.dump({"devices": devices, "measured": measured, "failures": failures}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorFlow's teardown of many strategies and iterators is not what is measured.
    os._exit(0)


# Lines TensorFlow and absl print at start-up whatever TF_CPP_MIN_LOG_LEVEL says.
_NOISE = ("I0000 ", "WARNING: All log messages before absl", "To enable the following instructions",
          "WARNING:tensorflow:Collective ops is not configured")


# Strategies measured in a process of their own, beside their own plain-Keras baseline:
# multi_worker (one local worker, transfer on) has crashed the process with SIGSEGV after
# a few consecutive `fit` calls (TensorFlow 2.21), which would lose the setting's other numbers.
ISOLATED = ("multi_worker",)


def process_groups(configs: list[Config]) -> list[list[Config]]:
    """The configurations of a setting split into processes, each led by plain Keras."""
    keras_config = Config(KERAS, 1)
    shared = [c for c in configs if c.strategy not in ISOLATED]
    groups = [shared] if shared else [[keras_config]]
    groups += [[keras_config, c] for c in configs if c.strategy in ISOLATED]
    return groups


def merge(measured: dict, outcome: dict) -> None:
    """Adds one process's measurements; a later process's Keras becomes its configurations' baseline."""
    if KERAS not in measured:
        measured.update(outcome)
        return
    baseline = outcome.get(KERAS)
    for label, m in outcome.items():
        if label == KERAS:
            continue
        if baseline:
            m["keras_baseline"] = baseline
        measured[label] = m


def run_in_child(setting: Setting, configs: list[Config], args, argv: list[str]) -> dict:
    """Measures one setting in a fresh process (its strategies, collectives and memory are its own).

    A child that crashes is run again, up to `--retries` times; every crash is
    reported (`crashes`), naming the configuration it was building or timing.
    A child that crashes every time, or hangs, fails every configuration it held.
    """
    crashes = []
    for attempt in range(args.retries + 1):
        outcome, crash = _run_child_once(setting, configs, args, argv)
        if crash is None:
            outcome["crashes"] = crashes
            return outcome
        crashes.append(crash)
        print(f"\nCRASHED: [{setting.label()}] while {crash['during']}: {crash['error']}"
              + ("; running the setting again" if attempt < args.retries else ""), file=sys.stderr, flush=True)
        if crash["error"].startswith("timed out"):
            break
    return {
        "devices": None, "measured": {}, "crashes": crashes,
        "failures": [{"setting": setting.label(), "config": ", ".join(c.label() for c in configs),
                      "phase": "child process", "error": f"{crashes[-1]['error']} while {crashes[-1]['during']}"}],
    }


def _run_child_once(setting: Setting, configs: list[Config], args, argv: list[str]):
    """One child process: `(outcome, None)`, or `(None, crash)` when it died or hung."""
    import subprocess
    import tempfile
    import threading

    with tempfile.TemporaryDirectory() as tmp:
        out, status = os.path.join(tmp, "setting.json"), os.path.join(tmp, "status")
        spec = {"setting": dataclasses.asdict(setting), "configs": [dataclasses.asdict(c) for c in configs],
                "out": out}
        passed = [a for a in argv if a in ("--quick", "--gpu", "--no-bound", "--verbose")]
        passed += ["--gpu-memory-mb", str(args.gpu_memory_mb), "--repeats", str(args.repeats), "--status", status]
        if args.steps:
            passed += ["--steps", str(args.steps)]
        command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), *passed]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def relay():
            for line in process.stdout:
                if not line.startswith(_NOISE):
                    sys.stdout.write(line)
                    sys.stdout.flush()

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        try:
            process.wait(timeout=args.timeout)
            error = None if process.returncode == 0 else _exit_reason(process.returncode)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            error = f"timed out after {args.timeout:.0f}s"
        reader.join(timeout=10)
        if error is None and os.path.exists(out):
            with open(out) as f:
                return json.load(f), None
        during = "starting"
        if os.path.exists(status):
            with open(status) as f:
                during = f.read() or during
        return None, {"setting": setting.label(), "during": during, "error": error or "the child wrote no result"}


def _exit_reason(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    settings, skipped = plan(args)
    n_configs = sum(len(c) for c in settings.values())
    print(f"{len(settings)} settings, {n_configs} configurations (plain Keras included), {args.repeats} "
          f"windows each; one process per setting; load average {os.getloadavg()[0]:.2f}", flush=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    failures: list[dict] = []
    crashes: list[dict] = []
    results = []
    devices = None
    for i, (setting, configs) in enumerate(settings.items(), 1):
        print(f"[{i}/{len(settings)}] {setting.label()}: {', '.join(c.label() for c in configs)}", flush=True)
        measured = {}
        for group in process_groups(configs):
            outcome = run_in_child(setting, group, args, argv)
            devices = devices or outcome["devices"]
            failures += outcome["failures"]
            crashes += outcome.get("crashes", [])
            merge(measured, outcome["measured"])
        results.append({"setting": setting.label(), "setting_obj": setting, **dataclasses.asdict(setting),
                        "sizes": sizes(setting.row, args), "measured": measured})
    summary = report(results, args)
    if skipped:
        print("\nNot measured (by design):")
        for entry in skipped:
            print(f"  {entry['config']} in [{entry['setting']}]: {entry['reason']}")
    elapsed = time.perf_counter() - started
    print(f"\n{elapsed:.0f}s; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    payload = {
        "config": {
            "devices": devices, "gpu": args.gpu, "quick": args.quick, "full": args.full,
            "repeats": args.repeats, "optimizer": "Adam(1e-3)",
            "window": "one fit epoch, on_epoch_begin to on_epoch_end; median of interleaved windows",
        },
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": elapsed,
        "results": [{k: v for k, v in r.items() if k != "setting_obj"} for r in results],
        "summary": summary,
        "not_measured": skipped,
        "failures": failures,
        "crashes": crashes,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"benchmark": "overhead", "machine": common.machine(), **payload}, f, indent=2)
        print(f"\nwrote {os.path.relpath(args.out)}")
    else:
        common.write_results("overhead", payload)
    if crashes:
        print(f"\n{len(crashes)} process crash(es) (the settings were run again; numbers above are from the "
              "runs that finished):", file=sys.stderr)
        for c in crashes:
            print(f"  [{c['setting']}] while {c['during']}: {c['error']}", file=sys.stderr)
    if failures:
        print(f"\n{len(failures)} configuration(s) FAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f['config']} in [{f['setting']}] during {f['phase']}: {f['error'][:300]}", file=sys.stderr)
    return 1 if failures or crashes else 0


if __name__ == "__main__":
    sys.exit(main())

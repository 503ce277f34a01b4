"""What the step report costs: the same fit with and without `tfdist.callbacks.StepReport`, in one process.

    python benchmarks/step_report.py [--quick] [--rounds 5] [--steps 200]

For each configuration (the digits MLP 64-512-512-10 at batch 256, a
host-bound step of about a millisecond; a 4-layer 1024-wide MLP at batch
1024, a compute-bound one; each under plain Keras and under mirrored on 2
logical CPU devices), one `fit` epoch of `--steps` steps is timed from
`on_epoch_begin` to `on_epoch_end`, without the report and with it, the two
taking turns for `--rounds` rounds (the first round of each, which traces,
is dropped). Each `fit` with the report pays it whole: the count read after
every host call, TensorFlow's profiler on 5 calls, the trace read and split,
the FLOPs traced, the CPU's peak measured (once per process).

Reported per configuration: the epoch's median time without and with the
report and their ratio (the report's cost over a fit of `--steps` steps),
the step's median outside the profiled calls with and without (the cost a
step pays in steady state), and the report's own accounting of its time
(`report_cost_s`). Multi-process jobs split their steps by timed ablations
instead of the profiler (docs/performance.md); their cost is the ablations'
seconds (`ablation_s`, once per report) and the same per-call read, reported
by benchmarks/multi_worker.py and benchmarks/vs_ddp.py.

Prints a table and writes benchmarks/results/step_report.json. Never
asserts: timing depends on the machine and on what else runs on it.

`--render TRACE PNG` draws a merged `tfdist launch --timeline` trace instead
(docs/performance.md's picture).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import common  # noqa: E402 (benchmarks/common.py, beside this script)

COLORS = {"input": (230, 159, 0), "compute": (0, 114, 178), "exchange": (213, 94, 0), "update": (0, 158, 115),
          "other": (200, 200, 200), "wait for peers": (240, 60, 60), "host call": (120, 120, 120)}


def render_png(trace_path: str, png_path: str, calls: int = 4, width: int = 1400) -> str:
    """Draws `calls` host calls of a merged `tfdist launch --timeline` trace as a PNG (Pillow), one band per worker."""
    import json

    from PIL import Image, ImageDraw

    with open(trace_path) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    steps = sorted({e["args"]["call"] for e in events if "call" in e.get("args", {})})[:calls]
    shown = [e for e in events if e.get("args", {}).get("call") in steps
             or (e["tid"] == 1 and int(e["name"].split()[-1]) in steps)]
    t0 = min(e["ts"] for e in shown)
    t1 = max(e["ts"] + e["dur"] for e in shown)
    left, right, band, track = 110, 20, 96, 26
    height = 40 + band * len(names) + 40
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    scale = (width - left - right) / (t1 - t0)

    def x(t):
        return left + (t - t0) * scale

    for row, pid in enumerate(sorted(names)):
        top = 30 + row * band
        draw.text((8, top + 30), names[pid], fill="black")
        for tid, label in ((1, "steps"), (2, "phases"), (3, "exchange")):
            y = top + (tid - 1) * track
            draw.text((60, y + 7), label, fill=(90, 90, 90))
            for e in shown:
                if e["pid"] != pid or e["tid"] != tid:
                    continue
                key = "host call" if tid == 1 else e["name"] if e["name"] in COLORS else "exchange"
                draw.rectangle([x(e["ts"]), y + 2, max(x(e["ts"] + e["dur"]), x(e["ts"]) + 1), y + track - 4],
                               fill=COLORS[key])
                if tid == 1:
                    draw.text((x(e["ts"]) + 3, y + 6), e["name"], fill="white")
    # Time axis (ms) and legend.
    axis = 30 + band * len(names)
    for ms in range(0, int((t1 - t0) / 1000) + 1, max(int((t1 - t0) / 1000 / 10), 1)):
        draw.line([x(t0 + ms * 1000), axis, x(t0 + ms * 1000), axis + 5], fill="black")
        draw.text((x(t0 + ms * 1000) - 8, axis + 7), f"{ms} ms", fill="black")
    cursor = left
    for label, color in COLORS.items():
        draw.rectangle([cursor, height - 14, cursor + 12, height - 4], fill=color)
        draw.text((cursor + 16, height - 16), label, fill="black")
        cursor += 20 + 8 * len(label)
    image.save(png_path)
    return png_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--render", nargs=2, metavar=("TRACE", "PNG"),
                   help="draw 4 host calls of a merged --timeline trace as a PNG (needs Pillow) and exit")
    p.add_argument("--quick", action="store_true", help="3 rounds of 60 steps (a smoke run)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration (default 5)")
    p.add_argument("--steps", type=int, default=200, help="steps per fit (default 200)")
    args = p.parse_args()
    if args.render:
        print(f"wrote {render_png(*args.render)}")
        return
    if args.quick:
        args.rounds, args.steps = 3, 60

    import tfdist

    tfdist.configure_local_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.callbacks import StepReport

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

        def on_train_batch_begin(self, batch, logs=None):
            self.steps.append(time.perf_counter())

        def on_train_begin(self, logs=None):
            self.steps = []

    def model_for(row):
        keras.utils.set_random_seed(0)
        width, depth, features = (512, 2, 64) if row == "digits" else (1024, 4, 1024)
        layers = [keras.Input((features,))] + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def data_for(row):
        batch = 256 if row == "digits" else 1024
        if row == "digits":
            x, y = tfdist.datasets.load_digits()
        else:
            rng = np.random.default_rng(0)
            x, y = rng.standard_normal((4 * batch, 1024)).astype("float32"), rng.integers(0, 10, 4 * batch)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)

    rows = []
    for row in ("digits", "wide"):
        for strategy_name in (None, "mirrored"):
            strategy = tfdist.get_strategy(strategy_name) if strategy_name else None
            if strategy is not None:
                with strategy.scope():
                    model = model_for(row)
            else:
                model = model_for(row)
            data = data_for(row)
            times = {"off": [], "on": []}
            steady = {"off": [], "on": []}
            costs, last = [], None
            for r in range(args.rounds + 1):
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    timer = Timer()
                    callbacks = [timer]
                    report = StepReport(verbose=0) if mode == "on" else None
                    if report is not None:
                        callbacks.append(report)
                    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=callbacks)
                    if r == 0:
                        continue  # traces
                    times[mode].append(timer.seconds)
                    # Steady state: the steps after the report's warm-up and profiled calls (2 + 6).
                    gaps = [b - a for a, b in zip(timer.steps[8:], timer.steps[9:])]
                    steady[mode].append(statistics.median(gaps))
                    if report is not None:
                        costs.append(report.result["report_cost_s"])
                        last = report.result
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            s_off, s_on = statistics.median(steady["off"]), statistics.median(steady["on"])
            entry = {"row": row, "strategy": strategy_name or "keras", "steps": args.steps,
                     "epoch_s_off": off, "epoch_s_on": on, "epoch_ratio": on / off,
                     "step_ms_off": 1e3 * s_off, "step_ms_on": 1e3 * s_on, "step_ratio": s_on / s_off,
                     "report_cost_s": statistics.median(costs), "phases_s": last["phases_s"],
                     "step_s": last["step_s"]}
            rows.append(entry)
            print(f"  {row:<7} {entry['strategy']:<9} epoch {off:.3f} s -> {on:.3f} s ({on / off:.3f}x), "
                  f"steady step {1e3 * s_off:.3f} -> {1e3 * s_on:.3f} ms ({s_on / s_off:.3f}x), "
                  f"report's own {entry['report_cost_s']:.3f} s", flush=True)

    header = (f"{'model':<8} {'strategy':<9} {'steps':>5} {'epoch off s':>11} {'epoch on s':>10} {'ratio':>6} "
              f"{'step off ms':>11} {'step on ms':>10} {'ratio':>6} {'report s':>8}")
    print()
    print(header)
    print("-" * len(header))
    for e in rows:
        print(f"{e['row']:<8} {e['strategy']:<9} {e['steps']:>5} {e['epoch_s_off']:>11.3f} {e['epoch_s_on']:>10.3f} "
              f"{e['epoch_ratio']:>6.3f} {e['step_ms_off']:>11.3f} {e['step_ms_on']:>10.3f} {e['step_ratio']:>6.3f} "
              f"{e['report_cost_s']:>8.3f}")
    print("ratio = with the report / without; steady step = the median step after the report's first 8 calls;")
    print(f"report s = the report's own accounting of its time in one fit; load average {os.getloadavg()[0]:.2f}")
    common.write_results("step_report", {"rounds": args.rounds, "steps": args.steps, "quick": args.quick,
                                         "load_average": os.getloadavg(), "rows": rows})


if __name__ == "__main__":
    main()

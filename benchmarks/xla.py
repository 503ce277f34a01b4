"""XLA: step time with and without `jit_compile=True`, on 4 logical CPU devices.

    python benchmarks/xla.py [--steps 30] [--batch 256]

The same model (an MLP with LayerNormalization and GELU, the kind of
elementwise-heavy graph XLA fuses) is trained under mirrored and
central_storage with `jit_compile=False` and `jit_compile=True` (each
replica's forward and backward pass compiled; collectives outside). Step time
is measured over the epochs after the first (which includes tracing and
compilation), and

    speed-up = step time without XLA / step time with XLA.

Prints a table and writes benchmarks/results/xla.json. Never asserts: timing
depends on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os

import common  # noqa: E402 (benchmarks/common.py, beside this script)


def _epoch_times(keras, model, dataset, steps: int) -> list[float]:
    from tfdist.timing import EpochTimer

    timer = EpochTimer()
    times = timer.times

    model.fit(dataset, epochs=4, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfdist

    tfdist.configure_local_devices(4)
    import keras
    import tensorflow as tf

    x, y = tfdist.datasets.load_digits()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch)
    devices = [f"/cpu:{i}" for i in range(4)]

    def build():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((64,))]
        for _ in range(3):
            layers += [keras.layers.Dense(256), keras.layers.LayerNormalization(), keras.layers.Activation("gelu")]
        layers.append(keras.layers.Dense(10))
        model = keras.Sequential(layers)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    rows = []
    for name, kwargs in (("mirrored", {"devices": devices}), ("central_storage", {"compute_devices": devices})):
        per_step = {}
        for jit in (False, True):
            strategy = tfdist.get_strategy(name, jit_compile=jit, **kwargs)
            with strategy.scope():
                model = build()
            times = _epoch_times(keras, model, dataset, args.steps)
            per_step[jit] = min(times[1:]) / args.steps
        rows.append(
            {
                "strategy": name,
                "replicas": 4,
                "without_xla_ms": 1000 * per_step[False],
                "with_xla_ms": 1000 * per_step[True],
                "speedup": per_step[False] / per_step[True],
            }
        )
    print(f"{'strategy':18} {'without XLA ms':>15} {'with XLA ms':>12} {'speed-up':>9}")
    for r in rows:
        print(f"{r['strategy']:18} {r['without_xla_ms']:>15.2f} {r['with_xla_ms']:>12.2f} {r['speedup']:>8.2f}x")
    common.write_results("xla", {"batch": args.batch, "rows": rows})


if __name__ == "__main__":
    main()

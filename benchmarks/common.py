"""What every benchmark shares: where its JSON goes, what it records of the machine, pinning.

The benchmarks run as scripts (`python benchmarks/NAME.py`), so this module is
imported as `common` from the script's own directory.
"""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    """The facts a reader needs to compare two result files (no TensorFlow import)."""
    info = {"platform": platform.platform(), "cpus": os.cpu_count()}
    for package in ("tensorflow", "keras"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return info


def write_results(name: str, payload: dict) -> str:
    """Writes `payload` with the benchmark's name and the machine to results/NAME.json."""
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": name, "machine": machine(), **payload}, f, indent=2)
    print(f"\nwrote {os.path.relpath(path)}")
    return path


def pin_to_one_core(index: int) -> None:
    """Pins this process to one of the cores it may use, chosen by `index`."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[index % len(cores)]})


def digits_mlp(steps_per_execution: int = 1):
    """The 64-512-512-10 digits MLP the cluster benchmarks time, compiled with SGD.

    Build it inside the strategy's scope; the seed is fixed so runs compare.
    """
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return model

"""Counts XLA compilations of a `model.fit` on bucketed docstrings (run as a subprocess).

XLA reads `XLA_FLAGS` once per process, so the test runs this script in a fresh
process with `--xla_dump_to=DIR` and counts the compiled training-step modules.
Prints JSON: {"boundaries": [...], "shapes": [...], "compilations": n}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tests.data.corpus import VOCAB, docstring_examples  # noqa: E402


def main(dump_dir: str) -> None:
    examples = docstring_examples(max_examples=300)
    ds = tf.data.Dataset.from_generator(
        lambda: iter(examples),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)),
    )
    batches = tfdist.data.bucket_by_length(ds, boundaries=[16, 32, 64, 128], global_batch_size=8)
    shapes = sorted({tuple(x.shape) for x, _ in batches})
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True
    )
    model.fit(batches, epochs=2, verbose=0)
    modules = [
        f for f in os.listdir(dump_dir) if f.endswith(".before_optimizations.txt") and "one_step_on_data" in f
    ]
    print(json.dumps({"boundaries": list(batches.boundaries), "shapes": shapes, "compilations": len(modules)}))


if __name__ == "__main__":
    main(sys.argv[1])

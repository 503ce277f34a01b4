"""Padding and XLA compilations for variable-length text: pad-to-longest, fixed-length, bucket_by_length.

    python benchmarks/bucketing_sequences.py [--batch 32] [--max-length 512]

The corpus is real text needing no download: the docstrings of the Python
standard library's public functions, classes and methods (`MODULES`), one
example per docstring, tokenized into words (label: class or function).
Docstrings longer than `--max-length` words are left out for every method.
Each method batches the same shuffled examples in global batches of
`--batch` (full batches only):

* pad-to-longest: `padded_batch`, each batch padded to its longest example;
* fixed-length: every example padded to `--max-length`;
* bucket_by_length: `tfdist.data.bucket_by_length`, boundaries chosen from the
  lengths, 4 and 8 buckets, by quantiles (the default) and by `min_padding`.

Reported per method: the fraction of token positions that are padding (the
share of the model's compute spent on padding), the number of distinct batch
shapes, and the number of XLA compilations of one epoch of `model.fit` with
`jit_compile=True` (counted from XLA's module dumps: `XLA_FLAGS` is set to
`--xla_dump_to` before TensorFlow loads), single device; and bucket_by_length
under a 2-replica mirrored strategy when the strategy accepts `jit_compile`.

Prints a table and writes benchmarks/results/bucketing_sequences.json. Never
asserts.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
DUMP = tempfile.mkdtemp(prefix="tfdist-xla-dump-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(HERE))

import tfdist  # noqa: E402

DEVICES = tfdist.configure_local_devices(2)

import common  # noqa: E402 (benchmarks/common.py, beside this script)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MODULES = (
    "argparse ast asyncio base64 bisect calendar collections concurrent.futures configparser "
    "contextlib copy csv dataclasses datetime decimal difflib email.message enum fractions ftplib "
    "functools gettext glob gzip hashlib heapq hmac html.parser http.client imaplib inspect io "
    "ipaddress itertools json logging mailbox mimetypes operator optparse os pathlib pickle pprint "
    "queue random re sched secrets shlex shutil smtplib socket sqlite3 statistics string struct "
    "subprocess tarfile tempfile textwrap threading timeit tokenize traceback typing unittest "
    "urllib.parse urllib.request uuid warnings weakref xml.dom.minidom zipfile"
).split()
VOCAB = 4096
STRATEGY_METHOD = "bucket_by_length (4 buckets, min_padding)"
METHODS = (
    "pad-to-longest",
    "fixed-length",
    "bucket_by_length (4 buckets, quantiles)",
    "bucket_by_length (8 buckets, quantiles)",
    "bucket_by_length (4 buckets, min_padding)",
    "bucket_by_length (8 buckets, min_padding)",
)


def docstrings() -> list[tuple[np.ndarray, int]]:
    """(word ids, is-a-class) for every public function, class and method docstring in MODULES."""
    seen, examples = set(), []

    def add(obj):
        doc = inspect.getdoc(obj)
        if not doc or id(obj) in seen:
            return
        seen.add(id(obj))
        words = re.findall(r"\w+", doc)
        if words:
            ids = np.array([zlib.crc32(w.encode()) % (VOCAB - 1) + 1 for w in words], np.int32)
            examples.append((ids, int(inspect.isclass(obj))))

    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if getattr(obj, "__module__", name) != module.__name__:
                continue
            add(obj)
            if inspect.isclass(obj):
                for method_name in sorted(vars(obj)):
                    method = vars(obj)[method_name]
                    if not method_name.startswith("_") and inspect.isroutine(method):
                        add(method)
    return examples


def as_dataset(examples):
    return tf.data.Dataset.from_generator(
        lambda: iter(examples),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)),
    )


def batching(method, examples, batch, max_length):
    ds = as_dataset(examples)
    if method == "pad-to-longest":
        return ds.padded_batch(batch, drop_remainder=True)
    if method == "fixed-length":
        return ds.padded_batch(batch, padded_shapes=([max_length], []), drop_remainder=True)
    buckets = int(method.split("(")[1].split()[0])
    return tfdist.data.bucket_by_length(
        ds,
        global_batch_size=batch,
        num_buckets=buckets,
        sample_size=len(examples),
        boundary_method="min_padding" if "min_padding" in method else "quantiles",
    )


def padding_stats(batches):
    tokens = positions = count = 0
    shapes = set()
    for x, _ in batches:
        x = x.numpy()
        tokens += int((x != 0).sum())
        positions += x.size
        count += x.shape[0]
        shapes.add(x.shape)
    return {"examples": count, "padding_fraction": 1 - tokens / positions, "shapes": len(shapes)}


def modules_dumped() -> set:
    return {f for f in os.listdir(DUMP) if f.endswith(".before_optimizations.txt")}


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 16),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True
    )
    return model


def xla_fit(batches, strategy=None):
    """(XLA compilations, seconds) of one epoch of fit with jit_compile=True."""
    before = modules_dumped()
    start = time.perf_counter()
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.fit(batches, epochs=1, verbose=0)
    return len(modules_dumped() - before), time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args(argv)
    corpus = docstrings()
    examples = [e for e in corpus if len(e[0]) <= args.max_length]
    np.random.default_rng(0).shuffle(examples)
    lengths = np.array([len(ids) for ids, _ in examples])

    rows = []
    for method in METHODS:
        batches = batching(method, examples, args.batch, args.max_length)
        row = {"method": method, **padding_stats(batches)}
        if hasattr(batches, "boundaries"):
            row["boundaries"] = list(batches.boundaries)
        row["xla_compilations"], row["fit_seconds"] = xla_fit(batches)
        rows.append(row)

    strategy_row = None
    try:
        strategy = tfdist.get_strategy("mirrored", devices=DEVICES, jit_compile=True)
    except (TypeError, ValueError) as e:
        strategy_row = {"method": STRATEGY_METHOD + ", mirrored x2", "unavailable": str(e).split(".")[0]}
    else:
        with strategy.scope():
            batches = batching(STRATEGY_METHOD, examples, args.batch, args.max_length)
        compilations, seconds = xla_fit(batches, strategy)
        strategy_row = {
            "method": STRATEGY_METHOD + ", mirrored x2",
            **padding_stats(batches),
            "boundaries": list(batches.boundaries),
            "xla_compilations": compilations,
            "fit_seconds": seconds,
        }

    print(
        f"Stdlib docstrings: {len(examples)} examples (of {len(corpus)}; <= {args.max_length} words), "
        f"lengths median {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, max {lengths.max()}; "
        f"global batch {args.batch}"
    )
    print(f"{'method':<56} {'padding':>8} {'shapes':>7} {'XLA compiles':>13} {'fit s':>7}  boundaries")
    for row in rows + ([strategy_row] if strategy_row else []):
        if "unavailable" in row:
            print(f"{row['method']:<56} unavailable: {row['unavailable']}")
            continue
        print(
            f"{row['method']:<56} {row['padding_fraction']:>8.1%} {row['shapes']:>7} "
            f"{row['xla_compilations']:>13} {row['fit_seconds']:>7.1f}  {row.get('boundaries', '')}"
        )

    result = {
        "corpus": {
            "modules": MODULES,
            "examples": len(examples),
            "left_out_longer_than_max_length": len(corpus) - len(examples),
            "length_median": float(np.median(lengths)),
            "length_p90": float(np.percentile(lengths, 90)),
            "length_max": int(lengths.max()),
        },
        "config": {"global_batch": args.batch, "max_length": args.max_length},
        "methods": rows,
        "under_strategy": strategy_row,
    }
    common.write_results("bucketing_sequences", result)
    return result


if __name__ == "__main__":
    main()

"""bucket_by_length: length buckets with one static shape each (issue 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.data.corpus import VOCAB, docstring_examples
from tests.strategies.parity import strategy_for

SPEC = (tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32))


@pytest.fixture(scope="module")
def examples():
    return docstring_examples(max_examples=300)


def dataset_of(examples):
    return tf.data.Dataset.from_generator(lambda: iter(examples), output_signature=SPEC)


def nonzero_lengths(x):
    # Token ids are >= 1, padding is 0.
    return (np.asarray(x) != 0).sum(axis=1)


def test_each_batch_is_padded_to_its_bucket_edge_and_holds_only_that_bucket(examples):
    boundaries = [8, 16, 32, 64]
    batches = tfdist.data.bucket_by_length(dataset_of(examples), boundaries=boundaries, global_batch_size=8)
    seen = 0
    for x, y in batches:
        assert x.shape[0] == 8 and y.shape == (8,)
        edge = x.shape[1]
        assert edge in boundaries
        lower = ([0] + boundaries)[boundaries.index(edge)]
        lengths = nonzero_lengths(x)
        assert lengths.min() > lower and lengths.max() <= edge
        seen += 1
    assert seen > 10


def test_every_example_kept_exactly_once_without_drop_remainder(examples):
    batches = tfdist.data.bucket_by_length(
        dataset_of(examples), boundaries=[8, 16, 32, 64, 128], global_batch_size=8, drop_remainder=False, too_long="drop"
    )
    got = sorted(tuple(row[row != 0].tolist()) + (int(label),) for x, y in batches for row, label in zip(x.numpy(), y.numpy()))
    kept = [(tuple(ids.tolist()) + (label,)) for ids, label in examples if len(ids) <= 128]
    assert got == sorted(kept)
    assert int(batches.dropped.numpy()) == len(examples) - len(kept) > 0


def test_pad_values_fill_the_padding(examples):
    batches = tfdist.data.bucket_by_length(dataset_of(examples), boundaries=[200], global_batch_size=4, pad_values=-1)
    x, _ = next(iter(batches))
    lengths = [len(ids) for ids, _ in examples if len(ids) <= 200][:4]
    for row, n in zip(x.numpy(), lengths):
        assert (row[n:] == -1).all() and (row[:n] != -1).all()


def test_boundaries_none_are_quantiles_of_a_sample(examples):
    batches = tfdist.data.bucket_by_length(dataset_of(examples), global_batch_size=8, num_buckets=4, sample_size=100)
    lengths = np.array([len(ids) for ids, _ in examples[:100]])
    expected = np.unique(np.quantile(lengths, [0.25, 0.5, 0.75, 1.0], method="higher").astype(int))
    assert batches.boundaries == tuple(expected.tolist())
    assert batches.boundaries[-1] == lengths.max()
    assert tfdist.data.quantile_boundaries([3, 5, 8, 9, 20], 2) == (8, 20)


def padded_positions(lengths, boundaries):
    edges = np.asarray(boundaries)
    return int(sum(edges[np.searchsorted(edges, n)] for n in lengths))


def test_min_padding_boundaries_pad_least_of_all_choices(examples):
    import itertools

    lengths = [len(ids) for ids, _ in examples[:80]]
    values = sorted(set(lengths))
    chosen = tfdist.data.min_padding_boundaries(lengths, 3)
    brute = min(
        padded_positions(lengths, list(inner) + [values[-1]]) for inner in itertools.combinations(values[:-1], 2)
    )
    assert len(chosen) == 3 and chosen[-1] == max(lengths)
    assert padded_positions(lengths, chosen) == brute
    assert padded_positions(lengths, chosen) < padded_positions(lengths, tfdist.data.quantile_boundaries(lengths, 3))


def test_boundary_method_min_padding_is_used_when_boundaries_are_none(examples):
    batches = tfdist.data.bucket_by_length(
        dataset_of(examples), global_batch_size=8, num_buckets=3, sample_size=80, boundary_method="min_padding"
    )
    assert batches.boundaries == tfdist.data.min_padding_boundaries([len(ids) for ids, _ in examples[:80]], 3)
    with pytest.raises(ValueError) as info:
        tfdist.data.bucket_by_length(dataset_of(examples), global_batch_size=8, boundary_method="optimal")
    assert str(info.value) == (
        "Argument 'boundary_method' must be 'quantiles' or 'min_padding'. Received: boundary_method='optimal'"
    )


def test_too_long_error_names_the_length(examples):
    batches = tfdist.data.bucket_by_length(dataset_of(examples), boundaries=[4], global_batch_size=2, too_long="error")
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"longer than the last boundary \(4\)\. Pass longer boundaries, or too_long=drop to skip such examples\. Its length:\]",
    ) as info:
        list(batches)
    first_too_long = next(len(ids) for ids, _ in examples if len(ids) > 4)
    assert f"Its length:] [{first_too_long}]" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(boundaries=[8, 8, 16]),
            "Argument 'boundaries' must be strictly increasing; 8 follows 8 at index 1. Received: "
            "boundaries=[8, 8, 16]. Pass strictly increasing positive integers, e.g. boundaries=[16, 32, 64, 128].",
        ),
        (
            dict(boundaries=[0, 8]),
            "Argument 'boundaries' must hold positive integers. Received: boundaries=[0, 8]. "
            "Pass strictly increasing positive integers, e.g. boundaries=[16, 32, 64, 128].",
        ),
        (
            dict(boundaries=[8], global_batch_size=30, num_replicas=4),
            "Argument 'global_batch_size' must divide evenly across the 4 replicas, so that every replica in "
            "a step gets a batch of the same static shape. Received: global_batch_size=30. Use a multiple of 4, "
            "e.g. 28 or 32.",
        ),
        (
            dict(boundaries=[8], global_batch_size=0),
            "Argument 'global_batch_size' must be a positive integer. Received: global_batch_size=0",
        ),
        (
            dict(boundaries=[8], too_long="truncate"),
            "Argument 'too_long' must be 'drop' or 'error'. Received: too_long='truncate'",
        ),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kwargs, message, examples):
    kwargs.setdefault("global_batch_size", 8)
    with pytest.raises(ValueError) as info:
        tfdist.data.bucket_by_length(dataset_of(examples), **kwargs)
    assert str(info.value) == message


def test_already_batched_input_is_refused_with_the_fix(examples):
    batched = dataset_of(examples).padded_batch(4).prefetch(1)
    with pytest.raises(ValueError) as info:
        tfdist.data.bucket_by_length(batched, boundaries=[8, 16], global_batch_size=8)
    assert str(info.value) == (
        "bucket_by_length needs a dataset of single examples, and this one is already batched (by "
        ".padded_batch(...) in its pipeline): axis 0 of each element is the batch, which would be read as "
        "the sequence length and padded with rows of zeros as if they were examples. Apply "
        "bucket_by_length before .batch(...) (it batches to global_batch_size itself), or call .unbatch() "
        "first. Received: element_spec=(TensorSpec(shape=(None, None), dtype=tf.int32, name=None), "
        "TensorSpec(shape=(None,), dtype=tf.int32, name=None))"
    )


@pytest.mark.parametrize(
    "pipeline, refused_by",
    [
        (lambda ds: ds.batch(1), "batch"),
        (lambda ds: ds.padded_batch(2, drop_remainder=True).repeat().shuffle(4), "padded_batch"),
        (lambda ds: ds.padded_batch(2).map(lambda x, y: (x, y)), "padded_batch"),
        (lambda ds: tfdist.data.bucket_by_length(ds, boundaries=[64], global_batch_size=2), "group_by_window"),
        (lambda ds: ds.padded_batch(2).unbatch(), None),
        (lambda ds: ds.padded_batch(2).map(lambda x, y: (x[0], y[0])), None),
        # Single examples whose components all share axis 0, as a batch's do.
        (lambda ds: ds.map(lambda x, y: {"ids": x, "mask": tf.ones_like(x)}), None),
    ],
    ids=["batch", "padded_batch-repeat-shuffle", "batch-map", "bucketed-twice", "unbatched", "batch-index",
         "ids-and-mask"],
)
def test_batched_input_is_told_from_single_examples(pipeline, refused_by, examples):
    dataset = pipeline(dataset_of(examples[:40]))
    if refused_by is None:
        batches = tfdist.data.bucket_by_length(dataset, boundaries=[256], global_batch_size=4)
        first = tf.nest.flatten(next(iter(batches)))[0]
        assert first.shape == (4, 256)
    else:
        with pytest.raises(ValueError, match=rf"already batched \(by \.{refused_by}\(\.\.\.\) in its pipeline\)"):
            tfdist.data.bucket_by_length(dataset, boundaries=[256], global_batch_size=4)


def test_replica_count_comes_from_the_strategy_scope(examples):
    with strategy_for("mirrored", 4).scope():
        with pytest.raises(ValueError, match="must divide evenly across the 4 replicas"):
            tfdist.data.bucket_by_length(dataset_of(examples), boundaries=[8], global_batch_size=6)


def build_classifier():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_fit_under_strategy_gives_every_replica_the_same_bucket(name, examples):
    replicas = 4
    strategy = strategy_for(name, replicas)
    boundaries = [16, 32, 64, 128]
    with strategy.scope():
        model = build_classifier()
        batches = tfdist.data.bucket_by_length(dataset_of(examples), boundaries=boundaries, global_batch_size=16)
    steps = 0
    for x, _ in strategy.experimental_distribute_dataset(batches):
        shapes = {tuple(v.shape) for v in strategy.experimental_local_results(x)}
        assert len(shapes) == 1
        ((per_replica, edge),) = shapes
        assert per_replica == 4 and edge in boundaries
        steps += 1
    reference = build_classifier()
    reference.fit(batches, epochs=1, verbose=0)
    ends = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: ends.append(batch))
    model.fit(batches, epochs=1, verbose=0, callbacks=[record])
    assert ends == list(range(steps)) and steps > 5
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_xla_fit_compiles_one_program_per_bucket(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "xla_compilations.py")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TFDIST_LOCAL_DEVICES", None)
    result = subprocess.run([sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # Two epochs over 4 buckets: 4 shapes, 4 compilations (pad-to-longest would compile per batch length).
    assert report["shapes"] == [[8, 16], [8, 32], [8, 64], [8, 128]]
    assert report["compilations"] == 4


def test_a_scalar_first_component_asks_for_length_fn():
    # {"tokens": [n], "label": scalar}: tf.nest sorts the keys, so the default length read
    # axis 0 of the label and failed inside the pipeline ("slice index 0 of dimension 0 out
    # of bounds").
    examples = tf.data.Dataset.from_tensor_slices({"tokens": tf.ones([4, 3], tf.int32), "label": tf.range(4)})
    with pytest.raises(ValueError) as info:
        tfdist.data.bucket_by_length(examples, boundaries=[4], global_batch_size=2, num_replicas=1)
    assert str(info.value) == (
        "bucket_by_length reads an example's length from axis 0 of its first component in tf.nest order "
        "(a dict's keys sorted), and that component is a scalar here. Pass length_fn=, e.g. "
        "length_fn=lambda example: tf.shape(example['tokens'])[0]. "
        f"Received: element_spec={examples.element_spec}"
    )
    fixed = tfdist.data.bucket_by_length(
        examples, boundaries=[4], global_batch_size=2, num_replicas=1,
        length_fn=lambda example: tf.shape(example["tokens"])[0],
    )
    assert [tuple(b["tokens"].shape) for b in fixed] == [(2, 3), (2, 3)]  # a static length stays as it is

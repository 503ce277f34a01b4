"""The sharded-optimizer strategy (ZeRO stages 1 and 2), issue 6."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.child_processes import no_leftover_processes  # noqa: F401 (fixture)
from tests.conftest import DEVICES, build_model, max_relative_difference
from tests.strategies.parity import StopAfterFirstEpoch, own_step_model
from tfdist.sharding import FlatLayout, gather_shard
from tfdist.strategies.sharded import sharded_state
from tfdist.strategies.sharded.optimizer import unsharded_class

# Weights after 50 steps agree to float32 round-off (measured: 0.0 for stage 1,
# about 1e-7 for stage 2, where sums run in another order).
PARITY_RTOL = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sharded(n, stage=1, **options):
    return tfdist.get_strategy("sharded_optimizer", stage=stage, devices=DEVICES[n], **options)


def train(strategy, optimizer_fn, x, y, kind="sequential", epochs=1, **fit_kwargs):
    """Builds, compiles (in `strategy`'s scope, or on one device for None) and fits a model."""
    if strategy is None:
        model = build_model(kind, optimizer=optimizer_fn())
    else:
        with strategy.scope():
            model = build_model(kind, optimizer=optimizer_fn())
    model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model


def built(strategy, optimizer_fn):
    """A model compiled in `strategy`'s scope with its optimizer built, as `fit` would build it."""
    with strategy.scope():
        model = build_model(optimizer=optimizer_fn())
        model.optimizer.build(model.trainable_variables)
    return model


def canonical(model) -> list:
    """The optimizer state as a single-device optimizer lays it out."""
    state = sharded_state(model.optimizer)
    if state is not None:
        return state.canonical_values()
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


# Options -------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 4, "2", True])
def test_stage_other_than_1_2_or_3_is_refused(stage):
    with pytest.raises(ValueError) as e:
        tfdist.get_strategy("sharded_optimizer", stage=stage)
    assert str(e.value) == f"Argument 'stage' must be 1, 2 or 3. Received: stage={stage!r}"


def test_presets_build_stages_1_2_and_3():
    one = tfdist.from_config(os.path.join(REPO, "strategies", "zero1.toml"))
    two = tfdist.from_config(os.path.join(REPO, "strategies", "zero2.toml"))
    three = tfdist.from_config(os.path.join(REPO, "strategies", "zero3.toml"))
    assert isinstance(one, tfdist.strategies.ShardedOptimizerStrategy)
    assert (one.stage, two.stage, three.stage) == (1, 2, 3)
    assert one.options.bucket_bytes == 26214400
    assert one.num_replicas_in_sync == len(tf.config.list_logical_devices("CPU"))
    with pytest.raises(tfdist.PresetError, match=r"option 'stage' must be 1, 2 or 3. Received: stage=4"):
        tfdist.from_config({"strategy": "sharded_optimizer", "stage": 4})


def test_layout_slices_are_even_and_contiguous():
    layout = FlatLayout(((3, 2), (4,), (1,)), num_shards=4)
    assert (layout.total, layout.shard_size, layout.padding) == (11, 3, 1)
    assert [(p.variable, p.start, p.stop, p.offset) for p in layout.pieces(1)] == [(0, 3, 6, 0)]
    assert [(p.variable, p.start, p.stop, p.offset) for p in layout.pieces(2)] == [(1, 0, 3, 0)]
    assert [(p.variable, p.start, p.stop, p.offset) for p in layout.pieces(3)] == [(1, 3, 4, 0), (2, 0, 1, 1)]
    assert layout.segment_ids(3).numpy().tolist() == [1, 2, 3]


def test_layout_in_buckets_gives_each_replica_one_chunk_of_every_bucket():
    layout = FlatLayout(((3, 2), (4,), (1,)), num_shards=2, num_buckets=2)
    assert (layout.chunk_size, layout.shard_size, layout.padding) == (3, 6, 1)
    assert [layout.bucket_range(k) for k in range(2)] == [(0, 6), (6, 12)]
    assert layout.owned_ranges(1) == [(3, 6), (9, 12)]
    assert [(p.variable, p.start, p.stop, p.offset) for p in layout.pieces(0)] == [(0, 0, 3, 0), (1, 0, 3, 3)]
    assert [(p.variable, p.start, p.stop, p.offset) for p in layout.pieces(1)] == [
        (0, 3, 6, 0), (1, 3, 4, 3), (2, 0, 1, 4)
    ]
    assert layout.segment_ids(1).numpy().tolist() == [0, 0, 0, 1, 2, 3]
    slices = layout.to_slices_numpy(np.arange(12))
    assert slices.tolist() == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]
    assert layout.from_slices(slices.reshape(-1)).tolist() == list(range(12))
    assert layout.from_slices(tf.constant(slices.reshape(-1))).numpy().tolist() == list(range(12))
    gradient = [tf.reshape(tf.range(6.0), (3, 2)), tf.range(6.0, 10.0), tf.constant([10.0])]
    assert gather_shard(layout, gradient, 1).numpy().tolist() == [3, 4, 5, 9, 10, 0]
    # A bucket holds at most bucket_bytes: 2410 parameters, 4 replicas, 1024 B -> chunks of <= 64.
    variables = [tf.zeros((64, 32)), tf.zeros((32,)), tf.zeros((32, 10)), tf.zeros((10,))]
    layout = FlatLayout.for_variables(variables, 4, bucket_bytes=1024)
    assert (layout.num_buckets, layout.chunk_size, layout.shard_size) == (10, 61, 610)
    assert FlatLayout.for_variables(variables, 4, bucket_bytes=0).num_buckets == 1


# Parity with mirrored ----------------------------------------------------------

PARITY_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


@pytest.fixture(scope="module")
def mirrored_references(data50):
    x, y = data50
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[4])
    return {name: train(strategy, fn, x, y) for name, fn in PARITY_OPTIMIZERS.items()}


@pytest.mark.parametrize(
    "name,stage,bucket_bytes",
    # AdamW's stage 2 runs in small buckets only: the default bucketing is adam's, both stages.
    [("adam", 1, None), ("adam", 2, None), ("sgd_momentum", 2, None), ("adam", 1, 1024), ("adamw", 2, 1024)],
)
def test_weights_match_mirrored_after_50_steps(name, stage, bucket_bytes, data50, mirrored_references):
    # bucket_bytes=1024: 10 buckets of 4 chunks of 61 elements (2410 parameters).
    x, y = data50
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    model = train(sharded(4, stage, **options), PARITY_OPTIMIZERS[name], x, y)
    reference = mirrored_references[name]
    assert model.optimizer.iterations.numpy() == 50
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < PARITY_RTOL
    # The optimizer state, gathered, is the mirrored one.
    assert max_relative_difference(canonical(reference), canonical(model)) < PARITY_RTOL


@pytest.mark.parametrize(
    "optimizer_fn",
    [
        lambda: keras.optimizers.RMSprop(1e-3, momentum=0.5, centered=True),
        lambda: keras.optimizers.Adagrad(0.05),
        lambda: keras.optimizers.Nadam(1e-3),
        lambda: keras.optimizers.Lion(1e-4),
    ],
    ids=["rmsprop", "adagrad", "nadam", "lion"],
)
def test_other_optimizers_match_single_device(optimizer_fn, data10):
    x, y = data10
    reference = train(None, optimizer_fn, x, y)
    model = train(sharded(2, stage=2), optimizer_fn, x, y)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    assert max_relative_difference(canonical(reference), canonical(model)) < 1e-5


def test_weight_decay_exclusions_schedule_and_clipnorm_match_single_device(data10):
    # AdamW with bias excluded from decay (a per-element mask on each slice),
    # a learning-rate schedule read from the shared iteration count, and
    # per-variable clipnorm whose norms are summed across slices.
    x, y = data10

    def optimizer_fn():
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=3, decay_rate=0.5)
        opt = keras.optimizers.AdamW(schedule, weight_decay=0.1, clipnorm=0.05)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt

    reference = train(None, optimizer_fn, x, y)
    model = train(sharded(4, stage=2), optimizer_fn, x, y)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5


@pytest.mark.parametrize("stage", [1, 2])
def test_weight_decay_skips_a_variable_without_gradient_as_keras_does(stage, data10):
    # A branch under stop_gradient: its kernel gets no gradient, and Keras
    # leaves it as it is. The slices decayed it (SGD(weight_decay=0.1): 7.7e-2
    # relative after 8 steps, AdamW 8.0e-3), and the error spread to the loss.
    x, y = data10
    x, y = x[:256], y[:256]

    def build(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((64,))
            hidden = keras.layers.Dense(16, activation="relu")(inputs)
            hidden = hidden + keras.ops.stop_gradient(keras.layers.Dense(16, name="frozen_branch")(inputs))
            model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
            model.compile(optimizer=keras.optimizers.SGD(0.1, weight_decay=0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        initial = model.get_layer("frozen_branch").kernel.numpy()
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
        return model, initial

    reference, initial = build(tf.distribute.get_strategy())
    model, _ = build(sharded(2, stage=stage))
    np.testing.assert_array_equal(model.get_layer("frozen_branch").kernel.numpy(), initial)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5


def test_global_clipnorm_uses_the_norm_of_the_whole_gradient(data10):
    # Clipping each slice by its own norm would end far from one device.
    x, y = data10
    optimizer_fn = lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05)  # noqa: E731
    reference = train(None, optimizer_fn, x, y)
    model = train(sharded(2, stage=1), optimizer_fn, x, y)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5


def test_ema_with_overwrite_and_final_average_matches_single_device(data10):
    x, y = data10
    optimizer_fn = lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=4)  # noqa: E731
    reference = train(None, optimizer_fn, x, y)
    model = train(sharded(2, stage=2), optimizer_fn, x, y)
    # fit ends with finalize_variable_values: the weights are the averages.
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5


def test_set_weights_between_fits_is_where_training_resumes(data10):
    x, y = data10
    reference = train(None, lambda: keras.optimizers.SGD(0.1), x, y)
    model = train(sharded(2), lambda: keras.optimizers.SGD(0.1), x, y)
    start = [w * 0.5 for w in reference.get_weights()]
    reference.set_weights(start)
    model.set_weights(start)
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5


def test_steps_per_execution_and_accumulation_compose_with_the_sharded_path(data10):
    # Accumulating 2 micro-batches of 32 is one step of 64 on one device.
    x, y = data10
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    reference = build_model(optimizer=adam())
    reference.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    with sharded(2, stage=2, accumulation_steps=2).scope():
        model = build_model(optimizer=adam(), steps_per_execution=3)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert model.optimizer.iterations.numpy() == 5
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    assert model.evaluate(x, y, verbose=0) == pytest.approx(reference.evaluate(x, y, verbose=0), rel=1e-5)


_EMBEDDING_OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.5),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.05, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    "adamax": lambda: keras.optimizers.Adamax(0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "nadam": lambda: keras.optimizers.Nadam(0.05),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.5, l1_regularization_strength=0.01),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.05, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.05),
    "adam_clipvalue": lambda: keras.optimizers.Adam(0.05, clipvalue=0.002),
}


@pytest.fixture(scope="module")
def tokens():
    # Token ids repeat within and across examples: every batch looks some
    # embedding rows up several times, so the sparse gradient has duplicates.
    rng = np.random.default_rng(3)
    x = rng.integers(0, 30, size=(96, 6)).astype("int32")
    return x, (x.sum(axis=1) % 2).astype("int32")


def _embedding_model(optimizer):
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [keras.Input((6,), dtype="int32"), keras.layers.Embedding(30, 8),
         keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)]
    )
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# Each optimizer under one stage (alternating): the stages differ only in how
# the rows reach the slice (all-reduce vs all-gather beside a reduce-scatter),
# and both are covered by several optimizers.
@pytest.mark.parametrize(
    "name,stage", [(name, 1 + i % 2) for i, name in enumerate(sorted(_EMBEDDING_OPTIMIZERS))]
)
def test_embedding_rows_update_as_the_optimizer_does_on_one_device(name, stage, tokens):
    # On one device Keras applies the optimizer's element-wise maths to each
    # looked-up row before duplicate rows are summed (Adam's second moment of
    # a row seen twice is the sum of two squares). The sharded slice keeps the
    # rows apart (`sharding.gather_shard_slices`); densified first, Adam ended
    # 0.06 away after 3 steps here; clipped, up to 0.77. 3 replicas: slices
    # cut rows of the table.
    x, y = tokens
    reference = _embedding_model(_EMBEDDING_OPTIMIZERS[name]())
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    with sharded(3, stage=stage).scope():
        model = _embedding_model(_EMBEDDING_OPTIMIZERS[name]())
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    assert max_relative_difference(canonical(reference), canonical(model)) < 1e-5


@pytest.mark.parametrize("name,stage", [("adam", 2), ("adam_clipnorm", 2)])
def test_embedding_rows_update_as_on_one_device_in_small_buckets(name, stage, tokens):
    # 258 parameters, 3 replicas, 256-byte buckets: 5 buckets of 3 chunks of
    # 18, so rows, variables and clipping segments cross buckets and slices.
    x, y = tokens
    reference = _embedding_model(_EMBEDDING_OPTIMIZERS[name]())
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    with sharded(3, stage=stage, bucket_bytes=256).scope():
        model = _embedding_model(_EMBEDDING_OPTIMIZERS[name]())
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    layout = sharded_state(model.optimizer).layout
    assert (layout.num_buckets, layout.chunk_size) == (5, 18)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    assert max_relative_difference(canonical(reference), canonical(model)) < 1e-5


# Optimizers that update whole variables -------------------------------------------


@pytest.mark.parametrize(
    "optimizer_fn",
    [lambda: keras.optimizers.Lamb(1e-2), lambda: keras.optimizers.Adafactor(0.05)],
    ids=["lamb", "adafactor"],
)
def test_whole_tensor_optimizers_keep_each_variables_state_on_its_owner_only(optimizer_fn, data10):
    # Lamb's trust ratio and Adafactor's factored moments need whole variables:
    # each variable is owned by one replica (balanced by size), which keeps its
    # optimizer state; the other replicas' copies of that state hold nothing.
    from tfdist.strategies.sharded import OwnedState

    x, y = data10
    reference = train(None, optimizer_fn, x, y)
    mirrored = train(tfdist.get_strategy("mirrored", devices=DEVICES[2]), optimizer_fn, x, y)
    for stage in (1, 2):
        model = train(sharded(2, stage=stage), optimizer_fn, x, y)
        state = sharded_state(model.optimizer)
        assert isinstance(state, OwnedState)
        assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
        assert max_relative_difference(canonical(reference), canonical(model)) < 1e-5
        # The 64 x 32 kernel (2048 elements) on replica 0, the rest (362) on replica 1.
        assert state.owners == [0, 1, 1, 1]
        split = tfdist.memory_report(model)
        devices = sorted(split)
        per_variable = sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables if id(v) in state.state_owner)
        shared = tfdist.memory_report(mirrored)[devices[0]]["optimizer_state"] - per_variable
        held = [split[d]["optimizer_state"] - shared for d in devices]
        # Between them the replicas hold one device's per-variable state, once; replica 0 the kernel's.
        assert sum(held) == per_variable and held[0] > held[1] > 0, held


# Memory ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_adam_state_per_replica_is_one_nth_of_mirrored(n):
    models = []
    for strategy in (tfdist.get_strategy("mirrored", devices=DEVICES[n]), sharded(n, stage=2)):
        with strategy.scope():
            model = build_model(optimizer=keras.optimizers.Adam())
            model.optimizer.build(model.trainable_variables)  # as fit does
        models.append(model)
    mirrored, model = models
    full = tfdist.memory_report(mirrored)
    split = tfdist.memory_report(model)
    layout = sharded_state(model.optimizer).layout
    scalars = 8 + 4  # iteration (int64) and learning rate (float32), on every replica
    assert sorted(split) == sorted(full) and len(split) == n
    for device in split:
        assert full[device]["optimizer_state"] == 2 * 4 * layout.total + scalars
        # Two float32 slots of S = ceil(P / N) elements each.
        assert split[device]["optimizer_state"] == 2 * 4 * layout.shard_size + scalars
        padding = 2 * 4 * layout.padding
        assert split[device]["optimizer_state"] - scalars <= (full[device]["optimizer_state"] - scalars) / n + padding
        assert split[device]["weights"] == full[device]["weights"]
        # No float32 copy of the slice: the update reads it from the float32 weights.
        assert split[device]["parameter_shard"] == 0
    assert layout.total == 64 * 32 + 32 + 32 * 10 + 10


_PEAK_CHILD = textwrap.dedent(
    """
    import json, sys
    import tfdist
    tfdist.configure_local_devices(4)
    import keras, numpy as np, tensorflow as tf
    name, stage, optimizer = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    strategy = tfdist.get_strategy(name, **({"stage": stage} if stage else {}))
    x = np.random.default_rng(0).standard_normal((128, 64)).astype("float32")
    y = (np.arange(128) % 10).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                                  keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam() if optimizer == "adam" else keras.optimizers.SGD()
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, verbose=0)
    print(json.dumps(tf.config.experimental.get_memory_info("CPU:0")["peak"]))
    """
)


def _allocator_peak(name, stage, optimizer) -> int:
    """The peak bytes of TensorFlow's CPU allocator over 2 steps, in a process of its own."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, name, str(stage), optimizer],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_stage_2_raises_the_step_peak_by_well_under_mirrored_adam_state():
    # 1.12M parameters on 4 logical CPU devices, each run in its own process.
    # TensorFlow's CPU allocator (BFC, which reports a peak) counts the live
    # tensors of all 4 devices. Above mirrored SGD (no optimizer state),
    # mirrored Adam adds 8 bytes per parameter per device (34 MiB); stage 2
    # adds its 1/4 of that plus its buffers: measured 0.35x-0.47x of
    # mirrored's growth (the executor's schedule varies between runs), ZeRO's
    # accounting 0.25x. Mirrored's growth was measured 29-36 MiB: the
    # baseline's own peak moves by a few MiB with the schedule (29.0 MiB in a
    # CI run on a loaded host), so the check that the measurement sees Adam's
    # state allows a quarter of it.
    baseline = _allocator_peak("mirrored", 0, "sgd")
    mirrored = _allocator_peak("mirrored", 0, "adam") - baseline
    stage_2 = _allocator_peak("sharded_optimizer", 2, "adam") - baseline
    assert mirrored > 0.75 * 34 * 2**20
    assert stage_2 < 0.6 * mirrored


# Checkpoints -------------------------------------------------------------------


def test_keras_file_moves_from_sharded_to_one_device_and_to_another_replica_count(tmp_path, data10):
    x, y = data10
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    model = train(sharded(4, stage=2), adam, x, y)
    path = str(tmp_path / "model.keras")
    model.save(path)
    single = keras.models.load_model(path)
    names = [v.name for v in single.optimizer.variables]
    assert len(names) == 2 + 2 * 4 and names[:2] == ["iteration", "learning_rate"]
    assert names[2].endswith("kernel_momentum") and names[3].endswith("kernel_velocity")
    assert max_relative_difference(canonical(model), canonical(single)) == 0.0
    with sharded(2, stage=1).scope():
        resharded = keras.models.load_model(path)
    assert max_relative_difference(canonical(model), canonical(resharded)) == 0.0
    # Training continues identically on one device and on 2 replicas.
    single.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    resharded.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert resharded.optimizer.iterations.numpy() == 20
    assert max_relative_difference(single.get_weights(), resharded.get_weights()) < 1e-5


def test_the_compiled_optimizer_is_a_same_named_subclass_of_the_users_class(tmp_path, data10):
    import json
    import zipfile

    x, y = data10
    made = []
    model = train(sharded(2, stage=1), lambda: made.append(keras.optimizers.Adam(1e-3)) or made[0], x[:64], y[:64])
    (optimizer,) = made
    assert model.optimizer is optimizer  # the user's reference is the compiled optimizer
    assert isinstance(optimizer, keras.optimizers.Adam) and type(optimizer) is not keras.optimizers.Adam
    assert type(optimizer).__name__ == "Adam" and unsharded_class(optimizer) is keras.optimizers.Adam
    plain = keras.optimizers.Adam(1e-3)
    assert type(plain) is keras.optimizers.Adam  # optimizers outside the strategy are untouched
    path = tmp_path / "m.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))["compile_config"]["optimizer"]
    assert (config["module"], config["class_name"], config["registered_name"]) == ("keras.optimizers", "Adam", None)
    assert type(keras.models.load_model(path).optimizer) is keras.optimizers.Adam


def test_mirrored_weights_file_loads_into_sharded_model(tmp_path, data10):
    x, y = data10
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    mirrored = train(tfdist.get_strategy("mirrored", devices=DEVICES[2]), adam, x, y)
    path = str(tmp_path / "mirrored.weights.h5")
    mirrored.save_weights(path)
    model = built(sharded(3, stage=2), adam)  # 3 replicas: uneven slices, padded
    model.load_weights(path)
    assert max_relative_difference(mirrored.get_weights(), model.get_weights()) == 0.0
    assert max_relative_difference(canonical(mirrored), canonical(model)) == 0.0


def test_tf_train_checkpoint_is_canonical_both_ways(tmp_path, data10):
    x, y = data10
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    model = train(sharded(4, stage=2), adam, x, y)
    written = tf.train.Checkpoint(model=model).write(str(tmp_path / "sharded"))
    single = train(None, adam, x[:32], y[:32])
    single_path = tf.train.Checkpoint(model=single).write(str(tmp_path / "single"))
    single_state, single_weights = canonical(single), single.get_weights()
    # Same keys and shapes as a single-device checkpoint.
    assert tf.train.list_variables(written) == tf.train.list_variables(single_path)
    tf.train.Checkpoint(model=single).read(written).assert_consumed()
    assert max_relative_difference(canonical(model), canonical(single)) == 0.0
    other = built(sharded(2, stage=1), adam)
    tf.train.Checkpoint(model=other).read(single_path).assert_consumed()
    assert other.optimizer.iterations.numpy() == 1
    assert max_relative_difference(single_state, canonical(other)) == 0.0
    assert max_relative_difference(single_weights, other.get_weights()) == 0.0


def test_model_checkpoint_and_backup_and_restore_resume_on_another_replica_count(tmp_path, data10):
    x, y = data10
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    backup = str(tmp_path / "backup")

    with sharded(4, stage=2).scope():
        model = build_model(optimizer=adam())
    checkpoint = str(tmp_path / "epoch{epoch}.keras")
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.ModelCheckpoint(checkpoint), keras.callbacks.BackupAndRestore(backup), StopAfterFirstEpoch()],
        )
    saved = keras.models.load_model(str(tmp_path / "epoch1.keras"))
    assert saved.optimizer.iterations.numpy() == 10
    assert max_relative_difference(canonical(model), canonical(saved)) == 0.0
    with sharded(2, stage=1).scope():
        resumed = build_model(optimizer=adam())
    history = resumed.fit(
        x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    assert len(history.epoch) == 1 and resumed.optimizer.iterations.numpy() == 20
    reference = train(None, adam, x, y, epochs=2)
    assert max_relative_difference(reference.get_weights(), resumed.get_weights()) < 1e-5


@pytest.mark.parametrize("stage", [1, 2])
def test_weights_of_another_optimizer_or_none_load_and_keep_the_state_as_keras_does(stage, tmp_path, data10):
    # Keras's load_weights loads the layers and skips an optimizer state of
    # another size with a warning (a file saved before training, or with
    # another optimizer). Stages 1 and 2 raised and loaded nothing.
    x, y = data10
    model = train(sharded(2, stage=stage), lambda: keras.optimizers.Adam(1e-3), x[:64], y[:64])
    state = canonical(model)
    for name, source in (
        ("sgd", train(None, lambda: keras.optimizers.SGD(0.1, momentum=0.9), x[:64], y[:64])),
        ("untrained", build_model(seed=3)),  # SGD, not built: iterations and learning rate
    ):
        path = str(tmp_path / f"{name}.weights.h5")
        source.save_weights(path)
        saved = 6 if name == "sgd" else 2
        with pytest.warns(UserWarning, match=(
            rf"Skipping variable loading for optimizer 'adam(_\d+)?', because it has 10 variables whereas "
            rf"the saved optimizer has {saved} variables."
        )):
            model.load_weights(path)
        assert max_relative_difference(source.get_weights(), model.get_weights()) == 0.0
        assert max_relative_difference(state, canonical(model)) == 0.0


@pytest.mark.parametrize("stage", [1, 2])
def test_load_weights_between_compile_and_fit_keeps_the_new_optimizer_as_keras_does(stage, tmp_path, data10):
    # Fine-tuning: compile with a new optimizer, load pretrained weights, fit.
    # On one device the optimizer is unbuilt at load_weights, and Keras keeps
    # its state with a warning; stages 1 and 2 built it at compile and took
    # the pretrained run's (learning rate 0.01, 2 iterations, its moments).
    x, y = data10
    pretrained = train(None, lambda: keras.optimizers.Adam(1e-2), x[:64], y[:64])
    path = str(tmp_path / "pretrained.weights.h5")
    pretrained.save_weights(path)
    expected = (
        "Skipping variable loading for optimizer 'adam', because it has 2 variables whereas the saved "
        "optimizer has 10 variables. "
    )

    def fine_tuned(strategy):
        with strategy.scope():
            model = build_model(seed=1, optimizer=keras.optimizers.Adam(1e-3, name="adam"))
            with pytest.warns(UserWarning) as record:
                model.load_weights(path)
        assert [str(w.message) for w in record if "optimizer" in str(w.message)] == [expected]
        assert model.optimizer.learning_rate.numpy() == np.float32(1e-3)
        assert model.optimizer.iterations.numpy() == 0
        model.fit(x[:64], y[:64], batch_size=32, shuffle=False, verbose=0)
        return model

    one, tuned = fine_tuned(tf.distribute.get_strategy()), fine_tuned(sharded(2, stage))
    assert tuned.optimizer.iterations.numpy() == 2
    assert max_relative_difference(one.get_weights(), tuned.get_weights()) < 1e-5
    assert max_relative_difference(canonical(one), canonical(tuned)) < 1e-5
    # Once Keras would have built it (fit), the file's optimizer state loads, as on one device.
    tuned.load_weights(path)
    assert tuned.optimizer.iterations.numpy() == 2 and tuned.optimizer.learning_rate.numpy() == np.float32(1e-2)
    assert max_relative_difference(canonical(pretrained), canonical(tuned)) == 0.0


def test_optimizer_state_of_another_shape_raises_and_leaves_the_model_untouched(tmp_path, data10):
    x, y = data10
    model = built(sharded(2, stage=2), lambda: keras.optimizers.Adam(1e-3))
    other = train(None, lambda: keras.optimizers.Adam(1e-3), x[:64], y[:64], kind="functional")
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    weights, state = model.get_weights(), canonical(model)
    with pytest.raises(ValueError):
        model.load_weights(path)
    assert max_relative_difference(weights, model.get_weights()) == 0.0
    assert max_relative_difference(state, canonical(model)) == 0.0


# The collective path -----------------------------------------------------------


def test_native_reduce_scatter_has_no_cpu_implementation():
    # Why stage 2 reduce-scatters with chunked all-reduces on CPU (see
    # tfdist.collectives.reduce_scatter_sum). If TensorFlow gains a CPU
    # implementation this fails, and the native op can be used.
    probe = textwrap.dedent(
        """
        import tensorflow as tf
        from tensorflow.python.ops import gen_collective_ops
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        launchers = (strategy.extended._cross_device_ops or strategy.extended._inferred_cross_device_ops)._launchers

        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            launcher = launchers[tf.get_static_value(ctx.replica_id_in_sync_group)]
            token = launcher._get_ordering_token()
            with tf.device(launcher._device):
                return gen_collective_ops.collective_reduce_scatter_v2(
                    tf.ones([4]), group_size=launcher._group_size, group_key=launcher._group_key,
                    instance_key=launcher._next_instance_key(), merge_op="Add", final_op="Id",
                    communication_hint="auto", timeout_seconds=20.0,
                    ordering_token=[token] if token is not None else [])

        try:
            tf.function(lambda: strategy.run(replica_fn))()
            print("REDUCE_SCATTER_OK")
        except Exception as e:
            print("REDUCE_SCATTER_FAILED", str(e).splitlines()[0])
        """
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert "REDUCE_SCATTER_FAILED" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "did not find collective implementation" in out.stdout


def _step_graph(stage, bucket_bytes, digits, by_layer=True, **options):
    """The traced graph of one training step of the digits model, Adam, 4 replicas.

    `by_layer=False` traces the path models that are not reduced layer by
    layer take (an Embedding, a cluster, accumulation, ...): the step's pass
    is the plain one.
    """
    from tfdist.engine import passes
    from tfdist.engine.step import TrainStep

    strategy = sharded(4, stage, bucket_bytes=bucket_bytes, **options)
    with strategy.scope():
        model = build_model(optimizer=keras.optimizers.Adam(1e-3), metrics=())
        model.optimizer.build(model.trainable_variables)
    x, y = digits
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(32))))
    step = TrainStep(model)
    assert step.layer_reductions is not None
    if not by_layer:
        step.forward_backward = passes.Plain()
    graph = tf.function(step).get_concrete_function(batch).graph
    return sharded_state(model.optimizer).layout, _operations(graph)


def _operations(graph) -> list:
    """Every op of `graph` and of the functions it calls (branches), recursively."""
    ops = list(graph.get_operations())
    for function in graph._functions.values():
        inner = getattr(function, "graph", None)
        if inner is not None:
            ops += _operations(inner)
    return ops


@pytest.mark.parametrize("stage", [1, 2])
def test_each_layers_gradients_are_reduced_before_the_layer_below_runs_its_backward_pass(stage, digits):
    # The digits model (Dense 64->32, Dense 32->10) on 4 replicas, 1024-byte
    # buckets: each layer's gradients (8320 and 1320 bytes) are a group of
    # their own, each variable larger than a bucket sent alone. The last
    # layer's reductions come first, and the first layer's weight gradient
    # (its MatMul, 64 x 32) is computed only after them: at most one layer's
    # local gradients exist at a time.
    _, ops = _step_graph(stage, 1024, digits)
    reduces = [op for op in ops if op.type == "CollectiveReduceV2"]
    # Per replica: 4 variables alone, and the batch size.
    assert sorted(op.inputs[0].shape.num_elements() for op in reduces) == sorted([2048, 32, 320, 10, 1] * 4)
    last_layer = {op.name for op in reduces if op.inputs[0].shape.num_elements() in (320, 10)}
    first_kernel_grads = [
        op for op in ops if op.type == "MatMul" and "gradient_tape" in op.name
        and op.outputs[0].shape.as_list() == [64, 32]
    ]
    assert len(first_kernel_grads) == 4
    for op in first_kernel_grads:
        assert last_layer & {a.name for a in _all_ancestors(op)}
    first_layer = {op.name for op in reduces if op.inputs[0].shape.num_elements() in (2048, 32)}
    assert not any(first_layer & {a.name for a in _all_ancestors(op)} for op in first_kernel_grads)


def _all_ancestors(op) -> list:
    """Every op `op` waits for, through data and control inputs."""
    seen, frontier = {}, [op]
    while frontier:
        o = frontier.pop()
        for parent in [t.op for t in o.inputs] + list(o.control_inputs):
            if parent.name not in seen:
                seen[parent.name] = parent
                frontier.append(parent)
    return list(seen.values())


@pytest.mark.parametrize("stage", [1, 2])
def test_step_gathers_bucket_by_bucket_with_no_whole_parameter_temporary(stage, digits):
    # 2410 parameters, 4 replicas, 1024-byte buckets: 10 buckets of 4 chunks
    # of 61. Each bucket is all-gathered alone (N * C = 244 elements) and
    # written into the variables it covers; no tensor of the step holds
    # every parameter (the former end-of-step all-gather made 2412).
    layout, ops = _step_graph(stage, 1024, digits, by_layer=False)
    assert (layout.total, layout.num_buckets, layout.chunk_size) == (2410, 10, 61)
    # TensorFlow gathers each value's shape (int32) before the value itself.
    gathers = [op for op in ops if op.type == "CollectiveGatherV2" and op.outputs[0].dtype == tf.float32]
    assert len(gathers) == 4 * 10
    # What each replica sends: its 61-element chunk of the bucket (formerly its whole 603-element slice).
    assert {_static_source(op.inputs[0]).shape.num_elements() for op in gathers} == {61}
    largest = max(
        op_output.shape.num_elements() for op in ops for op_output in op.outputs
        if op_output.shape.is_fully_defined()
    )
    assert largest == 64 * 32  # the first kernel (and its gradient), not 2410
    # A variable spanning buckets (the first kernel, 64 x 32: elements 0-2047,
    # buckets 0-8) gets each bucket's part written into its own buffer: its
    # whole rows by one ResourceScatterUpdate per part, a row the part covers
    # in part read, updated and written back (32 elements); then it leaves
    # copy-on-read mode. No copy of it, and no concatenation of its parts.
    width = layout.num_shards * layout.chunk_size
    spanning = [i for i, (o, n) in enumerate(zip(layout.offsets, layout.sizes)) if o // width != (o + n - 1) // width]
    assert spanning[0] == 0
    assert not [op for op in ops if op.type in ("TensorStridedSliceUpdate", "ConcatV2", "Pad")
                and op.outputs[0].shape.num_elements() == 64 * 32]
    assert max(op.outputs[0].shape.num_elements() for op in ops if op.type == "TensorStridedSliceUpdate") == 32
    # 7 of the 8 bucket boundaries inside it cut a row (244 k is a multiple of 32 for k = 8 only):
    # 57 whole rows and 7 rows written in two parts, per replica.
    rows = [op for op in ops if op.type == "ResourceScatterUpdate" and op.inputs[2].shape[1:] == (32,)]
    assert sum(op.inputs[2].shape[0] for op in rows) == 4 * 57
    assert len([op for op in ops if op.type == "ResourceScatterUpdate" and op.inputs[2].shape == (32,)]) == 4 * 14
    assert len([op for op in ops if op.type == "DisableCopyOnRead"]) == 4 * len(spanning)
    reduces = [op for op in ops if op.type == "CollectiveReduceV2"]
    if stage == 2:
        # One all-reduce per bucket (a reduce-scatter on CPU), plus the batch size.
        assert len(reduces) == 4 * (10 + 1)
        assert sorted({op.inputs[0].shape.num_elements() for op in reduces}) == [1, 244]
    else:
        # Stage 1 all-reduces the gradients in the engine's buckets (backprop
        # order): a variable larger than a bucket goes alone.
        assert max(op.inputs[0].shape.num_elements() for op in reduces) == 64 * 32


def test_stage_2_reduces_each_bucket_after_the_previous_one(digits):
    # At most two buckets alive: each bucket's input waits on the previous
    # bucket's reduced chunk (a control input), last bucket first.
    _, ops = _step_graph(2, 1024, digits, by_layer=False)
    reduces = [op for op in ops if op.type == "CollectiveReduceV2" and op.inputs[0].shape.num_elements() == 244]
    waiting = [op for op in reduces if any(c.type == "GatherV2" for c in _control_ancestors(op, depth=5))]
    assert len(reduces) == 40 and len(waiting) == 4 * 9


@pytest.mark.parametrize("stage", [1, 2])
def test_the_update_runs_chunk_by_chunk_on_variables_of_one_chunk(stage, digits):
    # 2410 parameters, 4 replicas, 1024-byte buckets: 10 chunks of 61 per
    # replica. The optimizer is built on one variable per chunk, so each slot
    # is a variable of 61 elements per replica; Adam's own update_step runs
    # on each replica's copy of each chunk variable, filled with its chunk of
    # the weights, and writes its m and v in place: no update tensor is larger
    # than one chunk (formerly the 610-element slice: g - m, sqrt(v), ...).
    layout, ops = _step_graph(stage, 1024, digits)
    assert (layout.num_buckets, layout.chunk_size, layout.shard_size) == (10, 61, 610)
    writes = [op for op in ops if op.type == "AssignAddVariableOp" and re.search(r"(^|/)adam(_\d+)?/", op.name)]
    assert {tuple(op.inputs[1].shape) for op in writes} == {(61,)}
    assert len(writes) == 4 * 10 * 2  # replicas x chunks x (m, v)
    # The optimizer's ops (name scope "adam", "adam_1", ...).
    update = [op for op in ops if re.search(r"(^|/)adam(_\d+)?/", op.name)]
    assert not [op for op in update if op.inputs and op.inputs[0].dtype == tf.resource
                and _resource_elements(op) == layout.shard_size]
    # What it computes (reading a weight, or reshaping it, makes no buffer).
    sizes = {t.shape.num_elements() for op in update for t in op.outputs
             if t.dtype == tf.float32 and t.shape.is_fully_defined() and op.type not in ("ReadVariableOp", "Reshape")}
    assert max(sizes) == 61
    # Each chunk variable is filled with its chunk of the weights, after the previous chunk's update.
    # (Keras's Adam itself only adds to and subtracts from its variables.)
    fills = [op for op in ops if op.type == "AssignVariableOp" and op.inputs[1].shape == (61,)]
    assert len(fills) == 4 * 10
    waiting = [op for op in fills if any(a.type == "AssignAddVariableOp" for a in _all_ancestors(op))]
    assert len(waiting) == 4 * 9


def _resource_elements(op) -> int | None:
    """Elements of the variable a resource op reads or writes, where its handle says (else None)."""
    data = op.inputs[0]._handle_data if hasattr(op.inputs[0], "_handle_data") else None
    shapes = getattr(data, "shape_and_type", None) or []
    if not shapes:
        return None
    return int(np.prod([d.size for d in shapes[0].shape.dim]))


def test_chunk_by_chunk_updates_match_one_device(data10):
    # The same steps updated chunk by chunk (10 chunks of 61 elements per
    # replica), each chunk a variable of its own: optimizers with Python
    # arithmetic on their slots (Adadelta), with reads of a slot before its
    # update and uses after (ScheduleFreeAdamW takes `momentum.value` first),
    # decoupled weight decay, Nadam's per-step state, centered RMSprop.
    x, y = data10
    optimizers = {
        "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05),
        "nadam": lambda: keras.optimizers.Nadam(1e-3),
        "rmsprop": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.5, centered=True),
        "schedule_free_adamw": lambda: keras.optimizers.ScheduleFreeAdamW(1e-3),
        "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    }
    for name, fn in optimizers.items():
        chunked = train(sharded(4, 2, bucket_bytes=1024), fn, x, y)
        assert sharded_state(chunked.optimizer).layout.num_buckets == 10, name
        if name == "schedule_free_adamw":
            # Keras's own update under a stock strategy (its momentum starts at the weights there, as here).
            reference = train(tf.distribute.MirroredStrategy(
                DEVICES[4], cross_device_ops=tf.distribute.ReductionToOneDevice()), fn, x, y)
        else:
            reference = train(None, fn, x, y)
        assert max_relative_difference(reference.get_weights(), chunked.get_weights()) < 1e-5, name
        assert max_relative_difference(canonical(reference), canonical(chunked)) < 1e-5, name


def test_a_gradient_larger_than_a_piece_is_reduced_piece_after_piece(digits):
    # With shard_bucket_bytes=2048, the first kernel's gradient (64 x 32,
    # 8192 bytes) is summed in 4 pieces of 512 elements, each once this
    # replica has kept its share of the previous one; the other gradients
    # (small) go as before. The collective's buffers are one piece's size.
    _, ops = _step_graph(2, 1024, digits, shard_bucket_bytes=2048)
    reduces = [op for op in ops if op.type == "CollectiveReduceV2"]
    assert sorted(op.inputs[0].shape.num_elements() for op in reduces) == sorted([512] * 4 * 4 + [32, 320, 10, 1] * 4)
    pieces = [op for op in reduces if op.inputs[0].shape.num_elements() == 512]
    after_previous = [op for op in pieces if sum(a.type == "CollectiveReduceV2" and a.inputs[0].shape.num_elements()
                                                 == 512 for a in _all_ancestors(op))]
    assert len(after_previous) == 4 * 3


def test_the_layout_cuts_a_large_model_into_small_buckets():
    # 2.17M parameters (8.3 MiB), 2 replicas, the default 25 MiB bucket_bytes:
    # the layout's buckets are at most shard_bucket_bytes (default 2 MiB),
    # the unit of the update and of the all-gather. shard_bucket_bytes=0
    # leaves bucket_bytes to decide (one bucket here), and bucket_bytes=0
    # keeps one bucket whatever shard_bucket_bytes is.
    from tfdist.strategies.sharded_optimizer import LAYOUT_BUCKET_BYTES

    layouts = []
    for options in ({}, {"shard_bucket_bytes": 4 << 20}, {"shard_bucket_bytes": 0}, {"bucket_bytes": 0}):
        with sharded(2, 2, **options).scope():
            model = keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(1024) for _ in range(3)]
                                     + [keras.layers.Dense(10)])
            model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
            model.optimizer.build(model.trainable_variables)
        layouts.append(sharded_state(model.optimizer).layout)
    assert LAYOUT_BUCKET_BYTES == 2 * 2**20
    assert layouts[0].total == 2_176_010
    assert [layout.num_buckets for layout in layouts] == [5, 3, 1, 1]
    assert layouts[0].num_shards * layouts[0].chunk_size * 4 <= LAYOUT_BUCKET_BYTES
    # Chunks from 4096 elements up are whole multiples of 64 bytes (sliced without a copy):
    # 1,088,005 per replica rounded up.
    assert [layout.chunk_size for layout in layouts] == [217_616, 362_672, 1_088_016, 1_088_016]
    assert layouts[2].shard_size == 1_088_016
    with pytest.raises(tfdist.options.OptionError, match=re.escape(
        "option 'shard_bucket_bytes' must be an integer >= 0 (bytes per bucket of the sharded update; 0: the "
        "step's bucket_bytes). Received: shard_bucket_bytes=-1"
    )):
        sharded(2, 2, shard_bucket_bytes=-1)


def _aligned_chunk_model(kind: str):
    keras.utils.set_random_seed(0)
    if kind == "dense":  # 17,610 parameters: chunked update
        layers = [keras.Input((64,)), keras.layers.Dense(100, activation="relu"),
                  keras.layers.Dense(100, activation="relu"), keras.layers.Dense(10)]
    else:  # 17,738 parameters, sparse embedding rows: whole-slice update
        layers = [keras.Input((8,), dtype="int32"), keras.layers.Embedding(1000, 16),
                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(64, activation="relu"),
                  keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("kind,chunk", [("dense", 4416), ("embedding", 4448)])
def test_aligned_chunks_train_like_one_device(kind, chunk, digits):
    # Chunks of 4096+ elements are rounded up to whole multiples of 64 bytes
    # (17,610 / 4 -> 4403 -> 4416; 17,738 / 4 -> 4435 -> 4448), so the slices
    # carry more padding than the replicas' even split needs; weights and the
    # canonical Adam state still match one device.
    x, y = digits
    if kind == "embedding":
        x = np.random.default_rng(0).integers(0, 1000, (len(y), 8)).astype("int32")
    x, y = x[:256], y[:256]
    reference = _aligned_chunk_model(kind)
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    with sharded(2, 2, shard_bucket_bytes=40_000).scope():
        model = _aligned_chunk_model(kind)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    layout = sharded_state(model.optimizer).layout
    assert (layout.num_buckets, layout.chunk_size) == (2, chunk)
    assert layout.chunk_size % 16 == 0
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    assert max_relative_difference(canonical(reference), canonical(model)) < 1e-5


_STEP_PEAK_CHILD = textwrap.dedent(
    """
    import json, sys
    import tfdist
    stage = int(sys.argv[1])
    tfdist.configure_local_devices(2)
    import keras, numpy as np, tensorflow as tf
    x = np.random.default_rng(0).standard_normal((128, 64)).astype("float32")
    y = (np.arange(128) % 10).astype("int32")
    strategy = tfdist.get_strategy("sharded_optimizer", stage=stage) if stage else tfdist.get_strategy("mirrored")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(1024, activation="relu")
                                 for _ in range(3)] + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, verbose=0)
    print(json.dumps(tf.config.experimental.get_memory_info("CPU:0")["peak"]))
    """
)


@pytest.mark.slow
def test_stage_2_peaks_well_under_mirrored_at_two_replicas():
    # A 3 x 1024 MLP (2.17M parameters, 8.3 MiB) with Adam on 2 logical CPU
    # devices, TensorFlow's allocator peak (all devices) in a process of its
    # own. Stage 2 against mirrored: 0.89-0.93 when the update ran on the whole
    # slice (its temporaries several slices) and a variable's gradient was
    # summed whole; 0.74-0.80 with the update chunk by chunk, 1 MiB layout
    # buckets and gradients summed in 1 MiB pieces (0.80 and above only on a
    # loaded host: the lower of two runs is taken). Stage 1 gains less here
    # (0.85 before, 0.74-0.83 after): too close to assert. Mirrored's own peak
    # varies by 10% from run to run (83-95 MiB; stage 2's 68-73), so it is the
    # median of three runs (one run once read 83 MiB, and 0.86).
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)

    def peak(stage):
        out = subprocess.run([sys.executable, "-c", _STEP_PEAK_CHILD, str(stage)], capture_output=True, text=True,
                             timeout=240, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return int(out.stdout.strip().splitlines()[-1])

    mirrored = sorted(peak(0) for _ in range(3))[1]
    assert min(peak(2), peak(2)) < 0.85 * mirrored


def _static_source(tensor):
    """The nearest tensor of fully known shape that `tensor` is computed from (first inputs)."""
    while not tensor.shape.is_fully_defined():
        tensor = tensor.op.inputs[0]
    return tensor


def _control_ancestors(op, depth):
    """Ops reached from `op` by following data inputs down to `depth`, then one control input."""
    found, frontier = [], [op]
    for _ in range(depth):
        frontier = [t.op for o in frontier for t in o.inputs]
        found += [c for o in frontier for c in o.control_inputs]
    return found


# Across workers ---------------------------------------------------------------

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_optimizer_job.py")
JOB_TIMEOUT_S = 240  # generous: two cores shared with the rest of the suite


def test_tf_config_with_several_workers_selects_the_multi_worker_variant_and_validates(monkeypatch):
    from tfdist.cluster import ClusterConfigError
    from tfdist.strategies.sharded_optimizer import _runs_across_workers

    workers = '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": %d}}'
    monkeypatch.setenv("TF_CONFIG", workers % 0)
    assert _runs_across_workers({}) is True
    with pytest.raises(ValueError, match=(
        r"The 'sharded_optimizer' strategy takes 'devices' on one host only; across workers use "
        r"'devices_per_worker'. Received: devices=\['/cpu:0'\] with a cluster of several workers"
    )):
        tfdist.get_strategy("sharded_optimizer", devices=["/cpu:0"])
    with pytest.raises(ValueError, match=r"Argument 'stage' must be 1, 2 or 3. Received: stage=4"):
        tfdist.get_strategy("sharded_optimizer", stage=4)
    with pytest.raises(ValueError, match=r"runs stage=3 on the devices of one host; across the workers"):
        tfdist.get_strategy("sharded_optimizer", stage=3)
    monkeypatch.setenv("TF_CONFIG", workers % 5)
    with pytest.raises(ClusterConfigError, match=(
        r"TF_CONFIG: field 'task.index' is out of range: job 'worker' has 2 task\(s\), so the index "
        r"must be 0..1. Received: task.index=5"
    )):
        tfdist.get_strategy("sharded_optimizer")
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}')
    assert _runs_across_workers({}) is False  # one worker: this host's devices, as before
    monkeypatch.delenv("TF_CONFIG")
    assert _runs_across_workers({}) is False
    assert _runs_across_workers({"cluster_resolver": object()}) is True
    # `hierarchical` only says how a job of several workers sums: on one host it is moot.
    assert _runs_across_workers({"hierarchical": False}) is False
    one_host = tfdist.get_strategy("sharded_optimizer", stage=1, hierarchical=False, devices=DEVICES[2])
    assert type(one_host).__name__ == "ShardedOptimizerStrategy"


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_two_workers_train_stages_1_and_2_like_one_process_and_save_the_full_state(tmp_path):
    from tests.strategies import sharded_optimizer_job as job
    from tfdist.launch import run_job

    # TMPDIR: the non-chief's temporary write directories land in tmp_path.
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    for stage in (1, 2):  # one job per stage: one multi-worker strategy per process
        command = [sys.executable, JOB, "--out", str(tmp_path), "--stage", str(stage)]
        assert run_job(command, workers=2, env=env, timeout=JOB_TIMEOUT_S) == 0
    x, y = job.data()
    infos = [
        {**json.load(open(tmp_path / f"worker{i}_stage1.json")), **json.load(open(tmp_path / f"worker{i}_stage2.json"))}
        for i in (0, 1)
    ]
    # Mirrored over 2 replicas: every device holds Adam's full state.
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        mirrored = job.build()
        mirrored.optimizer.build(mirrored.trainable_variables)
    mirrored_state = {d: r["optimizer_state"] for d, r in tfdist.memory_report(mirrored).items()}
    scalars = 8 + 4  # iteration (int64) and learning rate (float32)
    params = 64 * 32 + 32 + 32 * 10 + 10
    assert set(mirrored_state.values()) == {2 * 4 * params + scalars}

    for stage in (1, 2):
        chief, other = (info[f"stage{stage}"] for info in infos)
        assert chief["class"] == other["class"] == "MultiWorkerShardedOptimizerStrategy"
        assert chief["is_sharded"] and other["is_sharded"]
        assert (chief["is_chief"], other["is_chief"]) == (True, False)
        assert chief["replicas"] == other["replicas"] == 2
        assert chief["iterations"] == other["iterations"] == job.STEPS
        # Each worker's one device keeps Adam's state for half of the parameters.
        for info in (chief, other):
            (device_report,) = info["memory"].values()
            assert info["shard_size"] == params // 2
            assert device_report["optimizer_state"] == 2 * 4 * (params // 2) + scalars
            assert 2 * (device_report["optimizer_state"] - scalars) == mirrored_state["/device:CPU:0"] - scalars
        w = [np.load(tmp_path / f"worker{i}_stage{stage}.npz") for i in (0, 1)]
        for key in w[0].files:
            np.testing.assert_array_equal(w[0][key], w[1][key])
        weights = [w[0][f"w_{i}"] for i in range(4)]
        state = [w[0][f"opt_{i}"] for i in range(2 + 2 * 4)]

        # The same run in this process: 2 local replicas, same global batch and data.
        with sharded(2, stage=stage).scope():
            reference = job.build()
        history = reference.fit(x, y, batch_size=job.BATCH, epochs=1, shuffle=False, verbose=0)
        assert max_relative_difference(reference.get_weights(), weights) < 1e-5
        np.testing.assert_allclose(chief["loss"], history.history["loss"], rtol=1e-5)
        # One step's collectives: the gradients' one bucket with the total weight and the loss
        # metric's state (stage 1), or the reduce-scatter's bucket (an all-reduce on CPU) and
        # one all-reduce of the weight and the metric state (stage 2); the all-gather of the
        # updated slices, one collective (TensorFlow's all_gather would first gather their
        # lengths); TensorFlow's agreement on whether every worker has a batch left. Keras's
        # read of the loss would add 2.
        reduces = {1: 2, 2: 3}[stage]
        assert chief["collectives"] == {"CollectiveReduceV2": reduces, "CollectiveGatherV2": 1}
        assert max_relative_difference(canonical(reference), state) < 1e-5

        # The chief's files hold the full state and load on one device.
        single = keras.models.load_model(tmp_path / f"stage{stage}.keras")
        assert int(single.optimizer.iterations.numpy()) == job.STEPS
        assert max_relative_difference(weights, single.get_weights()) == 0.0
        assert max_relative_difference(state, canonical(single)) == 0.0
        assert max_relative_difference(canonical(reference), canonical(single)) < 1e-5
        restored = job.build()
        restored.optimizer.build(restored.trainable_variables)
        tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
            str(tmp_path / f"ckpt_stage{stage}")).assert_consumed()
        assert max_relative_difference(weights, restored.get_weights()) == 0.0
        assert max_relative_difference(state, canonical(restored)) == 0.0
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tfdist_")]  # non-chief temp dirs removed


# Custom train_step and custom training loops ------------------------------------




@pytest.mark.parametrize("stage", [1, 2])
def test_custom_train_step_gets_the_sharded_update(stage, data10):
    x, y = data10
    reference = own_step_model()
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    # 4 replicas share the batch of 32 evenly: Keras's compute_loss divides each
    # replica's mean loss by the replica count, which is the global mean only then.
    with sharded(4, stage=stage).scope():
        model = own_step_model()
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    assert max_relative_difference(canonical(reference), canonical(model)) < 1e-5
    # The optimizer holds slots for one flat slice per replica, not per model variable.
    assert model.optimizer.variables[-1].shape == (sharded_state(model.optimizer).layout.chunk_size,)


def test_custom_training_loop_over_a_compiled_model_is_sharded(data10):
    x, y = data10
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    def run(strategy):
        with strategy.scope():
            model = build_model(optimizer=keras.optimizers.Adam(0.01))
            model.optimizer.build(model.trainable_variables)
        dist = strategy.experimental_distribute_dataset(batches)

        @tf.function
        def step(batch):
            def replica_fn(batch):
                xb, yb = batch
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=32)
                model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

            strategy.run(replica_fn, args=(batch,))

        for batch in dist:
            step(batch)
        return model

    reference = run(tf.distribute.get_strategy())
    model = run(sharded(2, stage=2))
    assert sharded_state(model.optimizer) is not None
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-5
    assert max_relative_difference(canonical(reference), canonical(model)) < 1e-5


def test_optimizer_apply_in_cross_replica_context_is_refused(data10):
    with sharded(2).scope():
        model = build_model(optimizer=keras.optimizers.Adam(0.01))
        model.optimizer.build(model.trainable_variables)
        grads = [tf.zeros_like(v) for v in model.trainable_variables]
        with pytest.raises(RuntimeError, match=r"call optimizer.apply\(\.\.\.\) inside strategy.run"):
            model.optimizer.apply(grads, model.trainable_variables)


@pytest.mark.parametrize("stage", [1, 2])
def test_one_replica_has_nothing_to_shard_and_trains_as_mirrored(stage, digits):
    # One replica: the optimizer stays Keras's own (full state on the one
    # device, no flat slice, no chunked update) and the step is mirrored's, so
    # a script written for N devices runs at plain-Keras speed on one; its
    # checkpoint has the single-device layout the sharded optimizer saves.
    x, y = digits
    models = {}
    for name, options in (("mirrored", {}), ("sharded_optimizer", {"stage": stage})):
        strategy = tfdist.get_strategy(name, devices=DEVICES[1], **options)
        with strategy.scope():
            model = build_model(optimizer=keras.optimizers.Adam(0.01))
        model.fit(x[:320], y[:320], batch_size=32, epochs=2, shuffle=False, verbose=0)
        models[name] = model
    sharded = models["sharded_optimizer"]
    assert sharded_state(sharded.optimizer) is None
    assert sharded.distribute_strategy.gradient_path.name == "all_reduce"
    assert [tuple(v.shape) for v in sharded.optimizer.variables] == [
        tuple(v.shape) for v in models["mirrored"].optimizer.variables
    ]
    for a, b in zip(models["mirrored"].get_weights(), sharded.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Two replicas still shard.
    with tfdist.get_strategy("sharded_optimizer", devices=DEVICES[2], stage=stage).scope():
        two = build_model(optimizer=keras.optimizers.Adam(0.01))
    assert sharded_state(two.optimizer) is not None


@pytest.mark.parametrize("shape", [(37,), (6, 7), (3, 4, 5), (1, 40)])
@pytest.mark.parametrize("cut", [(0, 40), (5, 9), (7, 21), (12, 30), (14, 28), (0, 7)])
def test_write_in_place_writes_exactly_its_range_without_reading_the_variable_whole(shape, cut):
    # A spanning variable's part of a gathered bucket is written into the
    # variable's own buffer: whole rows by one scatter, a row covered in part
    # read, updated and written back (rank >= 2), a strided assignment (1-D).
    # Every element outside [start, stop) keeps its value, whatever the
    # variable's rank and wherever the range starts and ends.
    from tfdist.strategies.sharded_optimizer import write_in_place

    size = int(np.prod(shape))
    start, stop = cut[0], min(cut[1], size)
    before = np.arange(size, dtype=np.float32).reshape(shape)
    variable = tf.Variable(before)
    value = -1.0 - np.arange(stop - start, dtype=np.float32)

    @tf.function
    def write():
        write_in_place(variable, tf.constant(value), start, stop)

    write()
    expected = before.reshape(-1).copy()
    expected[start:stop] = value
    np.testing.assert_array_equal(variable.numpy().reshape(-1), expected)
    graph = write.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    row = int(np.prod(shape[1:])) if len(shape) > 1 else None
    whole_rows = row is not None and -(-start // row) < stop // row
    assert ("ResourceScatterUpdate" in types) == (row is not None)
    # Whole rows go in one scatter of several rows, never through a copy of the variable.
    if whole_rows:
        assert any(op.type == "ResourceScatterUpdate" and op.inputs[1].shape.rank == 1
                   for op in graph.get_operations())
    # The variable is never read whole (a partial row is gathered alone), so no copy of it is made.
    assert "ReadVariableOp" not in types
    if row is not None:
        assert {op.inputs[0].shape.num_elements() for op in graph.get_operations()
                if op.type == "TensorStridedSliceUpdate"} <= {row}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_checkpoint_restored_between_compile_and_fit_restores_the_moments(stage, data10, tmp_path):
    # The usual "restore, then train": before, the optimizer's slots were built
    # at the first step, after the restore, and TensorFlow's deferred
    # restoration never reached the sharded slices: Adam's moments were dropped
    # silently (0.26 from uninterrupted training; assert_consumed failed).
    x, y = data10
    adam = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    uninterrupted = train(sharded(2, stage), adam, x[:64], y[:64], epochs=2)
    first = train(sharded(2, stage), adam, x[:64], y[:64], epochs=1)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "ckpt"))
    with sharded(2, stage).scope():
        resumed = build_model(optimizer=adam())
    assert resumed.optimizer.built  # at compile, so the restore finds the slices
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path).assert_consumed()
    resumed.fit(x[:64], y[:64], epochs=1, batch_size=32, shuffle=False, verbose=0)
    assert max_relative_difference(uninterrupted.get_weights(), resumed.get_weights()) < 1e-5


_SLOT_LIST_OPTIMIZERS = {
    # Each keeps its slots in lists named its own way (SGD's `momentums`,
    # Adamax's `_m` and `_u`, Adadelta's `_accumulated_grads`, Ftrl's
    # `_linears`, accumulation's `_accumulated_gradients`).
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    # Saved at the end of an accumulation window (2 micro-steps per epoch).
    "adam_accumulating": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize(
    "name,stage",
    [("sgd_momentum", 1), ("sgd_momentum", 2), ("adamax", 2), ("adadelta", 1), ("ftrl", 2), ("adam_accumulating", 1)],
)
def test_tf_train_checkpoint_of_each_optimizers_slot_lists_has_one_devices_keys_and_resumes(name, stage, data10, tmp_path):
    # Before, only Adam's attribute names were mapped to the canonical state:
    # SGD's `momentums` (Adamax's `_m`, `_u`, ...) checkpointed one replica's
    # flat slice under a key of its own, `optimizer/momentums/0`, and restored
    # it into every replica: 0.50 relative from uninterrupted training.
    x, y = data10
    optimizer_fn = _SLOT_LIST_OPTIMIZERS[name]
    uninterrupted = train(sharded(2, stage), optimizer_fn, x[:64], y[:64], epochs=2)
    first = train(sharded(2, stage), optimizer_fn, x[:64], y[:64], epochs=1)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "sharded"))
    single = train(None, optimizer_fn, x[:64], y[:64], epochs=1)
    single_path = tf.train.Checkpoint(model=single, optimizer=single.optimizer).save(str(tmp_path / "single"))
    keys = tf.train.list_variables(path)
    if name == "adam_accumulating":
        # tfdist's window, beside the optimizer's state (tests/engine/test_accumulation.py).
        window = [key for key in keys if key[0].startswith("optimizer/_tfdist_accumulation/")]
        assert window == [(f"optimizer/_tfdist_accumulation/{part}/.ATTRIBUTES/VARIABLE_VALUE", shape) for part, shape in
                          [("sums/0", [64, 32]), ("sums/1", [32]), ("sums/2", [32, 10]), ("sums/3", [10]), ("weight", [])]]
        keys = [key for key in keys if key not in window]
    assert keys == tf.train.list_variables(single_path)
    with sharded(2, stage).scope():
        resumed = build_model(seed=1, optimizer=optimizer_fn())
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path).assert_consumed()
    resumed.fit(x[:64], y[:64], epochs=1, batch_size=32, shuffle=False, verbose=0)
    assert max_relative_difference(uninterrupted.get_weights(), resumed.get_weights()) < 1e-5
    assert max_relative_difference(canonical(uninterrupted), canonical(resumed)) < 1e-5


@pytest.mark.parametrize("stage", [1, 2])
def test_a_saved_model_loads_serves_as_predict_and_holds_the_single_device_state(stage, tmp_path, data10):
    # Before: tf.saved_model.save wrote the flat variable (declared [1, 1205],
    # holding [0]) and one replica's slices, and tf.saved_model.load raised
    # "Received incompatible tensor with shape (0,) ... tfdist_parameter_shard:0".
    x, y = data10
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    model = train(sharded(2, stage), adam, x[:64], y[:64])
    single = train(None, adam, x[:64], y[:64])
    tf.saved_model.save(model, str(tmp_path / "sharded"))
    tf.saved_model.save(single, str(tmp_path / "single"))
    variables = str(tmp_path / "sharded" / "variables" / "variables")
    assert tf.train.list_variables(variables) == tf.train.list_variables(
        str(tmp_path / "single" / "variables" / "variables")
    )
    serve = tf.saved_model.load(str(tmp_path / "sharded")).signatures["serving_default"]
    (name,) = serve.structured_input_signature[1]
    (served,) = serve(**{name: tf.constant(x[:16])}).values()
    np.testing.assert_allclose(served.numpy(), model.predict(x[:16], verbose=0), rtol=0, atol=1e-6)
    # Adam's state as a single-device optimizer holds it (each variable saved under its first path).
    reader = tf.train.load_checkpoint(variables)
    keys = ["_iterations", "_learning_rate"] + [f"_variables/{i}" for i in range(2, 10)]
    saved = [reader.get_tensor(f"optimizer/{key}/.ATTRIBUTES/VARIABLE_VALUE") for key in keys]
    assert max_relative_difference(canonical(model), saved) == 0.0
    assert max_relative_difference(canonical(single), saved) < 1e-5


def test_recompiling_the_same_optimizer_after_trainable_changed_is_a_clear_error(data10):
    # Before: "Dimensions must be equal, but are 192 and 234" (or an IndexError) at the next fit.
    x, y = data10
    strategy = sharded(2, 1)
    with strategy.scope():
        model = build_model(optimizer=keras.optimizers.Adam(1e-2, name="adam"))
    model.fit(x[:32], y[:32], batch_size=16, verbose=0)
    model.layers[0].trainable = False
    before = [w.copy() for w in model.get_weights()]
    with strategy.scope():
        with pytest.raises(ValueError) as info:
            model.compile(optimizer=model.optimizer, loss="sparse_categorical_crossentropy")
    assert str(info.value) == (
        "The optimizer 'adam' of this 'sharded_optimizer' model holds its state in slices laid out for the "
        "4 variables it was built on; the model now trains 2 (a layer's `trainable` changed since). The "
        "slices cannot be laid out again. Compile with a new optimizer, e.g. "
        "model.compile(optimizer=keras.optimizers.Adam(...), ...), inside the strategy's scope. The weights "
        "and the optimizer's state are unchanged."
    )
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    model.fit(x[:32], y[:32], batch_size=16, verbose=0)


@pytest.mark.parametrize("stage", [1, 2])
def test_run_eagerly_is_refused_by_name_instead_of_hanging(stage, data10):
    # Before: fit(run_eagerly=True) at stages 1 and 2 on 2 replicas never
    # returned (stage 3 and mirrored run eagerly).
    x, y = data10
    strategy = sharded(2, stage)
    message = (
        f"run_eagerly=True is not supported by the 'sharded_optimizer' strategy at stage={stage} with 2 "
        "replicas: its replicas reduce and gather the optimizer's slices inside the traced step, and run "
        "eagerly the step hangs. Leave run_eagerly False (the default), or debug under the 'mirrored' "
        "strategy (the same replicas; stages 1 and 2 train to its weights within 1e-6) or at stage=3."
    )
    with strategy.scope():
        model = build_model(optimizer=keras.optimizers.Adam(1e-2))
        with pytest.raises(NotImplementedError) as info:
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                          run_eagerly=True)
    assert str(info.value) == message
    # Set after compile: refused when fit builds its step, before anything trains.
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    before = [w.copy() for w in model.get_weights()]
    model.run_eagerly = True
    with pytest.raises(NotImplementedError) as info:
        model.fit(x[:32], y[:32], batch_size=16, verbose=0)
    assert str(info.value) == message
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))

"""Data sinking: k training steps per host call (issue 8)."""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import build_model
from tests.engine.common import make_strategy, max_relative_difference
from tests.strategies.parity import relative_difference, strategy_for


class BatchEnds(keras.callbacks.Callback):
    """Records the step index Keras passes to each per-batch hook."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def fit_under(name, x, y, sink_size=None, epochs=1, batch_size=32, **fit_kwargs):
    options = {} if sink_size is None else {"sink_size": sink_size}
    with strategy_for(name, 2, **options).scope():
        model = build_model()
    ends = BatchEnds()
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[ends], **fit_kwargs
    )
    return model, history, ends.ends


def test_sink_size_32_matches_per_step_training_with_partial_last_chunk(digits):
    # 1797 examples in batches of 32: 57 steps, run as chunks of 32 and 25.
    x, y = digits
    per_step, per_step_history, per_step_ends = fit_under("mirrored", x, y)
    sunk, sunk_history, sunk_ends = fit_under("mirrored", x, y, sink_size=32)
    assert sunk.steps_per_execution == 32
    assert sunk.optimizer.iterations.numpy() == 57
    assert relative_difference(per_step, sunk) < 1e-6
    np.testing.assert_allclose(sunk_history.history["loss"], per_step_history.history["loss"], rtol=1e-6)
    assert per_step_ends == list(range(57))
    # Keras's documented steps_per_execution behaviour: one hook per host call,
    # given the chunk's last step index.
    assert sunk_ends == [31, 63]


def test_sink_size_epoch_runs_one_host_call_per_epoch_and_matches(digits):
    x, y = digits
    x, y = x[:320], y[:320]  # 10 steps
    per_step, per_step_history, _ = fit_under("central_storage", x, y, epochs=2, validation_data=(x[:100], y[:100]))
    sunk, sunk_history, ends = fit_under(
        "central_storage", x, y, sink_size="epoch", epochs=2, validation_data=(x[:100], y[:100])
    )
    assert ends == [9, 9]
    assert sunk.optimizer.iterations.numpy() == 20
    assert relative_difference(per_step, sunk) < 1e-6
    np.testing.assert_allclose(sunk_history.history["val_loss"], per_step_history.history["val_loss"], rtol=1e-6)


def test_sink_size_epoch_progress_bar_counts_every_step(digits, capsys):
    x, y = digits
    with strategy_for("mirrored", 2, sink_size="epoch").scope():
        model = build_model()
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "10/10" in out
    assert "1/10" not in out


def test_sink_size_epoch_with_steps_per_epoch_on_a_repeated_dataset(digits):
    x, y = digits
    ds = tf.data.Dataset.from_tensor_slices((x[:320], y[:320])).batch(32).repeat()
    with strategy_for("mirrored", 2, sink_size="epoch").scope():
        model = build_model()
    model.fit(ds, steps_per_epoch=7, epochs=2, verbose=0)
    assert model.optimizer.iterations.numpy() == 14


@pytest.mark.parametrize(
    "value, shown",
    [(0, "sink_size=0"), ("ep", "sink_size='ep'"), (True, "sink_size=True (type bool)"), (2.0, "sink_size=2.0 (type float)")],
)
def test_sink_size_must_be_a_positive_integer_or_epoch(value, shown):
    with pytest.raises(tfdist.OptionError) as info:
        tfdist.get_strategy("mirrored", sink_size=value)
    assert str(info.value) == (
        'option \'sink_size\' must be a positive integer or "epoch" (training steps per host call). '
        f"Received: {shown}"
    )


def test_sink_size_conflicting_with_steps_per_execution_is_an_error():
    with strategy_for("mirrored", 2, sink_size=8).scope():
        with pytest.raises(ValueError) as info:
            build_model(steps_per_execution=4)
    assert str(info.value) == (
        "The strategy's sink_size=8 and compile(steps_per_execution=4) disagree; both set "
        "the training steps per host call. Pass only one of them (or the same integer to both)."
    )


def test_sink_size_epoch_on_input_of_unknown_length_is_an_error(digits):
    x, y = digits
    ds = tf.data.Dataset.from_tensor_slices((x[:64], y[:64])).filter(lambda a, b: True).batch(32)
    with strategy_for("mirrored", 2, sink_size="epoch").scope():
        model = build_model()
    with pytest.raises(ValueError, match=r"sink_size='epoch' runs a whole epoch per host call .*assert_cardinality"):
        model.fit(ds, epochs=1, verbose=0)


def test_sink_size_in_a_preset_is_validated_with_the_file_named():
    assert tfdist.from_config({"strategy": "mirrored", "sink_size": "epoch"}).options.sink_size == "epoch"
    with pytest.raises(tfdist.PresetError) as info:
        tfdist.from_config({"strategy": "mirrored", "sink_size": 0})
    assert str(info.value) == (
        'preset mapping: option \'sink_size\' must be a positive integer or "epoch" (training steps per '
        "host call). Received: sink_size=0"
    )


@pytest.mark.parametrize("sink_size", [1, 4])
def test_unknown_length_input_counts_exactly_the_steps_run(sink_size):
    # Keras's own loop (and a plain get_next()) counts one optimizer step too
    # many per epoch on input of unknown length: 42 for 2 epochs of 20 steps.
    # At sink 4 (chunks) the epoch ends when the call's one fetch finds no chunk.
    import keras
    import tensorflow as tf

    import tfdist
    from tests.conftest import DEVICES

    x, y = tfdist.datasets.load_digits()
    ds = tf.data.Dataset.from_tensor_slices((x[:640], y[:640])).filter(lambda a, b: True).batch(32)
    assert ds.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY
    with tfdist.get_strategy("mirrored", devices=DEVICES[2], sink_size=sink_size).scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 40


def _embedding_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize(
    "name,sink_size",
    [("mirrored", 4), ("central_storage", "epoch"), ("sharded_optimizer", 4)],
)
def test_short_last_batch_beside_full_ones_with_sparse_gradients_matches_one_device(name, sink_size):
    # An Embedding's rows are all-gathered with a count that follows the batch,
    # and TensorFlow fixes a collective's shape per host call: a call holding
    # full batches and the short last one (100 samples = 3 x 32 + 4) aborted
    # with "Shape mismatch in the collective instance" until the short batch
    # got a step copy of its own. Adam over the sparse rows, 2 epochs.
    rng = np.random.RandomState(0)
    x, y = rng.randint(0, 50, (100, 6)), rng.randint(0, 2, 100)
    reference = _embedding_model()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with make_strategy(name, replicas=2, sink_size=sink_size).scope():
        model = _embedding_model()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert max_relative_difference(reference, model) < 1e-5


_THREE_SIZES_SCRIPT = """
import numpy as np, tfdist
tfdist.configure_local_devices(2)
import keras, tensorflow as tf
strategy = tfdist.get_strategy("mirrored", devices=["/cpu:0", "/cpu:1"], sink_size=4)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.RandomState(0)
x, y = rng.randint(0, 50, (56, 6)), rng.randint(0, 2, 56)
def part(a, b, n):
    return tf.data.Dataset.from_tensor_slices((x[a:b], y[a:b])).batch(n)
try:
    model.fit(part(0, 32, 32).concatenate(part(32, 48, 16)).concatenate(part(48, 56, 8)), verbose=0)
except ValueError as error:
    print("ValueError:", error)
"""


def test_three_batch_sizes_in_one_call_with_sparse_gradients_get_a_clear_error():
    # Batches of 32, 16 and 8 in one host call: the first size and one other
    # have step copies; the third meets a collective fixed to another shape.
    # The error names the fixes. In a child process: the aborted collective
    # poisons every later collective of its process.
    import os
    import subprocess
    import sys

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    completed = subprocess.run([sys.executable, "-c", _THREE_SIZES_SCRIPT], capture_output=True, text=True,
                               timeout=240, env=env)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "ValueError: A host call of 4 steps ran batches of more sizes than it has step copies" in completed.stdout
    assert "drop_remainder=True" in completed.stdout and "set sink_size=1" in completed.stdout


# --- Chunked sinking (issue 16): a host call's batches fetched together -------------------------

from tests.conftest import DEVICES  # noqa: E402
from tfdist.data import sinking  # noqa: E402


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_replica_rows_split_batches_as_tensorflow_does(replicas):
    # The chunked loop splits each batch itself; it must give each replica the
    # rows TensorFlow's distributed dataset gives it (per-replica BatchNorm
    # statistics and every per-replica value depend on it).
    strategy = tf.distribute.MirroredStrategy(DEVICES[replicas])
    for batch, total in [(32, 49), (30, 47), (7, 9), (5, 11), (24, 79)]:
        ds = tf.data.Dataset.range(total).batch(batch)
        for global_batch, dist in zip(ds, strategy.experimental_distribute_dataset(ds)):
            size = int(global_batch.shape[0])
            expected = [t.numpy().tolist() for t in strategy.experimental_local_results(dist)]
            got = []
            for r in range(replicas):
                lo, hi = sinking.replica_rows(tf.constant(size), r, replicas)
                got.append(global_batch.numpy()[int(lo):int(hi)].tolist())
            assert got == expected, (replicas, batch, total, size)


class HostCalls(keras.callbacks.Callback):
    """Records what Keras hands the train function: the iterator's type, per call."""

    def __init__(self, model):
        super().__init__()
        self.kinds = []
        function = model.make_train_function()

        def recording(iterator):
            self.kinds.append(type(iterator).__name__)
            return function(iterator)

        model.train_function = recording


def _bn_model():
    keras.utils.set_random_seed(3)
    a = keras.Input((8,), name="a")
    b = keras.Input((5,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8)(a), b])
    h = keras.layers.BatchNormalization()(h)  # per-replica statistics: the split shows
    out = keras.layers.Dense(3)(keras.layers.Activation("relu")(h))
    model = keras.Model({"a": a, "b": b}, out)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _bn_data(samples=79):
    rng = np.random.RandomState(5)
    x = {"a": rng.normal(size=(samples, 8)).astype("float32"), "b": rng.normal(size=(samples, 5)).astype("float32")}
    return x, rng.randint(0, 3, samples), rng.uniform(0.5, 2.0, samples).astype("float32")


@pytest.mark.parametrize(
    "name,sink_size,samples,batch_size",
    [
        ("mirrored", 4, 79, 24),
        ("central_storage", "epoch", 79, 24),
        ("sharded_optimizer", 3, 79, 24),
        ("mirrored", "epoch", 72, 24),
        ("mirrored", 2, 60, 20),
    ],
)
def test_chunked_sinking_trains_exactly_as_batch_by_batch(name, sink_size, samples, batch_size):
    # 79 samples in batches of 24 over 3 replicas: 24, 24, 24 and 7, the last
    # split 3/3/1 (an even split would be 3/2/2); a dict input, sample weights
    # and a non-synchronized BatchNorm, whose statistics are per replica.
    # 72 and 60 samples: whole batches, so every batch has one static shape
    # and chunks are stacked without padding; 24 splits evenly over 3
    # replicas, 20 as 7/7/6.
    x, y, w = _bn_data(samples)
    batches = -(-samples // batch_size)
    results = {}
    for sink in (1, sink_size):
        with make_strategy(name, replicas=3, sink_size=sink).scope():
            model = _bn_model()
        calls = HostCalls(model)
        history = model.fit(x, y, sample_weight=w, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                            validation_data=(x, y), callbacks=[calls])
        results[sink] = (model.get_weights(), history.history, calls.kinds)
    (per_step, per_step_history, per_step_kinds), (sunk, sunk_history, sunk_kinds) = results[1], results[sink_size]
    assert set(per_step_kinds) != {"SunkIterator"}
    assert sunk_kinds == ["SunkIterator"] * (2 if sink_size == "epoch" else 2 * -(-batches // sink_size))
    for a, b in zip(per_step, sunk):
        np.testing.assert_array_equal(a, b)
    assert sunk_history == per_step_history


def test_chunked_sinking_keeps_each_batchs_own_shape():
    # Batches of different sequence lengths (no mask): a chunk pads them to the
    # longest, and each step must see its batch at its own length, or the
    # average over the padded positions would change the result.
    rng = np.random.RandomState(0)
    lengths = [5, 9, 3, 7, 9, 4]
    batches = [(rng.normal(size=(8, n, 3)).astype("float32"), rng.randint(0, 2, 8)) for n in lengths]

    def dataset():
        out = None
        for xb, yb in batches:
            part = tf.data.Dataset.from_tensors((xb, yb))
            out = part if out is None else out.concatenate(part)
        return out

    weights = []
    for sink in (1, 4):
        with make_strategy("mirrored", replicas=2, sink_size=sink).scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((None, 3)), keras.layers.Dense(4),
                keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
            ])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(dataset(), epochs=2, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 12
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_chunks_never_span_two_host_calls(monkeypatch):
    # 6 steps per call, chunks of at most 2 batches: 3 chunks per call (the
    # loop over chunks), on a repeated dataset read across epochs
    # (steps_per_epoch): the same training as one batch per step.
    monkeypatch.setattr(sinking, "MAX_BATCHES_PER_CHUNK", 2)
    monkeypatch.setattr(sinking, "UNSIZED_BATCHES_PER_CHUNK", 2)
    spec = (tf.TensorSpec((None, 64), tf.float32), tf.TensorSpec((None,), tf.int32))
    assert sinking.batches_per_chunk(spec, 32, 6) == 2
    assert sinking.batches_per_chunk(spec, 32, 5) == 1  # the largest divisor of the call within the limit
    with pytest.raises(ValueError, match="A chunk of 4 batches does not divide a host call of 6 steps"):
        sinking.SunkInput(tf.data.Dataset.range(12).batch(2), 6, 4)
    x, y = tfdist.datasets.load_digits()
    ds = tf.data.Dataset.from_tensor_slices((x[:224], y[:224].astype("int32"))).batch(32).repeat()
    results = []
    for sink in (1, 6):
        with make_strategy("mirrored", replicas=2, sink_size=sink).scope():
            model = build_model()
        calls = HostCalls(model)
        model.fit(ds, steps_per_epoch=12, epochs=2, verbose=0, callbacks=[calls])
        assert int(model.optimizer.iterations.numpy()) == 24
        results.append(model.get_weights())
    assert calls.kinds == ["SunkIterator"] * 4
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_batches_per_chunk_is_bounded_by_bytes_and_divides_the_call():
    image = (tf.TensorSpec((None, 224, 224, 3), tf.float32), tf.TensorSpec((None,), tf.int32))
    # 256 x 224 x 224 x 3 x 4 bytes = 147 MiB per batch: one batch per chunk.
    assert sinking.batches_per_chunk(image, 256, 32) == 1
    digits = (tf.TensorSpec((None, 64), tf.float32), tf.TensorSpec((None,), tf.int32))
    assert sinking.batches_per_chunk(digits, 32, 32) == 32
    assert sinking.batches_per_chunk(digits, 32, 2048) == 128  # 16 equal chunks per call
    assert sinking.batches_per_chunk(digits, 32, 300) == 100  # 3 equal chunks
    assert sinking.batches_per_chunk(digits, 32, 1563) == 3  # 1563 = 3 x 521
    assert sinking.batches_per_chunk(digits, 32, 257) == 1  # a prime: batch by batch
    # Unknown sizes (a sequence length, or no batch size): a few batches per chunk.
    text = (tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None,), tf.int32))
    assert sinking.batches_per_chunk(text, 32, 64) == sinking.UNSIZED_BATCHES_PER_CHUNK
    assert not sinking.chunkable(tf.RaggedTensorSpec((None, None), tf.int32))
    assert not sinking.chunkable(tf.TensorSpec((), tf.float32))


@pytest.mark.parametrize("model_name", ["convnet", "transformer", "rnn", "recommender"])
def test_chunked_sinking_matches_batch_by_batch_on_the_zoo(model_name):
    # Convolution with synchronized BatchNorm, attention, a recurrent layer,
    # and Embeddings (sparse gradients, all-gathered rows) under mirrored on 2
    # replicas, 2 epochs of 3 batches: sink 8 (each epoch one chunk) against
    # sink 1. Measured: 0 for all but the Transformer (1.2e-7 absolute: a
    # per-replica batch of unknown static size picks other kernels).
    from tests.models.zoo import ZOO

    entry = ZOO[model_name]
    x, y = entry.data()
    models, kinds = [], []
    for sink in (1, 8):
        with make_strategy("mirrored", replicas=2, sink_size=sink).scope():
            model = entry.make(0)
        calls = HostCalls(model)
        model.fit(x, y, batch_size=entry.batch_size, epochs=2, shuffle=False, verbose=0, callbacks=[calls])
        assert int(model.optimizer.iterations.numpy()) == 6
        models.append(model)
        kinds.append(calls.kinds)
    assert kinds[1] == ["SunkIterator"] * 2 and "SunkIterator" not in kinds[0]
    assert max_relative_difference(models[0], models[1]) < 1e-6


def _loop_bodies(graph):
    """The bodies (`FunctionDef`) of every `While` in `graph`, nested ones included."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    bodies = []

    def visit(nodes):
        for node in nodes:
            if node.op in ("While", "StatelessWhile"):
                bodies.append(library[node.attr["body"].func.name])
                visit(bodies[-1].node_def)
            for attr in ("then_branch", "else_branch", "f"):
                if attr in node.attr and node.attr[attr].func.name in library:
                    visit(library[node.attr[attr].func.name].node_def)

    visit(graph.as_graph_def().node)
    return bodies


def _ops(body, scope=""):
    return collections.Counter(n.op for n in body.node_def if n.op != "Const" and scope in n.name)


def test_a_sunk_step_cuts_its_batch_with_one_gather_per_leaf_and_replica():
    # The step loop over a chunk runs the same step as a loop over one batch
    # already on the devices, plus one gather per leaf (x, y) and replica:
    # the chunk is split over the replicas once per chunk, not per step (it
    # was ~20 small ops per leaf and replica per step, a third of the digits
    # MLP's step on 2 logical CPU devices). With a short last batch, batches
    # differ in size and each cut also drops its padding: its row count
    # (a second gather), a Pack and a Slice.
    from tfdist.engine.loop import CUT_BATCH_SCOPE

    rng = np.random.RandomState(0)
    x, y = rng.normal(size=(101, 8)).astype("float32"), rng.randint(0, 3, 101)

    def model_under(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(3)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = model_under(make_strategy("mirrored", replicas=2))
    reference.fit(x[:32], y[:32], batch_size=32, verbose=0)
    step = tfdist.engine.TrainStep(reference)
    batch = next(iter(reference.distribute_strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(32))))

    @tf.function
    def on_device(batch):
        return tf.while_loop(lambda i: i < 4, lambda i: (step(batch), i + 1)[1:], (tf.constant(0),))

    (on_device_body,) = _loop_bodies(on_device.get_concrete_function(batch).graph)
    cut = {}
    for rows in (96, 101):
        model = model_under(make_strategy("mirrored", replicas=2, sink_size="epoch"))
        model.fit(x[:rows], y[:rows], batch_size=32, shuffle=False, verbose=0)
        (body,) = _loop_bodies(model.train_function.traced_graphs[-1])
        cut[rows] = _ops(body, CUT_BATCH_SCOPE)
        if rows == 96:
            assert _ops(body) - _ops(on_device_body) == collections.Counter({"GatherV2": 4})
            assert _ops(on_device_body) - _ops(body) == collections.Counter()
    assert cut == {96: {"GatherV2": 4}, 101: {"GatherV2": 8, "Pack": 4, "Slice": 4}}

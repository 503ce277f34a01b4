"""Sinking's windows: each replica's rows of a host call staged on its device, the next call's while this one runs."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tests.conftest import DEVICES
from tests.engine.test_sinking import _loop_bodies
from tfdist.data import sinking
from tfdist.engine.loop import CUT_BATCH_SCOPE


def _model(sink, **options):
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[2], sink_size=sink, **options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.RandomState(0)
    return rng.normal(size=(96, 8)).astype("float32"), rng.randint(0, 3, 96).astype("int32")


def test_each_replica_cuts_its_batch_out_of_its_window_on_its_device():
    # Before: the chunk was split and each step's batch cut on the host, and replica 1's
    # batch crossed to its device every step. Now the step loop reads each replica's
    # window where it was staged: one gather per leaf (x, y) on each replica's device.
    x, y = _data()
    model = _model(4)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    (body,) = _loop_bodies(model.train_function.traced_graphs[-1])
    cuts = sorted(
        tf.DeviceSpec.from_string(n.device).device_index
        for n in body.node_def
        if CUT_BATCH_SCOPE in n.name and n.op == "GatherV2"
    )
    assert cuts == [0, 0, 1, 1]


def test_the_next_window_is_staged_on_each_device_while_a_call_runs():
    # A call of 4 steps over 2 replicas takes its window and leaves the next one on the
    # devices: replica r's rows of batches 4..7 (8 of each 16-row batch), in its buffer
    # on its own device, before the next call asks for them.
    x, y = _data()
    model = _model(4)
    model.fit(x[:64], y[:64], batch_size=16, shuffle=False, verbose=0)  # builds the optimizer and the function
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    source = sinking.SunkInput(dataset, 4, 4)
    iterator = iter(source)
    model.train_function(iterator)
    (stage,) = model.train_function.window_stages()
    assert bool(stage.ready.numpy())
    for replica, buffers in enumerate(stage.buffers):
        rows, labels = buffers  # every batch has one static shape: rows per leaf, nothing else
        assert tf.DeviceSpec.from_string(rows.device).device_index == replica
        expected = x[64:96].reshape(2, 16, 8)[:, replica * 8:(replica + 1) * 8]
        np.testing.assert_array_equal(rows.numpy(), expected)
        np.testing.assert_array_equal(labels.numpy(), y[64:96].reshape(2, 16)[:, replica * 8:(replica + 1) * 8])
    # The last window: nothing left to stage, and the buffers let go of the windows.
    model.train_function(iterator)
    assert not bool(stage.ready.numpy())
    assert all(int(tf.size(v)) == 0 for buffers in stage.buffers for v in buffers)


def test_windows_left_on_the_host_train_exactly_as_staged_ones():
    # transfer=False: each call fetches its window where the host iterator puts it.
    x, y = _data()
    results = []
    for options in ({}, {"transfer": False}):
        model = _model(4, **options)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)

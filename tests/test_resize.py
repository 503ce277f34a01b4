"""Exact resume from a mid-epoch backup, at the same size and at another (issue 38, items 2 and 3).

In one process with 4 logical devices: a `fit` under a tfdist strategy with
`BackupAndRestore(save_freq=N)` is interrupted mid-epoch (a callback raises,
as a killed process would stop); a second `fit` with the same backup folder,
at another replica count, resumes. Keras's own callback restarts the epoch at
batch 0 and applies the backup's batches twice; tfdist's skips them and reads
on from the input's saved position.

Multi-process jobs that change size (2 -> 3 -> 2 and 2 -> 1 workers) are
tests/test_preemption.py's; the sharded optimizer's 4 -> 2 across two Slurm
tasks is tests/test_slurm.py's.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import DEVICES, max_relative_difference
from tests.models.zoo import ZOO


class Interrupt(keras.callbacks.Callback):
    """Stops `fit` after `steps` trained steps, as a killed process would."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            raise KeyboardInterrupt("stopped by the test")


def metadata(folder) -> dict:
    return json.loads((folder / "training_metadata.json").read_text())


@pytest.mark.parametrize("name", ["transformer", "multi_io"])
def test_a_mid_epoch_backup_resumes_like_an_uninterrupted_run_at_another_replica_count(name, tmp_path):
    # Arrays (Keras makes each epoch's iterator afresh): 3 epochs of 3 steps; a
    # backup every 2 steps; stopped after step 5, the backup holds step 4 (epoch 2, step 1).
    entry = ZOO[name]
    x, y = entry.data()
    fit = dict(batch_size=entry.batch_size, epochs=3, shuffle=False, verbose=0)
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        uninterrupted = entry.make(seed=0)
    uninterrupted.fit(x, y, **fit)

    with tfdist.get_strategy("mirrored", devices=DEVICES[4]).scope():
        first = entry.make(seed=0)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2, delete_checkpoint=False)
    with pytest.raises(KeyboardInterrupt):
        first.fit(x, y, callbacks=[backup, Interrupt(5)], **fit)
    saved = metadata(tmp_path)
    assert (saved["epoch"], saved["tfdist"]["steps_done"], saved["tfdist"]["data_batches"]) == (1, 1, 1)
    assert (saved["tfdist"]["optimizer_step"], saved["tfdist"]["replicas"]) == (4, 4)

    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        resumed = entry.make(seed=1)  # other initial weights: the backup replaces them
    history = resumed.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)], **fit)
    assert int(resumed.optimizer.iterations.numpy()) == 9  # Keras's own callback: 10, step 5 run twice
    assert len(history.history["loss"]) == 2  # epochs 2 and 3
    assert max_relative_difference(uninterrupted.get_weights(), resumed.get_weights()) < entry.tolerance


def test_the_sharded_optimizer_saved_at_4_replicas_resumes_at_2_like_a_2_replica_run_from_the_backup(tmp_path):
    # A tf.data pipeline with steps_per_epoch: Keras keeps one iterator across
    # epochs, so the backup's position counts the earlier epochs' batches too.
    x, y = tfdist.datasets.load_digits()

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x[:320], y[:320])).shuffle(320, seed=0).repeat().batch(32)

    def build(devices):
        with tfdist.get_strategy("sharded_optimizer", stage=2, devices=devices).scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(10)])
            # A schedule: the resumed run's learning rate follows the restored step count.
            schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=4, decay_rate=0.5)
            model.compile(optimizer=keras.optimizers.Adam(schedule),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    fit = dict(epochs=3, steps_per_epoch=5, verbose=0)
    first = build(DEVICES[4])
    with pytest.raises(KeyboardInterrupt):
        first.fit(dataset(), callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=3,
                                                                          delete_checkpoint=False),
                                        Interrupt(10)], **fit)
    saved = metadata(tmp_path)
    # Saved after step 9: epoch 2 (0-based 1), 4 of its 5 steps; 9 batches read from the one iterator.
    assert (saved["epoch"], saved["tfdist"]["steps_done"], saved["tfdist"]["data_batches"]) == (1, 4, 9)
    reference = build(DEVICES[2])  # an uninterrupted 2-replica run from the same checkpoint
    reference.optimizer.build(reference.trainable_variables)
    reference.load_weights(str(tmp_path / "latest.weights.h5"))
    assert int(reference.optimizer.iterations.numpy()) == 9
    reference.fit(dataset().skip(9), epochs=1, steps_per_epoch=6, verbose=0)

    resumed = build(DEVICES[2])
    resumed.fit(dataset(), callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=3)], **fit)
    assert int(resumed.optimizer.iterations.numpy()) == 15
    assert max_relative_difference(reference.get_weights(), resumed.get_weights()) < 1e-5
    np.testing.assert_allclose(reference.optimizer.variables[-1].numpy(), resumed.optimizer.variables[-1].numpy(),
                               rtol=1e-5)

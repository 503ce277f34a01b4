"""A user's training script for tests/test_tune.py: the digits MLP, its strategy from the preset in argv[1].

`tfdist tune -- python tune_script.py {preset}` runs it once per setting; each
run is ended once its steps are timed, so the last line is never printed there.
"""

from __future__ import annotations

import sys

import keras
import tensorflow as tf

import tfdist

strategy = tfdist.from_config(sys.argv[1])
x, y = tfdist.datasets.load_digits()
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(dataset, epochs=50, steps_per_epoch=28, verbose=0)
print("the script trained to its end", flush=True)

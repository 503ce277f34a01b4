"""One task of the 2-worker job of tests/test_timeline.py (run under `tfdist launch --timeline`).

Usage: report_job.py OUT_DIR, with TF_CONFIG set by the launcher.

1. A straggler: worker 1 sleeps DELAY_S in Python before each host call after
   the first two; both train the same MLP with a `StepReport` (the chief's
   report goes to OUT_DIR/report.json, worker 1's to report.worker-1.json).
2. A stuck worker: a second `fit` in which worker 1 stops before its third
   host call until worker 0's collective has timed out (collective_timeout
   10 s); worker 0 writes the error it got to OUT_DIR/timeout.txt. Both then
   exit 0.

Each task also copies its own timeline file (worker-<i>.json) to OUT_DIR.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.callbacks import StepReport

DELAY_S = 0.06
out = sys.argv[1]
strategy = tfdist.get_strategy("multi_worker", collective_timeout=10, startup_timeout=120)
worker = strategy.cluster_config.task_id
timeout_file = os.path.join(out, "timeout.txt")


class Straggler(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if worker == 1 and batch >= 2:
            time.sleep(DELAY_S)


class Stuck(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if worker == 1 and batch == 2:
            deadline = time.monotonic() + 60
            while not os.path.exists(timeout_file) and time.monotonic() < deadline:
                time.sleep(0.2)
            print("worker 1: worker 0 timed out; leaving", flush=True)
            sys.stdout.flush()
            os._exit(0)


rng = np.random.default_rng(0)
x = rng.standard_normal((1024, 64)).astype("float32")
y = rng.integers(0, 10, 1024).astype("int32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
# 2 warm-up calls, 10 profiled (+1 that closes the window), 9 timed.
model.fit(dataset, epochs=1, steps_per_epoch=22, verbose=0,
          callbacks=[Straggler(), StepReport(path=os.path.join(out, "report.json"))])
# This task's own timeline file, for the test of the clock alignment (the launcher removes the directory).
shutil.copy(os.path.join(os.environ["TFDIST_TIMELINE_DIR"], f"worker-{worker}.json"), out)
try:
    model.fit(dataset, epochs=1, steps_per_epoch=10, verbose=0, callbacks=[Stuck()])
except tf.errors.DeadlineExceededError as error:
    with open(timeout_file + ".partial", "w") as f:
        f.write(str(error))
    os.replace(timeout_file + ".partial", timeout_file)
    print("worker 0: the collective timed out", flush=True)
    sys.stdout.flush()
    os._exit(0)

"""One task of a 2-worker job for tests/strategies/test_timeouts.py.

Usage: timeouts_job.py MODE COLLECTIVE_TIMEOUT, with TF_CONFIG set;
COLLECTIVE_TIMEOUT `default` leaves the option unset.
It prints `ready <time>` when the strategy exists and `step <n>` after each
training step. In MODE `hang`, worker 1 sleeps in Python before step 3 (its
TensorFlow heartbeats keep running); in MODE `train` every worker trains; in
MODE `uneven` worker 1's arrays hold 3 batches and worker 0's 2500.
"""

from __future__ import annotations

import sys
import time

import keras
import numpy as np

import tfdist

mode, collective_timeout = sys.argv[1], None if sys.argv[2] == "default" else float(sys.argv[2])
strategy = tfdist.get_strategy("multi_worker", collective_timeout=collective_timeout, startup_timeout=120)
print(f"ready {time.time():.3f} collective_timeout={strategy.collective_timeout}", flush=True)


class Steps(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if mode == "hang" and strategy.cluster_config.task_id == 1 and batch == 3:
            print(f"hanging {time.time():.3f}", flush=True)
            time.sleep(3600)

    def on_train_batch_end(self, batch, logs=None):
        print(f"step {batch} {time.time():.3f}", flush=True)
        if mode != "uneven":
            time.sleep(0.2)


with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
rows = 24 if mode == "uneven" and strategy.cluster_config.task_id == 1 else 20000
x = np.zeros((rows, 4), "float32")
model.fit(x, np.zeros((rows, 2), "float32"), batch_size=8, epochs=1, verbose=0, callbacks=[Steps()])
print("done", flush=True)

"""EpochTimer: wall-clock time of each training epoch, for the demo and the benchmarks."""

from __future__ import annotations

import time

import keras


class EpochTimer(keras.callbacks.Callback):
    """A Keras callback that records each epoch's wall-clock seconds in `times`.

    The first epoch includes tracing and compilation; `steady_times()` leaves
    it out when there is more than one.

    Example:

    ```python
    timer = EpochTimer()
    model.fit(x, y, epochs=3, callbacks=[timer])
    print(timer.samples_per_second(len(x)))
    ```
    """

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    def steady_times(self) -> list[float]:
        return self.times[1:] or self.times

    def samples_per_second(self, samples_per_epoch: int) -> float:
        steady = self.steady_times()
        return samples_per_epoch * len(steady) / sum(steady)

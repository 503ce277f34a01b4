"""Exact resume: a backup records where the input was, and the resumed `fit` starts there.

Keras's `BackupAndRestore` restores the weights and the epoch only. Saved in
the middle of an epoch (`save_freq=N`, or at a stop signal), its next `fit`
starts that epoch at batch 0, so the batches already in the restored weights
are applied twice (a job killed at step 70 of 174, its backup from step 105's
weights... re-ran 21 batches and ended with 192 optimizer steps, without a
warning). And where `fit` was given `steps_per_epoch`, Keras keeps one input
iterator across epochs: a `fit` resumed at epoch 3 reads the batches epoch 0
read, not those epoch 3 would have.

For a model under a tfdist strategy the backup's metadata also holds a
`Position`: the epoch, the steps of it already in the weights, and how many
batches the input iterator had given. A resumed `fit` (`FitTracker`) makes its
first host call skip the batches of the earlier epochs read from the same
iterator, then runs the steps already done as calls that only read their
batches (the callbacks see those batch ends, with no logs; the
`BackupAndRestore` saves nothing during them), so the job ends with the step
count, the input order and the weights of an uninterrupted run.

The position counts global batches, so it holds at any number of workers:
each worker's share of every global batch is recomputed from the new
replica count (`auto_shard` by data, as tfdist's strategies split a global
batch). The input must give the same batches in the same order in every run:
a `tf.data` pipeline with a seeded shuffle before `.repeat()`, or arrays with
`shuffle=False`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tfdist.data.sinking import SunkIterator
from tfdist.engine.loop import STEPS_PER_CALL_ATTR, UNTIL_EXHAUSTED


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a backup was taken, in the terms a resumed `fit` needs.

    Args:
        epoch: int. The epoch `fit` resumes in (0-based).
        steps_done: int. Steps of that epoch already in the saved weights.
        data_batches: int. Batches a fresh input iterator gives before the
            epoch's next step: `steps_done`, plus, where `fit` keeps one
            iterator across epochs (`steps_per_epoch` given), the batches of
            the earlier epochs read from it.
        optimizer_step: Optional int. The optimizer's `iterations` in the
            saved weights.
        workers: Optional int. Worker processes of the job that saved it.
        replicas: Optional int. Replicas of the job that saved it.

    Example:

    ```python
    Position.from_metadata({"epoch": 2, "batch": 16, "tfdist": {"steps_done": 17, "data_batches": 73}})
    ```
    """

    epoch: int
    steps_done: int = 0
    data_batches: int = 0
    optimizer_step: Optional[int] = None
    workers: Optional[int] = None
    replicas: Optional[int] = None

    @classmethod
    def from_metadata(cls, metadata: dict) -> Position:
        """The position in a `training_metadata.json` (Keras's own: epoch and batch only)."""
        epoch = int(metadata["epoch"])
        extra = metadata.get("tfdist")
        if not isinstance(extra, dict):
            # Keras's mid-epoch backup: batch b was the last saved (batch 0 is ambiguous: Keras
            # writes it at an epoch's end too, and that is how it is read).
            done = int(metadata.get("batch", 0) or 0)
            done = done + 1 if done > 0 else 0
            return cls(epoch=epoch, steps_done=done, data_batches=done)
        return cls(
            epoch=epoch,
            steps_done=int(extra.get("steps_done", 0)),
            data_batches=int(extra.get("data_batches", extra.get("steps_done", 0))),
            optimizer_step=extra.get("optimizer_step"),
            workers=extra.get("workers"),
            replicas=extra.get("replicas"),
        )

    def to_metadata(self) -> dict:
        """The `"tfdist"` entry of `training_metadata.json`."""
        return {
            "steps_done": self.steps_done,
            "data_batches": self.data_batches,
            "optimizer_step": self.optimizer_step,
            "workers": self.workers,
            "replicas": self.replicas,
        }

    def describe(self, steps_per_epoch: Optional[int] = None) -> str:
        """E.g. `epoch 3, step 17 of 28 (optimizer step 73)` (1-based, as Keras prints them)."""
        where = f"epoch {self.epoch + 1}, step {self.steps_done}"
        if steps_per_epoch:
            where += f" of {steps_per_epoch}"
        if self.optimizer_step is not None:
            where += f" (optimizer step {self.optimizer_step})"
        return where


def steps_of_call(model, iterator) -> int:
    """The steps one host call over `iterator` runs (Keras's `steps_per_execution`, or the sinking's)."""
    steps = getattr(iterator, "steps_per_call", None) if isinstance(iterator, SunkIterator) else None
    if steps is None:
        steps = getattr(iterator, STEPS_PER_CALL_ATTR, None)
    if steps is None or steps == UNTIL_EXHAUSTED:
        steps = model.steps_per_execution
    return int(steps) if isinstance(steps, int) else 1


def skip_batches(iterator, batches: int) -> None:
    """Reads `batches` batches from a host function's iterator without training on them."""
    if batches <= 0:
        return
    try:
        if isinstance(iterator, SunkIterator):
            read = 0
            while read < batches:
                chunk = iterator.chunks.get_next()
                read += int(tf.shape(tf.nest.flatten(chunk)[0])[0])
            if read != batches:
                raise ValueError(
                    f"The resumed input is read in chunks that do not end at the backup's position ({batches} "
                    f"batches, chunks end at {read}). Resume with the steps_per_execution (sink_size) of the "
                    "run that saved it."
                )
            return
        for _ in range(batches):
            iterator.get_next()
    except (tf.errors.OutOfRangeError, StopIteration):
        raise ValueError(
            f"The input ran out before the backup's position ({batches} batches into it): the resumed fit "
            "was given less data, or other data, than the run that saved the backup. Give it the same "
            "input (same dataset, global batch size and steps_per_epoch)."
        ) from None


class FitTracker:
    """One `fit` of one model: counts the batches read, and skips what a resumed run already did.

    Args:
        model: the Keras model; its `train_function` is wrapped until `close`.
        keeps_iterator: bool. Whether `fit` keeps one input iterator across
            epochs (Keras does when `steps_per_epoch` is given).
        resume: Optional `Position` restored from a backup.

    Example:

    ```python
    tracker = FitTracker(model, keeps_iterator=True, resume=Position(epoch=2, steps_done=17, data_batches=73))
    tracker.install()   # after make_train_function, before the first step
    ```
    """

    def __init__(self, model, keeps_iterator: bool, resume: Optional[Position] = None):
        self.model = model
        self.keeps_iterator = keeps_iterator
        self.resume = resume
        self.epoch = resume.epoch if resume is not None else 0
        self.batch = -1  # the last batch index `fit` reported in this epoch
        self.skip_steps = resume.steps_done if resume is not None else 0
        self._pre_read = (resume.data_batches - resume.steps_done) if resume is not None else 0
        self._iterator = None
        self.batches = 0  # batches read from the current iterator (skipped ones included)
        self.skipping = False  # whether the call that just ran only read its batches
        self._original = None

    def install(self) -> None:
        """Wraps `model.train_function` (made by `make_train_function`, before `on_train_begin`)."""
        self._original = self.model.train_function
        original = self._original

        def train_function(iterator):
            if iterator is not self._iterator:
                self._iterator, self.batches = iterator, 0
                if self._pre_read > 0:  # the earlier epochs' batches, in a run that keeps its iterator
                    skip_batches(iterator, self._pre_read)
                    self.batches, self._pre_read = self._pre_read, 0
            steps = steps_of_call(self.model, iterator)
            if self.skip_steps > 0:
                if steps > self.skip_steps:
                    raise ValueError(
                        f"The backup was saved {self.resume.steps_done} steps into epoch {self.epoch + 1}, which "
                        f"is not a whole number of this fit's host calls of {steps} steps "
                        "(steps_per_execution / sink_size). Resume with the steps per call of the run that "
                        "saved it."
                    )
                skip_batches(iterator, steps)
                self.batches += steps
                self.skip_steps -= steps
                self.skipping = True
                return {}
            self.skipping = False
            logs = original(iterator)
            self.batches += steps
            return logs

        self.model.train_function = train_function
        self._wrapper = train_function

    def close(self) -> None:
        """Puts back the model's own `train_function`."""
        if self._original is not None and getattr(self.model, "train_function", None) is self._wrapper:
            self.model.train_function = self._original
        self._original = None

    def on_epoch_begin(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch = -1

    def on_batch_end(self, batch: int) -> None:
        self.batch = batch

    def position(self, epoch_end: bool, optimizer_step=None, workers=None, replicas=None) -> Position:
        """Where a backup saved now resumes: after this step, or (`epoch_end`) at the next epoch's start."""
        if epoch_end:
            # The next epoch reads on from the same iterator, or from a fresh one.
            return Position(self.epoch + 1, 0, self.batches if self.keeps_iterator else 0,
                            optimizer_step, workers, replicas)
        return Position(self.epoch, self.batch + 1, self.batches, optimizer_step, workers, replicas)

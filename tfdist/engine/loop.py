"""The host call: what Keras's `fit`/`evaluate` call once per `steps_per_execution` steps.

Keras owns the epoch loop and calls `model.train_function(iterator)` once per
host call. tfdist's function runs up to `steps_per_execution` steps in one
`tf.while_loop` and then reads the metrics once, in cross-replica context, so
no per-replica value ever reaches Keras (the cause of keras-team/keras#20585),
and nothing but the loop counter and the next batch is carried through the
loop (Keras's own loop carries per-step outputs and fails under
MirroredStrategy with steps_per_execution > 1).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf


def _is_tf_iterator(iterator) -> bool:
    return isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator))


def make_host_function(model, step_fn: Callable, steps_per_call: int) -> Callable:
    """Returns `function(iterator) -> logs` running up to `steps_per_call` steps.

    Args:
        model: the Keras model (for its metrics and `run_eagerly`).
        step_fn: cross-replica callable taking one distributed batch.
        steps_per_call: steps per host call (Keras's `steps_per_execution`).

    The function raises `StopIteration` when the iterator is exhausted before
    the first step, as Keras's epoch iterator expects.
    """
    @tf.autograph.experimental.do_not_convert
    def one_step(iterator):
        step_fn(iterator.get_next())
        return tf.constant(1), model.get_metrics_result()

    @tf.autograph.experimental.do_not_convert
    def many_steps(iterator):
        def cond(i, optional):
            return tf.logical_and(i < steps_per_call, optional.has_value())

        def body(i, optional):
            step_fn(optional.get_value())
            following = tf.cond(
                i + 1 < steps_per_call,
                iterator.get_next_as_optional,
                lambda: optional,
            )
            return i + 1, following

        done, _ = tf.while_loop(cond, body, [tf.constant(0), iterator.get_next_as_optional()])
        return done, model.get_metrics_result()

    @tf.autograph.experimental.do_not_convert
    def on_data(data):
        step_fn(data)
        return model.get_metrics_result()

    run = one_step if steps_per_call == 1 else many_steps
    if not model.run_eagerly:
        run = tf.function(run, reduce_retracing=True)
        on_data = tf.function(on_data, reduce_retracing=True)

    def function(iterator):
        if not _is_tf_iterator(iterator):
            # train_on_batch / test_on_batch: a Python iterator of whole batches;
            # every replica sees the whole batch, as in Keras.
            logs = None
            for data in iterator:
                logs = on_data(data)
            return logs
        try:
            done, logs = run(iterator)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None
        if int(done) == 0:
            raise StopIteration
        return logs

    return function

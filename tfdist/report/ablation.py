"""Timed ablations of a training step: its forward-backward pass alone, its update alone, its exchange alone.

Where TensorFlow's profiler cannot run (the tasks of a multi-process job:
`tfdist.report.recorder.PROFILER_IN_JOBS`), the step report splits each
host call with these, measured once per report on this process's own
replicas:

* `compute`: the model's forward and backward pass on a batch of the step's
  shapes (zeros; a step's cost does not depend on the values), on every local
  replica (`strategy.run`), nothing reduced;
* `update`: the model's optimizer (a copy built from its config) applying zero
  gradients to copies of the trainable variables: the same update on the same
  shapes, without touching the model;
* `exchange_alone`: the step's gradient exchange with nothing else to do —
  tfdist's fused all-reduce (`tfdist.collectives.all_reduce_sum`, the step's
  bucket size and wire dtype) of buffers of the trainable variables' shapes,
  run by every task at the same host call, as `benchmarks/vs_ddp.py` times it.

Each is the median of `REPEATS` runs after one that traces.
"""

from __future__ import annotations

import statistics
import time

import tensorflow as tf

from tfdist import collectives
from tfdist._compat import keras as kc
from tfdist.report import flops as flops_lib

REPEATS = 5


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # traces
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _zeros(spec):
    return tf.zeros(spec.shape, spec.dtype)


def compute_seconds(model, per_replica_batch: int, element_spec=None) -> float | None:
    """Seconds of one forward and backward pass on every local replica at once; None where shapes are unknown."""
    specs = flops_lib.input_specs(model, element_spec)
    if specs is None:
        return None
    specs = tf.nest.map_structure(lambda s: flops_lib.with_batch(s, per_replica_batch), specs)
    strategy = model.distribute_strategy
    variables = model.trainable_variables

    def replica():
        x = tf.nest.map_structure(_zeros, specs)
        with tf.GradientTape() as tape:
            total = flops_lib.output_sum(model(x, training=True))
        grads = [g for g in tape.gradient(total, variables) if g is not None]
        return tf.add_n([tf.reduce_sum(tf.cast(tf.convert_to_tensor(g), tf.float32)) for g in grads])

    run = tf.function(lambda: strategy.run(replica), autograph=False)
    return _median_seconds(lambda: tf.nest.map_structure(
        lambda t: t.numpy(), strategy.experimental_local_results(run())))


def update_seconds(model, in_strategy_scope: bool = False) -> float | None:
    """Seconds of the model's optimizer update (a copy) on copies of its trainable variables; None without one.

    None too when called in a strategy's scope (`fit` inside `with strategy.scope()`): the copies would be
    the strategy's variables.
    """
    if in_strategy_scope:
        return None
    optimizer = kc.inner_optimizer(model.optimizer) if getattr(model, "optimizer", None) is not None else None
    if optimizer is None:
        return None
    with tf.device("/cpu:0" if not tf.config.list_logical_devices("GPU") else "/gpu:0"):
        copies = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=True) for v in model.trainable_variables]
        grads = [tf.zeros(v.shape, v.dtype) for v in copies]
    copy = type(optimizer).from_config(optimizer.get_config())
    copy.build(copies)
    apply = tf.function(lambda: copy.apply(grads, copies), autograph=False)
    return _median_seconds(lambda: (apply(), copies[0].numpy()))


def exchange_seconds(model) -> float | None:
    """Seconds of one fused all-reduce of the model's gradients across the job, with nothing else to do.

    Every task of the job must call it at the same point (it is a collective).
    """
    strategy = model.distribute_strategy
    options = getattr(strategy, "options", None)
    if options is None:
        return None
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    with tf.device(strategy.extended.worker_devices[0]):
        parts = [tf.Variable(tf.zeros(shape), trainable=False) for shape in shapes]

    def replica():
        sums = collectives.all_reduce_sum([p.read_value() for p in parts], options.bucket_bytes,
                                          options.allreduce_dtype)
        return tf.add_n([tf.reshape(t, [-1])[0] for t in sums])

    run = tf.function(lambda: strategy.run(replica), autograph=False)
    return _median_seconds(lambda: [t.numpy() for t in strategy.experimental_local_results(run())])


def measure(model, per_replica_batch: int, element_spec=None, with_exchange: bool = True,
            in_strategy_scope: bool = False) -> dict:
    """`{"compute", "update", "exchange_alone"}` seconds (None where not measurable), and `"cost_s"`."""
    began = time.perf_counter()
    out = {"compute": compute_seconds(model, per_replica_batch, element_spec),
           "update": update_seconds(model, in_strategy_scope),
           "exchange_alone": exchange_seconds(model) if with_exchange else None}
    out["cost_s"] = time.perf_counter() - began
    return out

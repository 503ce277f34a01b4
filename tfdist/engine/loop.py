"""The host call: what Keras's `fit`/`evaluate` call once per `steps_per_execution` steps.

Keras owns the epoch loop and calls `model.train_function(iterator)` once per
host call. tfdist's function runs up to `steps_per_execution` steps in one
`tf.while_loop` and then reads the metrics once, in cross-replica context, so
no per-replica value ever reaches Keras (the cause of keras-team/keras#20585),
and nothing but the loop counter and the next batch is carried through the
loop (Keras's own loop carries per-step outputs and fails under
MirroredStrategy with steps_per_execution > 1).

This on-device loop is also data sinking (`sink_size`): the host hands over k
steps' worth of input and hears back once per k steps. `sink_size=k` sets the
model's `steps_per_execution` to k at compile (`tfdist.keras_integration`);
`sink_size="epoch"` tags each epoch's iterator with the epoch's length
(`STEPS_PER_CALL_ATTR`), which the host function reads as its loop bound, so
the bound is a tensor and changing it never retraces. `run_steps` is the loop
itself, for strategies that schedule their own calls (parameter server: one
closure of k steps per `ClusterCoordinator.schedule`). Where one input
pipeline in this process feeds every replica, Keras's epoch iterator hands
the function a `tfdist.data.sinking.SunkIterator` instead: a call's batches
arrive as one or a few windows per replica, staged on its device while the
previous call ran (`run_chunks`, `sinking.WindowStage`), not one `get_next`
per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Union

import keras
import tensorflow as tf

from tfdist import collectives
from tfdist._compat import keras as kc
from tfdist.data.sinking import SunkIterator, WindowStage, replica_rows
from tfdist.data.transfer import TransferManager
from tfdist.engine import step as step_lib
from tfdist.engine.custom import CustomTrainStep
from tfdist.engine.step import TrainStep, global_batch_size

# Attribute set on a distributed iterator to give the number of steps a host
# call runs on it (sink_size="epoch"); read by the host function.
STEPS_PER_CALL_ATTR = "_tfdist_steps_per_call"

# Name scope of the ops that cut a step's batch out of a chunk (`run_chunks`; counted by tests).
CUT_BATCH_SCOPE = "cut_batch"

# The bound used when a whole-epoch call has no tagged length: run until the
# iterator is exhausted.
UNTIL_EXHAUSTED = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class HostLoop:
    """Who drives a strategy's epochs: Keras's own `fit`, or tfdist's host loop.

    Args:
        name: str, for messages and `repr` only.
        fit, evaluate, predict: Optional callables with the signature of the
            Keras `Model` method (model first) that replace it for models under
            the strategy; `None` (the default) keeps Keras's method, which then
            calls the engine's host function (`make_host_function`) once per
            `steps_per_execution` steps.
    """

    name: str
    fit: Optional[Callable] = None
    evaluate: Optional[Callable] = None
    predict: Optional[Callable] = None

    def method(self, name: str) -> Optional[Callable]:
        """The replacement of the Keras `Model` method `name`, or None to keep Keras's."""
        return getattr(self, name)


# Keras's epoch loop calls `make_host_function`'s function: every synchronous strategy.
KERAS_FIT = HostLoop("keras")


def _is_tf_iterator(iterator) -> bool:
    return isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator))


def run_steps(
    iterator,
    step_fn: Callable,
    max_steps: Union[int, tf.Tensor],
    odd_batch_fn: Optional[Callable] = None,
) -> tf.Tensor:
    """Runs `step_fn` on up to `max_steps` batches of `iterator` in one `tf.while_loop`.

    The building block of data sinking: call it inside a `tf.function` (one
    host call, or one closure scheduled on a parameter-server worker). Only the
    counter and the next batch are carried through the loop; whatever
    `step_fn` returns is dropped, so it must keep its results in variables
    (metrics, optimizer state). No batch is fetched that is not run: the last
    iteration does not ask for a following batch.

    Args:
        iterator: a `tf.data.Iterator` or `tf.distribute.DistributedIterator`.
        step_fn: callable taking one batch (a distributed batch for a
            distributed iterator), called in the caller's context.
        max_steps: int or scalar int32 tensor, >= 1. Steps to run at most; a
            tensor lets one trace serve every bound.
        odd_batch_fn: Optional callable like `step_fn`, run instead of it on
            a batch whose size differs from the call's first batch (the
            short last batch of an epoch). Its collectives are traced apart
            from `step_fn`'s, so each collective instance sees one shape per
            call (see `make_host_function`).

    Returns:
        Scalar int32 tensor: the steps run (fewer than `max_steps` when the
        iterator ran out; 0 when it was already exhausted).

    Example:

    ```python
    @tf.function
    def closure(iterator):
        return tfdist.engine.loop.run_steps(iterator, train_step, 32)
    ```
    """
    max_steps = tf.convert_to_tensor(max_steps, tf.int32)

    def cond(i, optional):
        return tf.logical_and(i < max_steps, optional.has_value())

    first = iterator.get_next_as_optional()
    if odd_batch_fn is not None:
        first_size = tf.cond(
            first.has_value(), lambda: global_batch_size(first.get_value()), lambda: tf.constant(0)
        )

    def run_step(data):
        if odd_batch_fn is None:
            step_fn(data)
        else:
            _run_by_batch_size(step_fn, odd_batch_fn, data, global_batch_size(data), first_size)

    def body(i, optional):
        run_step(optional.get_value())
        following = tf.cond(
            i + 1 < max_steps,
            iterator.get_next_as_optional,
            lambda: optional,
        )
        return i + 1, following

    done, _ = tf.while_loop(cond, body, [tf.constant(0), first])
    return done


def _run_by_batch_size(step_fn: Callable, odd_batch_fn: Callable, data, size, first_size) -> None:
    """`step_fn(data)` when the batch has the call's first size, else `odd_batch_fn(data)` (its own collectives)."""

    def run(fn):
        def branch():
            fn(data)
            return tf.constant(True)

        return branch

    tf.cond(tf.equal(size, first_size), run(step_fn), run(odd_batch_fn))


def run_chunks(
    windows,
    spec,
    strategy,
    step_fn: Callable,
    max_steps: Union[int, tf.Tensor],
    odd_batch_fn: Optional[Callable] = None,
    one_chunk_per_call: bool = False,
    stage=None,
) -> tf.Tensor:
    """`run_steps` on sunk input (`tfdist.data.sinking`): the same steps on the same batches.

    Each window (up to k batches' rows for every replica, split on the host as
    `tf.distribute` splits each batch: `sinking.replica_windows`) reaches the
    replicas' devices through `stage` (a `sinking.WindowStage`: taken from
    the devices where the previous call staged it, and the next one staged
    while this one's steps run); an inner loop runs its steps, each cutting
    its batch out of every replica's window with one gather per leaf, on the
    window's device (and trimming the padding where batches differ in shape).

    Args:
        windows: a `tf.data` iterator over `SunkInput.windows`.
        spec: the batch's element spec (its structure and static shapes).
        strategy: the model's strategy (all its replicas in this process).
        step_fn, max_steps, odd_batch_fn: as `run_steps`. Windows never span
            two calls, so a call ends at a window boundary.
        one_chunk_per_call: a call's batches are one window (`SunkInput.chunk`
            at least its steps per call): one fetch, no outer loop.
        stage: the `sinking.WindowStage` of `windows`' elements (built).
    """
    from tfdist.data import sinking

    max_steps = tf.convert_to_tensor(max_steps, tf.int32)
    leaves = tf.nest.flatten(spec)
    replicas = strategy.num_replicas_in_sync
    if sinking.fixed_shapes(spec):
        odd_batch_fn = None  # every batch has the spec's one shape

    def local(element):
        """Each replica's `(parts, sizes)` (`sinking.unpack_window`)."""
        return [sinking.unpack_window(w, spec, replicas) for w in element]

    def batch_at(parts, j, replica: int):
        """A replica's batch `j` of its window, at the batch's own shape, cut where the window was staged."""
        staged = stage.devices is not None
        with tf.name_scope(CUT_BATCH_SCOPE), tf.device(stage.devices[replica]) if staged else contextlib.nullcontext():
            return tf.nest.pack_sequence_as(spec, [cut(part, leaf, j) for part, leaf in zip(parts, leaves)])

    def cut(part, leaf, j):
        rows, counts, shapes = part
        t = tf.gather(rows, j)
        if shapes is not None:
            shape = tf.gather(shapes, j)
            first = [tf.gather(counts, j)] if counts is not None else [-1]
            t = tf.slice(t, tf.zeros_like(shape), tf.concat([first, shape[1:]], axis=0))
        elif counts is not None:
            rank = leaf.shape.rank
            t = tf.slice(t, [0] * rank, tf.stack([tf.gather(counts, j)] + [-1] * (rank - 1)))
        # Static where `tf.distribute` would know it: an evenly split static batch (no counts).
        t.set_shape([rows.shape[1] if counts is None else None] + leaf.shape.as_list()[1:])
        return t

    def run_window(i, element, first_size):
        """Runs the steps of `element` (up to `max_steps - i`); returns how many."""
        windows_of = local(element)
        n = tf.minimum(tf.shape(windows_of[0][0][0][0])[0], max_steps - i)

        def step(j):
            data = strategy.experimental_distribute_values_from_function(
                lambda ctx: batch_at(windows_of[ctx.replica_id_in_sync_group][0], j, ctx.replica_id_in_sync_group)
            )
            if odd_batch_fn is None:
                step_fn(data)
            else:
                _run_by_batch_size(step_fn, odd_batch_fn, data, tf.gather(windows_of[0][1], j), first_size)
            return (j + 1,)

        (ran,) = tf.while_loop(lambda j: j < n, step, (tf.constant(0),))
        return ran

    def global_size(element):
        return local(element)[0][1][0] if odd_batch_fn is not None else tf.constant(0)

    if one_chunk_per_call:
        # The common case (a call's batches fit one window): one window, no outer
        # loop. Nothing staged and nothing to fetch raises OutOfRangeError
        # before any step runs: every step is inside the loop over the window.
        element = stage.take(windows)
        stage.stage_next(windows)  # the next call's window, copied while these steps run
        return run_window(tf.constant(0), element, global_size(element))

    has_first, first = stage.take_optional(windows)
    first_size = tf.cond(has_first, lambda: global_size(first), lambda: tf.constant(0))

    def cond(i, has, *_):
        return tf.logical_and(i < max_steps, has)

    def body(i, has, *flat):
        element = [list(flat[k:k + len(specs)]) for k, specs in zip(_offsets(stage), stage.element_spec)]
        stage.stage_next(windows)  # the next window, copied while these steps run
        ran = run_window(i, element, first_size)
        following = tf.cond(
            i + ran < max_steps,
            lambda: _flat_optional(stage.take_optional(windows)),
            lambda: _flat_optional((tf.constant(False), element)),
        )
        return (i + ran, *following)

    done, *_ = tf.while_loop(cond, body, [tf.constant(0), has_first, *[t for w in first for t in w]])
    return done


def _offsets(stage) -> list:
    """Where each replica's window starts in the flat loop variables (after the step count and the flag)."""
    offsets, k = [], 0
    for specs in stage.element_spec:
        offsets.append(k)
        k += len(specs)
    return offsets


def _flat_optional(pair) -> list:
    has, element = pair
    return [has] + [t for window in element for t in window]


def split_batch(strategy, data):
    """A whole batch as a distributed batch: each replica's rows, as `fit` splits a global batch.

    Rows are cut as `tf.distribute` cuts a dataset's batch (`replica_rows`:
    15 over 2 replicas is 8 and 7, 1 over 2 is 1 and 0), by the replica's id
    in the sync group, so across workers the batch is the global one, as
    `fit`'s NumPy input is. `None` parts (no `y`, no `sample_weight`) stay
    `None`.

    Args:
        strategy: the model's `tf.distribute.Strategy`.
        data: a batch: a nest of tensors, NumPy arrays, `tf.RaggedTensor`s or
            `tf.SparseTensor`s that share their first dimension, and `None`s.

    Returns:
        The distributed batch `strategy.run` hands out, or `data` itself with
        one replica.

    Example:

    ```python
    distributed = split_batch(model.distribute_strategy, (x, y, None))
    model.distribute_strategy.run(model.test_step, args=(distributed,))
    ```
    """
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return data

    def replica_batch(ctx):
        replica = ctx.replica_id_in_sync_group

        def cut(part):
            if part is None:
                return None
            if isinstance(part, tf.SparseTensor):
                lo, hi = replica_rows(part.dense_shape[0], replica, replicas)
                start = tf.concat([[lo], tf.zeros_like(part.dense_shape[1:])], axis=0)
                size = tf.concat([[hi - lo], part.dense_shape[1:]], axis=0)
                return tf.sparse.slice(part, start, size)
            if isinstance(part, tf.RaggedTensor):
                lo, hi = replica_rows(part.nrows(), replica, replicas)
                return part[lo:hi]
            part = tf.convert_to_tensor(part)
            lo, hi = replica_rows(tf.shape(part)[0], replica, replicas)
            rows = part[lo:hi]
            if tf.executing_eagerly():
                return rows
            # A share's size unknown when traced, as a distributed dataset's
            # is: Keras's loss of a share traced as empty (`(0, ...)`, one row
            # over 2 replicas) is NaN, where traced as `(None, ...)` it adds nothing.
            return tf.compat.v1.placeholder_with_default(rows, [None] + rows.shape[1:])

        return tf.nest.map_structure(cut, data)

    return strategy.experimental_distribute_values_from_function(replica_batch)


def gathers_rows(model) -> bool:
    """Whether a step may all-gather sparse rows whose count follows the batch (an Embedding)."""
    return any(
        isinstance(layer, keras.layers.Embedding) and layer.trainable for layer in kc.all_layers(model)
    )


def _sinks_whole_epochs(model) -> bool:
    options = getattr(model.distribute_strategy, "options", None)
    return getattr(options, "sink_size", None) == "epoch"


def packed_metrics_result(model) -> dict:
    """Cross-replica context: `model.get_metrics_result()` with one all-reduce for every metric variable.

    Keras's read sums each `on_read` metric variable over the replicas with a
    collective of its own (2 for a Mean, 4 with an accuracy); across workers
    each is a round trip. The replicas' values are summed in one buffer
    instead; metrics that cannot share one (`step.metric_variables`) are read
    as Keras reads them.
    """
    variables = step_lib.metric_variables(model)
    if variables is None:
        return model.get_metrics_result()
    strategy = model.distribute_strategy

    def replica_fn():
        state = step_lib.local_metric_state(variables)
        # One buffer, summed as the gradients are (within each worker first where that is hierarchical).
        return collectives.all_reduce_sum([state], bucket_bytes=0)[0]

    summed = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    return step_lib.metrics_result_from_state(model, variables, summed)


def make_host_function(model, step_fn: Callable, steps_per_call: int) -> Callable:
    """Returns `function(iterator) -> logs` running up to `steps_per_call` steps.

    Args:
        model: the Keras model (for its metrics, `run_eagerly` and strategy).
        step_fn: cross-replica callable taking one distributed batch.
        steps_per_call: steps per host call (Keras's `steps_per_execution`).
            Under `sink_size="epoch"` the iterator's tagged epoch length
            (`STEPS_PER_CALL_ATTR`) is used instead, or, untagged, every
            remaining batch.

    The function raises `StopIteration` when the iterator is exhausted before
    the first step, as Keras's epoch iterator expects. Its `traced_graphs`
    attribute lists the graphs traced for it, newest last; `window_stages()`
    the `tfdist.data.sinking.WindowStage`s of sunk input it made.
    """
    whole_epochs = _sinks_whole_epochs(model)

    # An Embedding's gradient rows are all-gathered with a count that follows
    # the batch, and TensorFlow fixes each collective instance's shape for the
    # length of a host call ("Shape mismatch in the collective instance"). A
    # call that holds full batches and the epoch's short last batch runs the
    # short one through a second copy of the step, with collectives of its
    # own. Costs a second trace, for models with an Embedding only.
    odd_batch_fn = step_fn if (steps_per_call > 1 or whole_epochs) and gathers_rows(model) else None

    # Across processes each metric variable read is an all-reduce of its own:
    # reads are packed into one (`metrics_result`), and where a step's metrics
    # are read after every step, its state rides in the gradients' all-reduce.
    across_processes = step_lib.reads_metrics_across_processes(model.distribute_strategy)
    if type(step_fn) is TrainStep:  # a custom train_step updates its metrics after its apply
        step_fn.metrics_ride = across_processes and steps_per_call == 1 and not whole_epochs

    def metrics_result():
        result = model.get_metrics_result() if not across_processes else packed_metrics_result(model)
        logs = getattr(step_fn, "logs", None)
        return result if logs is None else logs.result_or(result)

    # The graphs traced for this function, newest last (for tools and tests
    # that count what one call runs: `function.traced_graphs`).
    traced_graphs = []

    @tf.autograph.experimental.do_not_convert
    def many_steps(iterator, max_steps):
        traced_graphs.append(tf.compat.v1.get_default_graph())
        done = run_steps(iterator, step_fn, max_steps, odd_batch_fn)
        return done, metrics_result()

    # One function and window stage per batch structure of sunk input (`tfdist.data.sinking`):
    # {structure: (function, stage)}. Both outlive a pass over the data: the stage's buffers
    # on the devices are the function's captures, and a new pass only empties them.
    sunk_functions: dict = {}

    def sunk_steps(iterator, max_steps):
        spec, one_chunk = iterator.spec, iterator.one_chunk_per_call
        strategy = model.distribute_strategy
        windows, new_pass = iterator.windows(strategy.num_replicas_in_sync)
        key = (repr(tf.nest.map_structure(lambda _: None, spec)), tuple(tf.nest.flatten(spec)), one_chunk,
               tuple(tf.nest.flatten(windows.element_spec)))
        if key not in sunk_functions:
            # Each replica's window staged on its device, one transfer per window and replica,
            # unless the step option `transfer` is off (`TransferManager`).
            staged = TransferManager.from_options(strategy.options).enabled
            stage = WindowStage(windows.element_spec, strategy.extended.worker_devices if staged else None)
            stage.build()

            @tf.autograph.experimental.do_not_convert
            def sunk(windows, max_steps):
                traced_graphs.append(tf.compat.v1.get_default_graph())
                done = run_chunks(
                    windows, spec, model.distribute_strategy, step_fn, max_steps, odd_batch_fn, one_chunk, stage
                )
                return done, metrics_result()

            sunk_functions[key] = (sunk if model.run_eagerly else tf.function(sunk, reduce_retracing=True), stage)
        function, stage = sunk_functions[key]
        if new_pass:
            stage.restart()
        return function(windows, max_steps)

    @tf.autograph.experimental.do_not_convert
    def one_step(iterator, max_steps):
        # One step per call: no while loop (its Enter/Exit/NextIteration nodes,
        # one per loop-invariant variable, and a second get_next were ~160
        # executed nodes of overhead per call, issue 16).
        traced_graphs.append(tf.compat.v1.get_default_graph())
        optional = iterator.get_next_as_optional()
        rode = []

        def run():
            state = step_fn(optional.get_value())
            if isinstance(step_fn, TrainStep) and step_fn.ride_variables is not None:
                rode.append(state)
                return tf.constant(1), state
            return tf.constant(1), tf.zeros([0])

        # The untaken branch's state is never read: its call raises StopIteration.
        done, state = tf.cond(
            optional.has_value(), run, lambda: (tf.constant(0), tf.zeros([rode[0].shape[0] if rode else 0]))
        )
        if rode:
            return done, step_lib.metrics_result_from_state(model, step_fn.ride_variables, state)
        return done, metrics_result()

    # train_on_batch / test_on_batch hand the host function whole batches.
    # Each is split over the replicas as `fit` splits a batch: with every
    # replica on the whole batch, an Embedding's sparse gradient carried each
    # row once per replica (at 1/N), and Adam's second moment summed N
    # squares of g/N for a row instead of one of g (0.139 off one device after
    # one step on 2 replicas; dense gradients were unaffected). The parameter
    # server's host loop is its own.
    split = getattr(model.distribute_strategy, "host_loop", KERAS_FIT) is KERAS_FIT

    @tf.autograph.experimental.do_not_convert
    def on_data(data):
        step_fn(split_batch(model.distribute_strategy, data) if split else data)
        return metrics_result()

    # Also for one step per call: with a plain `get_next()` the ops of the step
    # that do not depend on the batch (the optimizer's iteration count) still
    # run when the iterator is exhausted, so on input of unknown length Keras
    # counts one step too many per epoch (42 for 40 steps over 2 epochs), which
    # shifts Adam's bias correction and learning-rate schedules.
    run = one_step if steps_per_call == 1 and not whole_epochs else many_steps
    if not model.run_eagerly:
        run = tf.function(run, reduce_retracing=True)
        on_data = tf.function(on_data, reduce_retracing=True)

    steps_constant = tf.constant(steps_per_call, tf.int32)

    def function(iterator):
        sunk = isinstance(iterator, SunkIterator)
        if not sunk and not _is_tf_iterator(iterator):
            # train_on_batch / test_on_batch: a Python iterator of whole
            # batches, each split over the replicas (`on_data`).
            logs = None
            for data in iterator:
                logs = on_data(data)
            return logs
        steps = steps_per_call
        bound = steps_constant
        if sunk:
            # The chunks were laid out for this many steps per call (no chunk spans two).
            steps = iterator.steps_per_call
            bound = tf.constant(steps, tf.int32)
        elif whole_epochs:
            steps = getattr(iterator, STEPS_PER_CALL_ATTR, UNTIL_EXHAUSTED)
            bound = tf.constant(steps, tf.int32)
        try:
            if sunk:
                done, logs = sunk_steps(iterator, bound)
            else:
                done, logs = run(iterator, bound)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None
        except tf.errors.DeadlineExceededError as error:
            # A multi-worker strategy names its collective_timeout option and the job's tasks.
            better = model.distribute_strategy.explain_collective_error(error)
            if better is None:
                raise
            raise better from error
        except tf.errors.InternalError as error:
            if "Missing 1-th output" not in str(error) or "BackpropFilter" not in str(error):
                raise
            replicas = model.distribute_strategy.num_replicas_in_sync
            raise ValueError(
                "TensorFlow's oneDNN kernel for the gradient of a convolution with a bias failed on "
                "an empty batch (InternalError 'Missing 1-th output from ...BackpropFilter'; plain "
                "Keras on one device fails the same way on an empty batch). A replica gets an empty "
                f"share when a batch has fewer examples than the {replicas} replicas, as the last "
                "batch of an epoch can: tf.distribute gives each replica ceil(batch / replicas) "
                "rows in turn, and the last replicas what is left. Choose a batch size that leaves "
                f"every replica at least one example (a last batch of {replicas} or more, or none), "
                "pass drop_remainder=True to a tf.data pipeline's batch, or set the environment "
                "variable TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported."
            ) from error
        except tf.errors.InvalidArgumentError as error:
            if "Shape mismatch in the collective instance" not in str(error) or steps == 1:
                raise
            raise ValueError(
                f"A host call of {steps} steps ran batches of more sizes than it has step copies "
                "through a collective whose shape follows the batch: the all-gather of a sparse "
                "gradient (an Embedding's rows, or any gradient TensorFlow returns as "
                "IndexedSlices). TensorFlow fixes a collective's shape per host call; tfdist runs a "
                "call's first batch size and, for models with an Embedding, one other size (the "
                "epoch's short last batch) through separate copies of the step, no more. Give "
                "batches fixed sizes (`padded_batch` to a fixed length, `drop_remainder=True`), or "
                "set sink_size=1 (steps_per_execution=1) for this model. TensorFlow aborted the "
                "collectives of this process: restart it before training again."
            ) from error
        if int(done) == 0:
            raise StopIteration
        return logs

    function.traced_graphs = traced_graphs
    # The window stages of sunk input (`tfdist.data.sinking.WindowStage`), one per batch structure.
    function.window_stages = lambda: [stage for _, stage in sunk_functions.values()]
    return function


# ---------------------------------------------------------------------------
# What Keras's make_train_function / make_test_function build for a tfdist model.
# ---------------------------------------------------------------------------


def model_features(model) -> list[str]:
    """The features a compiled model uses that a strategy may not run, in checking order.

    The vocabulary of `TfdistStrategy.unsupported(feature, model)`.
    """
    optimizer = model.optimizer
    options = model.distribute_strategy.options
    used = []
    if options.accumulation_steps > 1:
        used.append("accumulation_steps")
    if options.jit_compile or model.jit_compile is True:
        used.append("jit_compile")
    if any(getattr(layer, "synchronized", False) for layer in kc.all_layers(model)):
        used.append("synchronized_batchnorm")
    used.append("step_options")
    if kc.has_custom_train_step(model):
        used.append("custom_train_step")
    if kc.is_loss_scale_optimizer(optimizer):
        used.append("loss_scale_optimizer")
    if kc.keras_accumulation_steps(optimizer):
        used.append("keras_accumulation")
    if getattr(kc.inner_optimizer(optimizer), "use_ema", False):
        used.append("ema")
    used.append("optimizer")
    if model.run_eagerly:
        used.append("run_eagerly")
    return used


def validate_compiled_model(model) -> None:
    """Raises `NotImplementedError` for a compile configuration the strategy does not run.

    Asks the strategy about each feature the model uses
    (`TfdistStrategy.unsupported`); the first refusal is raised with the
    strategy's message, which names the combination and the fix.
    """
    optimizer = model.optimizer
    if optimizer is None:
        return
    strategy = model.distribute_strategy
    options = strategy.options
    keras_steps = kc.keras_accumulation_steps(optimizer)
    if keras_steps and options.accumulation_steps > 1:
        raise NotImplementedError(
            "Gradient accumulation is set twice: Optimizer(gradient_accumulation_steps="
            f"{keras_steps}) and the strategy option accumulation_steps="
            f"{options.accumulation_steps}. Set one of them."
        )
    inner = kc.inner_optimizer(optimizer)
    if keras_steps and getattr(inner, "use_ema", False) and getattr(inner, "ema_overwrite_frequency", None):
        # Keras overwrites the weights on every micro-step of such a window, so
        # the window's later micro-batches run on the average: no update of the
        # window's end can give that.
        raise NotImplementedError(
            f"Optimizer(use_ema=True, ema_overwrite_frequency={inner.ema_overwrite_frequency}) with "
            f"gradient_accumulation_steps={keras_steps} is not supported under a tfdist strategy: Keras "
            "overwrites the weights with their average on the micro-steps that only accumulate, so "
            "the window's later micro-batches run on the average. Use the strategy option "
            f"accumulation_steps={keras_steps} instead (the average then moves once per update, as for "
            f"a {keras_steps}-times larger batch), or ema_overwrite_frequency=None."
        )
    for feature in model_features(model):
        reason = strategy.unsupported(feature, model)
        if reason is not None:
            raise NotImplementedError(reason)


def make_train_function(model):
    """The function Keras's `fit` calls per host call, for a tfdist model."""
    validate_compiled_model(model)
    if kc.has_custom_train_step(model):
        # The user's own train_step runs per replica, as in Keras; its
        # optimizer.apply runs the engine's reduction and update.
        step_fn = CustomTrainStep(model)
    else:
        step_fn = TrainStep(model)
    return make_host_function(model, step_fn, model.steps_per_execution)


def make_test_function(model):
    """The function Keras's `evaluate` calls per host call, for a tfdist model."""
    strategy = model.distribute_strategy
    logs = step_lib.StepLogs(strategy) if kc.has_custom_test_step(model) else None

    def step_fn(data):
        if logs is None:
            # Keras's test_step, with the loss logged as the train step logs it.
            step_lib.run_weighing_output_losses(
                strategy, model, lambda batch, share: step_lib.test_step(model, batch, share), data, with_share=True
            )
            return
        logs.record(step_lib.run_weighing_output_losses(strategy, model, model.test_step, data))

    step_fn.logs = logs
    return make_host_function(model, step_fn, model.steps_per_execution)

"""tfdist bound to Keras: the hooks that give models compiled under a tfdist strategy its step.

Keras owns the loop (epochs, callbacks, progress bar, history); tfdist owns the
step. This module is the top layer: it installs tfdist's train and test
functions on models whose strategy is a tfdist strategy, and leaves every
other model exactly as Keras made it — each hook first checks the model's
strategy and otherwise calls the original. It decides *what* the hooks do;
*where* they attach, and every other private Keras or TensorFlow API, is in
`tfdist._compat` (version-gated, each workaround naming its upstream issue).

The main upstream issues worked around here:

* keras-team/keras#20585 and tensorflow/tensorflow#72388: Keras 3 `fit` fails
  under MultiWorkerMirroredStrategy with "Attempt to convert a value
  (PerReplica...)" — first in Keras's `_maybe_symbolic_build` (replaced here by
  one replica's share of the first batch) and then in its train function
  (tfdist's, in `tfdist.engine.loop`, reduces every per-replica value itself),
  so Keras never sees one.
* Keras 3 `compile(steps_per_execution>1)` under MirroredStrategy fails with
  "You must feed a value for placeholder tensor 'while/cond/Placeholder'": the
  loop in `tfdist.engine.loop` carries no per-step outputs through the
  `tf.while_loop` and reads the metrics once after it.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import checkpointing
from tfdist._compat import keras as kc
from tfdist._compat import patches
from tfdist.data import sinking
from tfdist.strategies.base import is_tfdist_strategy


def _is_tfdist_model(model) -> bool:
    return is_tfdist_strategy(kc.model_strategy(model))


# ---------------------------------------------------------------------------
# Installation: the patched Trainer methods.
# ---------------------------------------------------------------------------


def _check_compile_scope(model) -> None:
    """Raises if a tfdist model is compiled outside its scope, or vice versa."""
    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    built_under = kc.model_strategy(model)
    if is_tfdist_strategy(current) and built_under is not current:
        where = (
            "outside any strategy scope"
            if built_under is None
            else f"under a different strategy ({built_under!r})"
        )
        raise ValueError(
            f"The model {model.name!r} was built {where} and is being compiled "
            f"inside the scope of {current!r}. Its variables were not created by "
            "this strategy, so they are not replicated and cannot be trained by it. "
            "Build the model inside the same scope you compile it in:\n"
            "    with strategy.scope():\n"
            "        model = build_model()\n"
            "        model.compile(...)\n"
            "The model was left as it was (not compiled)."
        )
    if is_tfdist_strategy(built_under) and current is not built_under:
        raise ValueError(
            f"The model {model.name!r} was built inside the scope of {built_under!r} "
            "but is being compiled outside it, so its optimizer would not be "
            "distributed. Call `model.compile(...)` inside `with strategy.scope():`. "
            "The model was left as it was (not compiled)."
        )


def _check_one_process_strategy(model) -> None:
    """Refuses a strategy of one process in a job a launcher started several processes of.

    `mirrored`, `central_storage` and the one-host sharded optimizer train on
    this process's devices only: under `tfdist launch --workers 2` (TF_CONFIG
    of 2 training tasks) or `srun -n 2`, every process trained its own copy on
    the whole input and wrote the same checkpoints, and the job exited 0. A
    strategy of several processes (multi_worker, parameter_server) passes;
    `multi_worker` under `srun` without `cluster="slurm"` is one local
    process, and is refused too.
    """
    strategy = kc.model_strategy(model)
    if not is_tfdist_strategy(strategy):
        return
    if strategy.spans_processes():
        return
    from tfdist import cluster as cluster_lib

    tasks, source = 0, ""
    if os.environ.get("TF_CONFIG", "").strip():
        try:
            config = cluster_lib.parse_tf_config()
        except cluster_lib.ClusterConfigError:
            return  # a multi-process strategy would name what is wrong with it
        if config.task_type in ("chief", "worker"):
            tasks, source = config.num_workers, cluster_lib.ClusterSource.of().label
    elif os.environ.get("SLURM_PROCID") is not None and os.environ.get("SLURM_STEP_NUM_TASKS", "1").isdigit():
        tasks, source = int(os.environ["SLURM_STEP_NUM_TASKS"]), "srun (SLURM_STEP_NUM_TASKS)"
    if tasks <= 1:
        return
    raise ValueError(
        f"The strategy {strategy!r} trains on this process's devices only, but {source} describes a job of "
        f"{tasks} training processes: each would train its own copy of the model on the whole input and "
        "write the same checkpoints. For a job of several processes use "
        "tfdist.get_strategy('multi_worker') (or 'sharded_optimizer', which reads the same cluster; with "
        "srun pass cluster='slurm'); to train in one process, start the script alone (python train.py, "
        "without tfdist launch or srun -n). The model was left as it was (not compiled)."
    )


# Optimizers compiled with a tfdist model, and the model (one optimizer keeps the state of one model).
_optimizer_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_compile_optimizer(model, args, kwargs) -> None:
    """Refuses an optimizer created outside the strategy's scope, and one already training another model."""
    strategy = kc.model_strategy(model)
    optimizer = kwargs.get("optimizer", args[0] if args else None)
    if not is_tfdist_strategy(strategy) or not isinstance(optimizer, keras.optimizers.Optimizer):
        return
    label = f"The optimizer {optimizer.name!r} ({type(optimizer).__name__})"
    made_under = kc.optimizer_strategy(optimizer)
    if made_under is not strategy:
        where = ("outside any strategy scope" if not is_tfdist_strategy(made_under)
                 else f"in the scope of another strategy ({made_under!r})")
        raise ValueError(
            f"{label} was created {where}, and is being compiled with model {model.name!r} of {strategy!r}: "
            "its variables (the step counter, the learning rate) are not the strategy's, and fit would fail "
            "with 'Mixing different tf.distribute.Strategy objects'. Create the optimizer inside the scope:\n"
            "    with strategy.scope():\n"
            "        model = build_model()\n"
            "        model.compile(optimizer=keras.optimizers.Adam(...), ...)\n"
            "(or pass its name, optimizer='adam'). The model was left as it was (not compiled)."
        )
    previous = _optimizer_models.get(optimizer)
    other = previous() if previous is not None else None
    if other is not None and other is not model:
        mine = {id(v) for v in model.trainable_variables}
        theirs = {id(v) for v in other.trainable_variables}
        if not mine <= theirs:
            raise ValueError(
                f"{label} is already the optimizer of model {other.name!r}, and is being compiled with model "
                f"{model.name!r}, whose variables are not all {other.name!r}'s: an optimizer keeps its state "
                "(step counter, moments) for the variables it was built for, and the second model's fit "
                "would fail on an unknown variable. Give each model an optimizer of its own, e.g. "
                f"model.compile(optimizer=keras.optimizers.{type(optimizer).__name__}.from_config("
                "optimizer.get_config()), ...). The model was left as it was (not compiled)."
            )
    if model.trainable_variables or other is None:
        _optimizer_models[optimizer] = weakref.ref(model)


def _patched_compile(original):
    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        _check_compile_scope(self)
        _check_one_process_strategy(self)
        _check_compile_optimizer(self, args, kwargs)
        _check_jit_compile(self, kwargs.get("jit_compile", "auto"))
        result = original(self, *args, **kwargs)
        if _is_tfdist_model(self):
            from tfdist.engine.loop import validate_compiled_model

            validate_compiled_model(self)
            # A strategy that shapes the optimizer (the sharded optimizer) does so here.
            self.distribute_strategy.on_compile(self)
            apply_sink_size(self)
            if kc.keras_accumulation_steps(self.optimizer) or self.distribute_strategy.options.accumulation_steps > 1:
                from tfdist.engine.update import AccumulationState

                # An open accumulation window is saved with the optimizer.
                AccumulationState.attach(self.optimizer, self.trainable_variables if self.built else None)
            # A failed load_weights leaves the model as it was (Keras loads layer
            # by layer and raises at the end), with no tensor dumped in the error.
            kc.guard_load_weights(self, lambda: _snapshot_state(self), lambda saved: _restore_state(self, saved))
        return result

    return compile


def _state_variables(model) -> list:
    optimizer = model.optimizer
    extra = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return list(model.weights) + extra


def _snapshot_state(model) -> list:
    """Host copies of the model's weights and its optimizer's variables."""
    return [(v, np.array(v.numpy())) for v in _state_variables(model)]


def _restore_state(model, saved: list) -> None:
    for v, value in saved:
        v.assign(value)


def _patched_make(original, kind: str):
    @functools.wraps(original)
    def make(self, force=False):
        if not _is_tfdist_model(self):
            return original(self, force=force)
        attr = f"{kind}_function"
        if getattr(self, attr) is not None and not force:
            return getattr(self, attr)
        from tfdist.engine import loop

        builder = loop.make_train_function if kind == "train" else loop.make_test_function
        setattr(self, attr, builder(self))
        if kind == "train":
            # `tfdist launch --timeline` and `tfdist tune` trials record the steps (environment; else unchanged).
            from tfdist.report.recorder import from_environment

            setattr(self, attr, from_environment(self, getattr(self, attr)))
        return getattr(self, attr)

    return make


def _patched_predict_on_batch(original):
    @functools.wraps(original)
    def predict_on_batch(self, x):
        # Keras hands the whole batch to every replica and concatenates their
        # outputs, so with N replicas each row comes back N times (Keras 3.5 to
        # 3.15; `tf.distribute.MirroredStrategy` alone does the same). Under a
        # tfdist strategy whose replicas are all in this process, the batch is
        # split over them as `predict` splits it, and each row returned once.
        # An asynchronous strategy (the parameter server) has no global batch to split.
        strategy = kc.model_strategy(self)
        if (
            not _is_tfdist_model(self)
            or strategy.num_replicas_in_sync == 1
            or strategy.asynchronous
            or len(strategy.extended.worker_devices) != strategy.num_replicas_in_sync
        ):
            return original(self, x)
        leaves = keras.tree.flatten(x)
        if not leaves:
            return original(self, x)
        return self.predict(x, batch_size=max(int(np.shape(leaves[0])[0]), 1), verbose=0)

    return predict_on_batch


def _patched_symbolic_build(original):
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Upstream Keras (3.10 to 3.15) takes one batch from a fresh distributed
        # iterator only to learn the input's shapes, and averages it over
        # replicas with `strategy.reduce("MEAN")`. The average fails when the
        # global batch does not split evenly (30 over 4 replicas: "Inputs to
        # operation AddN ... must have the same size"), and the iterator, dropped
        # by `EpochIterator.reset()` while its multi-device prefetch is still
        # running, crashed TensorFlow (SIGSEGV) about once in 5 to 8 fits. The
        # build needs shapes and dtypes only: one replica's element spec has them.
        if not _is_tfdist_model(self):
            return original(self, iterator=iterator, data_batch=data_batch)
        # Keras builds an unbuilt optimizer here; a strategy that built it at compile learns of it.
        self.distribute_strategy.on_keras_build(self)
        if iterator is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        sink_input(self, iterator)
        strategy = self.distribute_strategy
        data_batch = kc.epoch_element_spec(iterator)
        if data_batch is None:
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues)
                    else v,
                    batch,
                )
                break
        with strategy.scope():
            kc.symbolic_build(self, data_batch)

    return _maybe_symbolic_build


def _patched_dtype_policy(original):
    @functools.wraps(original)
    def dtype_policy():
        # Layers built inside the scope of a tfdist strategy with
        # precision="mixed_..." get that policy, as if it were set globally;
        # outside the scope (or with precision="float32") Keras's global policy.
        from tfdist.precision import current_policy

        policy = current_policy()
        return policy if policy is not None else original()

    return dtype_policy


def patch_implementations() -> dict:
    """`{patch name: wrapper(original) -> replacement}` for the registry's integration patches.

    The registry (`tfdist._compat.patches`) declares each patch, what it
    changes and why; here is what the integration layer's wrappers do. The
    `tfdist` package hands this to the registry (`patches.add_implementations`).
    """
    return {
        "TensorFlowTrainer._maybe_symbolic_build": _patched_symbolic_build,
        # The default dtype policy, read by every layer at construction; the
        # precision option routes through it.
        "dtype_policy": _patched_dtype_policy,
        "Trainer.compile": _patched_compile,
        "TensorFlowTrainer.make_train_function": lambda original: _patched_make(original, "train"),
        "TensorFlowTrainer.make_test_function": lambda original: _patched_make(original, "test"),
        "TensorFlowTrainer.predict_on_batch": _patched_predict_on_batch,
        # optimizer.apply in custom training loops (and over variables held in shards).
        "BaseOptimizer.apply": _patched_optimizer_apply,
        "LossScaleOptimizer.apply": _patched_loss_scale_apply,
        # Each replica draws its own dropout masks and augmentations.
        "SeedGenerator.next": kc.seed_folding(is_tfdist_strategy),
        # Checkpointing's bookkeeping (exact resume, preemption) inside the host-loop/non-chief wrapper.
        "TensorFlowTrainer.fit": lambda original: _patched_fit(checkpointing.fit_bookkeeping(original)),
        "TensorFlowTrainer.evaluate": lambda original: _patched_ps(original, "evaluate"),
        "TensorFlowTrainer.predict": lambda original: _patched_ps(original, "predict"),
        "GradientTape.gradient": _patched_tape_gradient,
        **checkpointing.patch_implementations(),
        **kc.patch_implementations(),
    }


def install() -> None:
    """Installs the patches every tfdist strategy installs when it is created; safe to call again.

    Creating a tfdist strategy does this (`tfdist.strategies.base`); tests of
    the hooks themselves call it after `uninstall`.
    """
    patches.install()


def uninstall() -> None:
    """Undoes every installed patch of tfdist's registry: Keras and TensorFlow as they were."""
    patches.uninstall()


# ---------------------------------------------------------------------------
# Data sinking (tfdist.engine.loop): steps per host call.
# ---------------------------------------------------------------------------


def _check_jit_compile(model, given) -> None:
    """Raises if `compile(jit_compile=False)` contradicts the strategy's `jit_compile=True` option."""
    strategy = kc.model_strategy(model)
    if not is_tfdist_strategy(strategy) or given is not False or not strategy.options.jit_compile:
        return
    raise ValueError(
        "The strategy's jit_compile=True and compile(jit_compile=False) disagree; both say whether "
        "the training step is compiled with XLA. Pass only one of them (or True to both). The model "
        "was left as it was (not compiled)."
    )


def apply_sink_size(model) -> None:
    """Sets a tfdist model's `steps_per_execution` from its strategy's `sink_size`.

    `sink_size=k` is Keras's `steps_per_execution=k`: Keras's epoch iterator
    then hands tfdist's host function chunks of k steps, callbacks' per-batch
    hooks fire once per chunk and the progress bar counts k steps per chunk.
    Called at the end of `compile`. Raises `ValueError` when `compile` was
    given a different `steps_per_execution`.
    """
    sink_size = model.distribute_strategy.options.sink_size
    if sink_size is None:
        return
    given = model.steps_per_execution
    if given != 1 and given != sink_size:
        raise ValueError(
            f"The strategy's sink_size={sink_size!r} and compile(steps_per_execution={given}) "
            "disagree; both set the training steps per host call. Pass only one of them "
            "(or the same integer to both)."
        )
    if sink_size != "epoch":
        model.steps_per_execution = sink_size


class _StepsTaggedDataset:
    """Iterates a distributed dataset, tagging each iterator with the steps per call."""

    def __init__(self, dataset, steps: int):
        self._dataset = dataset
        self._steps = steps

    def __iter__(self):
        from tfdist.engine.loop import STEPS_PER_CALL_ATTR

        iterator = iter(self._dataset)
        setattr(iterator, STEPS_PER_CALL_ATTR, self._steps)
        return iterator


def sink_in_chunks(model, epoch_iterator, steps_per_call: int) -> bool:
    """Makes `epoch_iterator` hand the host function chunks of batches (`tfdist.data.sinking`).

    Where one input pipeline in this process feeds two or more replicas, the
    input is dense tensors and Keras distributed it from a `tf.data.Dataset`
    (its `TFEpochIterator`), each host call then fetches its `steps_per_call`
    batches in one or a few chunks instead of one batch per step. Returns
    whether it did; otherwise the distributed iterator stays.
    """
    strategy = model.distribute_strategy
    # One replica reads the dataset itself (`TfdistStrategy.experimental_distribute_dataset`):
    # its per-step `get_next` is already cheap, and chunks measured 3-5% slower there
    # (no faster since each chunk is split once: docs/data.md).
    if model.run_eagerly or strategy.num_replicas_in_sync < 2 or not strategy.feeds_every_replica_locally():
        return False
    dataset = sinking.source_of(kc.epoch_distributed_dataset(epoch_iterator))
    if dataset is None or not sinking.chunkable(dataset.element_spec):
        return False
    chunk = sinking.batches_per_chunk(
        dataset.element_spec, kc.epoch_batch_size(epoch_iterator), steps_per_call
    )
    sunk = sinking.SunkInput(dataset, steps_per_call, chunk)
    kc.set_epoch_iterator_factory(epoch_iterator, lambda: sunk)
    return True


def sink_input(model, epoch_iterator) -> None:
    """Sets how `epoch_iterator` feeds the host function: in chunks, and under `sink_size="epoch"` whole epochs.

    With more than one step per host call, batches reach the host function in
    chunks where they can (`sink_in_chunks`). Under `sink_size="epoch"` one
    host call runs a whole epoch of `epoch_iterator`:

    Keras's epoch iterator yields chunks of its `steps_per_execution` steps;
    setting it to the epoch's length makes it yield one chunk per epoch (so the
    progress bar jumps from 0 to the epoch's length and per-batch callbacks
    fire once per epoch), and each iterator it makes is tagged with that length
    for the host function's loop bound (`tfdist.engine.loop`). Uses the private
    `EpochIterator.steps_per_execution`, `num_batches` and `_get_iterator`
    (verified on Keras 3.15). Called from `fit` and `evaluate` for each epoch
    iterator, before the first batch is read.

    Raises:
        ValueError: the input's number of batches is unknown.
    """
    if getattr(epoch_iterator, "_tfdist_sinks", False):
        return
    if model.distribute_strategy.options.sink_size != "epoch":
        steps = model.steps_per_execution
        if isinstance(steps, int) and steps > 1:
            sink_in_chunks(model, epoch_iterator, steps)
        epoch_iterator._tfdist_sinks = True
        return
    steps = epoch_iterator.num_batches
    if not steps:
        raise ValueError(
            "sink_size='epoch' runs a whole epoch per host call and needs the number of "
            "steps in an epoch, but this input's length is unknown (tf.data pipelines "
            "with filter, group_by_window or bucket_by_length hide it). Pass "
            "steps_per_epoch= to fit (validation_steps= for validation data, steps= to "
            "evaluate), or state the dataset's length with "
            "dataset.apply(tf.data.experimental.assert_cardinality(n)), or use an "
            "integer sink_size. Received: an input of unknown length."
        )
    epoch_iterator.steps_per_execution = steps
    # A chunked call's bound is its SunkIterator's own steps per call; other
    # iterators are tagged with the epoch's length.
    if not sink_in_chunks(model, epoch_iterator, steps):
        get_iterator = kc.epoch_iterator_factory(epoch_iterator)
        kc.set_epoch_iterator_factory(epoch_iterator, lambda: _StepsTaggedDataset(get_iterator(), steps))
    epoch_iterator._tfdist_sinks = True


# ---------------------------------------------------------------------------
# `fit`: the strategy's own host loop (parameter server), chief-only writes of
# Keras callbacks (multi_worker).
# ---------------------------------------------------------------------------


def _redirected_callback(callback, strategy):
    """A copy of `callback` that writes under `strategy.write_dir`, or `callback` itself."""
    import copy


    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        clone = copy.copy(callback)
        clone.filepath = strategy.write_dir(callback.filepath)
        return clone
    if isinstance(callback, keras.callbacks.TensorBoard):
        clone = copy.copy(callback)
        clone.log_dir = strategy.write_dir(callback.log_dir)
        return clone
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        clone = copy.copy(callback)
        restore = clone.on_train_begin

        def on_train_begin(logs=None):
            # Restore from the chief's backup (every worker must resume at the
            # same epoch with the same weights), then write elsewhere.
            restore(logs)
            kc.redirect_backup_and_restore(clone, strategy.write_dir(callback.backup_dir))

        clone.on_train_begin = on_train_begin
        return clone
    return callback


def _patched_fit(original):
    """`fit` under a strategy whose host loop replaces Keras's, or that writes callback files from the chief only.

    A strategy whose host loop has its own `fit` (the parameter server's
    `ClusterCoordinator` loop) runs it. Under a strategy that
    `redirects_non_chief_writes` (multi_worker): TensorFlow's multi-worker
    guide has every worker save (saving may run collectives), but only the
    chief write where the user asked; the others write to a temporary
    directory that is removed afterwards. Keras 3's `ModelCheckpoint`,
    `TensorBoard` and `BackupAndRestore` know nothing of workers (tf-keras's
    did), so all workers would write the same files at once. On a non-chief
    worker `fit` gets copies of those callbacks that write under
    `strategy.write_dir(path)`; `BackupAndRestore` still restores from the
    chief's directory. Uses the private attributes of `BackupAndRestore`
    (`_weights_path`, `_training_metadata_path`, `_prev_*`), verified on Keras
    3.10 to 3.15. Every other model: Keras's own `fit`, called as given.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        replacement = _host_loop_method(self, "fit")
        if replacement is not None:
            return replacement(self, *args, **kwargs)
        strategy = kc.model_strategy(self)
        if not (is_tfdist_strategy(strategy) and strategy.redirects_non_chief_writes):
            return original(self, *args, **kwargs)
        try:
            if strategy.is_chief:
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            callbacks = bound.arguments.get("callbacks")
            if isinstance(callbacks, (list, tuple)):
                bound.arguments["callbacks"] = [_redirected_callback(c, strategy) for c in callbacks]
            try:
                return original(*bound.args, **bound.kwargs)
            finally:
                strategy.remove_write_dir(strategy.write_dir("x"))
        except (tf.errors.InternalError, tf.errors.InvalidArgumentError) as error:
            # Workers that ran different collectives (inputs of different lengths,
            # different options) get TensorFlow's error about instance keys and
            # data types; the strategy names the cause and the fix.
            better = strategy.explain_collective_error(error)
            if better is None:
                raise
            raise better from error

    return fit


# ---------------------------------------------------------------------------
# Parameter-server training (issue 5). Keras 3 dropped tf-keras's
# ClusterCoordinator support: under ParameterServerStrategy its `fit` fails
# with "To use this dataset, you need to pass this dataset to
# ClusterCoordinator.create_per_worker_dataset" (TFEpochIterator distributes
# the dataset on the chief), and its optimizer and GradientTape reject the
# ShardedVariable a variable partitioner creates ("'ShardedVariable' object has
# no attribute 'handle'"). The helpers below are what tfdist's host loop
# (`tfdist.engine.parameter_server`) needs from Keras internals, and the patches
# that let a custom training loop's tape and optimizer take a partitioned
# variable (`patch_training_of_sharded_variables`). Verified on Keras 3.5 to
# 3.15 and TensorFlow 2.16 to 2.21, except where a function says otherwise.
# ---------------------------------------------------------------------------


def _host_loop_method(model, method: str):
    strategy = kc.model_strategy(model)
    if not is_tfdist_strategy(strategy):
        return None
    return strategy.host_loop.method(method)


def _patched_ps(original, method: str):
    # The hook: a model under a strategy whose host loop replaces Keras's
    # (the parameter server's) runs it; every other model runs Keras's own
    # method, unchanged.
    @functools.wraps(original)
    def run(self, *args, **kwargs):
        replacement = _host_loop_method(self, method)
        if replacement is None:
            return original(self, *args, **kwargs)
        return replacement(self, *args, **kwargs)

    return run


def _patched_tape_gradient(original):
    # A tape whose sources hold no shards runs TensorFlow's own `gradient`,
    # called with exactly the caller's arguments.
    @functools.wraps(original)
    def gradient(self, target, sources, *args, **kwargs):
        flat = tf.nest.flatten(sources)
        sharded = [kc.holds_shards(s) for s in flat]
        if not any(sharded):
            return original(self, target, sources, *args, **kwargs)
        from tfdist.engine.step import regroup

        parts = [kc.variable_parts(s) if is_sharded_source else [s] for s, is_sharded_source in zip(flat, sharded)]
        grads = original(self, target, [p for ps in parts for p in ps], *args, **kwargs)
        out, i = [], 0
        for source, ps, is_sharded_source in zip(flat, parts, sharded):
            part_grads = grads[i : i + len(ps)]
            out.append(regroup(source, part_grads) if is_sharded_source else part_grads[0])
            i += len(ps)
        return tf.nest.pack_sequence_as(sources, out)

    return gradient


# ---------------------------------------------------------------------------
# optimizer.apply in a custom training loop
# ---------------------------------------------------------------------------

def _summing_replica_context():
    """The replica context of a custom loop under a synchronous tfdist strategy, else None.

    A synchronous strategy (its declaration: not `asynchronous`) has a global
    batch: its custom loops sum the replicas' gradients before the update
    (`_apply_summed`). Elsewhere (no strategy, another strategy, the
    parameter server's workers) Keras's own `apply` runs.
    """
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    strategy = tf.distribute.get_strategy()
    if not is_tfdist_strategy(strategy) or strategy.asynchronous:
        return None
    return tf.distribute.get_replica_context()


def _build_outside_the_trace(optimizer, variables: list) -> None:
    """Builds `optimizer` as Keras's `apply` does, but outside the traced step.

    State created while a `tf.function` traces makes its first call run under
    a `cond` on the state's initialisation, where MirroredStrategy's update
    fails: "You must feed a value for placeholder tensor 'cond/else/_1/cond/
    Placeholder'" (stock `tf.distribute` too). The replicas after the first
    find it built.
    """
    if not optimizer.built:
        with tf.init_scope(), kc.optimizer_name_scope(optimizer):
            optimizer.build(variables)
        optimizer.built = True


def _apply_in_custom_loop(optimizer, grads, variables, original) -> bool:
    """Replica context of a custom loop: applies the replicas' summed `grads` once; False where Keras's `apply` runs.

    Keras's `apply` in a replica reduces each replica's gradients with its own
    all-reduce, then clips and updates: a first call that builds the optimizer
    fails inside the traced step (see `_build_outside_the_trace`),
    `clipnorm`/`global_clipnorm` clip each replica's share instead of the sum
    (SGD(global_clipnorm=0.5): 0.08 from one device), a sparse gradient's rows
    shared by replicas are not summed (a position embedding under Adam: 0.15),
    and a `LossScaleOptimizer` gates its update with a `cond` in cross-replica
    context whose branch runs `call_for_each_replica`, which fails in a
    compiled step under MirroredStrategy once the scale changes ("You must
    feed a value for placeholder tensor 'cond/else/_1/cond/Placeholder_1'"),
    and at the first step under CentralStorageStrategy. Stock tf.distribute
    does the same. Here the sum is unscaled, clipped and applied once, as on
    one device, behind the loss-scale gate `fit` uses.

    Sparse gradients whose rows are the same on every replica (a position
    embedding, `tfdist.collectives.rows_shared_by_replicas`) travel as their
    values, to be added like a dense gradient, as `fit` adds them: one device
    holds each such row once. Rows that follow the data (token ids) are
    concatenated.
    """
    from tfdist import collectives
    from tfdist.strategies.sharded import sharded_state

    ctx = _summing_replica_context()
    if (
        ctx is None
        or variables is None
        or not grads
        or kc.keras_accumulation_steps(optimizer) is not None
        or sharded_state(optimizer) is not None  # a sharded optimizer applies through its own state
    ):
        return False
    _build_outside_the_trace(optimizer, variables)
    kc.optimizer_known_variables_check(optimizer, variables)
    shared = tuple(
        i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices) and collectives.rows_shared_by_replicas(g)
    )
    rows = [(grads[i].indices, grads[i].dense_shape) for i in shared]
    sent = [g.values if i in shared else g for i, g in enumerate(grads)]
    ctx.merge_call(
        functools.partial(_apply_summed, original=original, shared=shared), args=(optimizer, sent, variables, rows)
    )
    return True


def _with_shared_rows(sent: list, rows, shared: tuple, pick=lambda t: t) -> list:
    """`sent` with each shared gradient an `IndexedSlices` again (`pick` selects one replica's rows)."""
    grads = list(sent)
    for (indices, dense_shape), i in zip(rows, shared):
        grads[i] = tf.IndexedSlices(grads[i], pick(indices), pick(dense_shape))
    return grads


def _sum_over_replicas(strategy, sent: list, rows, shared: tuple) -> list:
    """Cross-replica context: one local copy of each gradient's sum over all replicas (None stays None)."""
    present = [i for i, g in enumerate(sent) if g is not None]
    # Reduced to the replicas' own devices (the update copies one sum to each variable).
    pairs = [(sent[i], sent[i]) for i in present]
    summed = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs) if pairs else []
    out: list = [None] * len(sent)
    for i, value in zip(present, summed):
        # Every replica's sum is the same; the update writes it to every copy.
        out[i] = strategy.experimental_local_results(value)[0]
    return _with_shared_rows(out, rows, shared, lambda t: strategy.experimental_local_results(t)[0])


@tf.autograph.experimental.do_not_convert
def _apply_summed(strategy, optimizer, sent: list, variables: list, rows, *, original, shared) -> None:
    """Cross-replica context: Keras's `apply` (or `LossScaleOptimizer.apply`) on the replicas' sum, once.

    The engine's one update (`tfdist.engine.update.apply_gradients`): unscale,
    clip, and behind the loss-scale gate the optimizer's own update, where
    the strategy places it.
    """
    from tfdist.engine import update

    if isinstance(optimizer, tf.distribute.DistributedValues):
        # Each replica made its own optimizer (an Estimator `model_fn` builds
        # one per replica): they share no update to apply once.
        def keras_apply(optimizer, sent, variables, rows):
            return original(optimizer, _with_shared_rows(sent, rows, shared), variables)

        strategy.extended.call_for_each_replica(keras_apply, args=(optimizer, sent, variables, rows))
        return
    inner = kc.inner_optimizer(optimizer)
    placement = strategy.gradient_path.placement(strategy)
    summed = _sum_over_replicas(strategy, sent, rows, shared)
    update.apply_gradients(optimizer, summed, lambda grads: update.apply_update(inner, grads, variables, placement))


def _patched_optimizer_apply(original):
    # Keras's own `apply` runs unless the variables hold shards (a
    # variable_partitioner) or the call is a replica's in a custom loop under
    # a tfdist mirrored, central_storage, sharded_optimizer or multi_worker
    # strategy (`_apply_in_custom_loop`).
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        known = trainable_variables if trainable_variables is not None else (
            kc.optimizer_trainable_variables(self) if self.built else []
        )
        if any(kc.holds_shards(v) for v in known):
            return _apply_to_shards(self, list(grads), trainable_variables)
        if not _apply_in_custom_loop(self, list(grads), trainable_variables, original):
            return original(self, grads, trainable_variables)

    return apply


def _patched_loss_scale_apply(original):
    # As `_patched_optimizer_apply`: Keras's LossScaleOptimizer.apply overrides
    # the base class's, so it is replaced on its own.
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        variables = None if trainable_variables is None else list(trainable_variables)
        if not _apply_in_custom_loop(self, list(grads), variables, original):
            return original(self, grads, trainable_variables)

    return apply


def _apply_to_shards(optimizer, grads: list, trainable_variables) -> None:
    """Keras's `BaseOptimizer.apply` for variables held in shards on ps tasks.

    The checks, building, empty-gradient filtering, unscaling and clipping are
    Keras's; the update itself is tfdist's update template in place (the
    parameter-server gradient path of `model.fit`), so a custom training loop
    updates exactly as `fit` does: each worker writes the shards on the ps
    tasks, without synchronisation.
    """
    from tfdist.engine import update

    if len(grads) == 0:
        return
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and not tf.distribute.in_cross_replica_context() and ctx.num_replicas_in_sync > 1:
        # The sharded optimizer's stage 3: each replica holds its own gradients,
        # and an update per replica would apply N partial steps.
        raise NotImplementedError(
            f"optimizer.apply() of {optimizer.name!r} was called in a replica of "
            f"{ctx.num_replicas_in_sync} on variables held in shards (the 'sharded_optimizer' strategy at "
            "stage=3): a custom training loop would update them once per replica with that replica's "
            "gradients. Train with model.fit (a custom train_step whose optimizer.apply takes the model's "
            "optimizer and all of model.trainable_variables goes through tfdist's step; another optimizer, "
            "or the model's on part of the variables, as a GAN's two optimizers, is refused here), or use "
            "stage=2 for a custom training loop or a GAN."
        )
    if trainable_variables is None:
        if len(grads) != len(kc.optimizer_trainable_variables(optimizer)):
            raise ValueError(
                "When passing `grads` as a list of gradient tensors, the gradients must match "
                f"`optimizer.variables` one-to-one. Received a list of {len(grads)} gradients, but "
                f"the optimizer is tracking {len(kc.optimizer_trainable_variables(optimizer))} trainable variables."
            )
        trainable_variables = kc.optimizer_trainable_variables(optimizer)
    else:
        if not optimizer.built:
            with kc.optimizer_name_scope(optimizer):
                optimizer.build(trainable_variables)
            optimizer.built = True
        kc.optimizer_known_variables_check(optimizer, trainable_variables)
    if getattr(optimizer, "gradient_accumulation_steps", None) or getattr(optimizer, "use_ema", False):
        raise NotImplementedError(
            "Optimizer(gradient_accumulation_steps=...) and Optimizer(use_ema=True) are not "
            "supported for variables partitioned over ps tasks (a `variable_partitioner`): "
            "workers update the ps variables asynchronously, one step at a time. "
            f"Received: optimizer {optimizer.name!r} updating partitioned variables"
        )
    with kc.optimizer_name_scope(optimizer):
        grads, trainable_variables = kc.filter_empty_gradients(optimizer, grads, trainable_variables)
    variables = list(trainable_variables)
    update.apply_gradients(
        optimizer, list(grads), lambda g: update.apply_update(optimizer, g, variables, update.LockedInPlace())
    )


def patch_training_of_sharded_variables() -> None:
    """Lets a custom training loop train variables that a variable partitioner split into shards.

    Upstream (Keras 3.15 / TensorFlow 2.21; no keras-team/keras issue for this
    error was found, the closest is keras-team/keras#20585, where Keras says
    Keras 3 does not support ParameterServerStrategy): Keras 3's TensorFlow
    `Variable.handle` is `self.value.handle`, and `GradientTape.gradient`
    reads `.handle` of every source that acts as a resource variable, so
    `tape.gradient(loss, model.trainable_variables)` raises
    "AttributeError: 'ShardedVariable' object has no attribute 'handle'" for a
    Keras variable whose value is a `ShardedVariable` (and for a bare
    `ShardedVariable` alike). Keras's optimizer cannot update one either: its
    `apply` reaches `strategy.extended.update` with the `ShardedVariable`, which
    raises "NotImplementedError: ShardedVariable doesn't support being used as
    a reference." TensorFlow's parameter_server_training tutorial (custom
    training loop with a `variable_partitioner`) fails on both.

    Two patches of the registry (`tfdist._compat.patches`): the first here
    (idempotent; the strategies that hold variables in shards install it when
    created), the second installed with every tfdist strategy, as it also
    serves custom loops under mirrored and central_storage
    (`_patched_optimizer_apply`):

    * `tf.GradientTape.gradient`: a source that holds shards is replaced by its
      shards (`variable_parts`), and their gradients are regrouped into one
      gradient of the whole variable (`tfdist.engine.step.regroup`, as the
      engine's step does under `fit`: `IndexedSlices` with the variable's
      dense_shape, or a dense tensor). Sources holding no shards: TensorFlow's
      own method, unchanged.
    * `BaseOptimizer.apply` (and so `apply_gradients`): when a variable to
      update holds shards, the update runs through tfdist's update template in
      place (`tfdist.engine.update.apply_update(..., update.InPlace())`), the
      update `fit` runs under strategy 'parameter_server'. Otherwise Keras's
      own method, unchanged.

    Verified on Keras 3.15 / TensorFlow 2.21.
    """
    patches.install_named("GradientTape.gradient")

"""Every process-wide change tfdist makes to Keras or TensorFlow: one registry, each entry with its exact undo.

`PATCHES` is the whole list. Each `Patch` names the attribute it replaces
(`target`, "module:Class.attribute"), what changes, the upstream behaviour or
issue it answers, and the versions it was verified on. Nothing here is
installed by `import tfdist` or by using its names: a tfdist strategy installs
the patches when it is created (`tfdist.strategies.base`), those of `needs=()`
always, the others when the strategy announces the need
(`install(need)`: "multi_worker", "parameter_server", "sharded_parameters").
`uninstall()` puts back every original object, in reverse order, and where
the class only inherited the attribute it deletes the class's own again, so
that afterwards `vars(owner)` is exactly as before.

What each patch does is written where its logic lives (a wrapper factory,
`wrapper(original) -> replacement`): the integration layer's in
`tfdist.keras_integration` and `tfdist.checkpointing`, the accessors' in
`tfdist._compat.keras`. They reach the registry through `add_implementations`,
called by the `tfdist` package itself (`tfdist/__init__.py`), so no layer
imports a layer above it. Every wrapper defers to the original object unless
the model, variable or strategy involved is tfdist's: a process that never
creates a tfdist strategy runs Keras and TensorFlow unchanged, and one that
does runs them unchanged for everything else
(`tests/test_no_interference.py`).

Temporary patches (`temporary=True`) are installed for the length of a `with`
block only (`temporarily`), by the one function that needs them.

Changes to single objects tfdist creates or was handed (a strategy's
variable creator, a compiled model's `load_weights`, the sharded optimizer's
class) are not process-wide and are not installed here; `OBJECT_CHANGES`
lists them, for the record and for docs/compat.md.

This module imports neither TensorFlow nor Keras at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from typing import Any, Callable, Iterator, Mapping

NEWEST = "TensorFlow 2.21, Keras 3.15 (the suite); not run at the oldest versions"
BOTH_ENDS = "TensorFlow 2.16–2.21, Keras 3.10–3.15 (the suite; the parity smoke at the oldest)"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One process-wide replacement of a Keras or TensorFlow attribute.

    Args:
        name: str. The registry key, `Owner.attribute` as users read it.
        target: str. `"module:Qualified.attribute"`, e.g.
            `"keras.src.trainers.trainer:Trainer.compile"`.
        changes: str. What is different once it is installed, and for whom.
        upstream: str. The upstream behaviour or issue it answers.
        verified: str. The TensorFlow and Keras versions it was verified on.
        needs: tuple of str. Empty: installed with every tfdist strategy.
            Otherwise installed when a strategy announces one of these needs.
        temporary: bool. Installed only inside `temporarily(name, ...)`.
    """

    name: str
    target: str
    changes: str
    upstream: str
    verified: str = BOTH_ENDS
    needs: tuple[str, ...] = ()
    temporary: bool = False

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def owner_path(self) -> str:
        """The dotted path of the patched object inside `module` ("" for the module itself)."""
        return self.target.partition(":")[2].rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2].rpartition(".")[2]


_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"

# What a strategy may announce when it is created (`tfdist.strategies.base.run_creation_hooks`);
# a need no patch lists installs nothing (multi_worker's `fit` patch is installed with every strategy).
NEEDS = ("multi_worker", "parameter_server", "sharded_parameters")
_KERAS_VARIABLE = "keras.src.backend.tensorflow.core:Variable"

PATCHES: tuple[Patch, ...] = (
    # --- The integration: models compiled under a tfdist strategy train with tfdist's step. ---
    Patch(
        "Trainer.compile",
        "keras.src.trainers.trainer:Trainer.compile",
        "A model compiled in a tfdist strategy's scope is validated against the strategy (its "
        "`unsupported`), then the strategy shapes its optimizer and sink size; a model built in one "
        "scope and compiled in another is refused. Wrapped on the base `Trainer`: Keras's "
        "`compile_from_config` skips compiling when `type(model).compile` is not `Trainer.compile`.",
        "Keras 3 has no hook for a strategy to take part in `compile`.",
    ),
    Patch(
        "TensorFlowTrainer.make_train_function",
        f"{_TRAINER}.make_train_function",
        "A tfdist model's train function is tfdist's (`tfdist.engine.loop`): steps_per_execution "
        "steps in one `tf.while_loop`, tfdist's gradient path and update.",
        "keras-team/keras#20585, tensorflow/tensorflow#72388 (fit under MultiWorkerMirroredStrategy: "
        "\"Attempt to convert a value (PerReplica...)\"); steps_per_execution > 1 under "
        "MirroredStrategy: \"You must feed a value for placeholder tensor 'while/cond/Placeholder'\".",
    ),
    Patch(
        "TensorFlowTrainer.make_test_function",
        f"{_TRAINER}.make_test_function",
        "A tfdist model's test function is tfdist's (`tfdist.engine.loop`).",
        "As `make_train_function`.",
    ),
    Patch(
        "TensorFlowTrainer.predict_on_batch",
        f"{_TRAINER}.predict_on_batch",
        "Under a tfdist strategy whose replicas are all in this process, the batch is split over "
        "the replicas and each row returned once.",
        "Keras hands the whole batch to every replica and concatenates their outputs: each row "
        "comes back N times (stock `tf.distribute.MirroredStrategy` too).",
    ),
    Patch(
        "TensorFlowTrainer._maybe_symbolic_build",
        f"{_TRAINER}._maybe_symbolic_build",
        "A tfdist model is built from one replica's element spec of the first batch, not from a "
        "batch averaged over replicas; the strategy learns where Keras builds the optimizer.",
        "Keras averages the first batch with `strategy.reduce(\"MEAN\")`, which fails when the "
        "global batch does not split evenly (\"Inputs to operation AddN ... must have the same "
        "size\"), and its dropped multi-device iterator crashed TensorFlow (SIGSEGV) about once "
        "in 5 to 8 fits.",
    ),
    Patch(
        "dtype_policy",
        "keras.src.dtype_policies.dtype_policy:dtype_policy",
        "Layers built in the scope of a tfdist strategy with `precision=\"mixed_...\"` get that "
        "dtype policy; everywhere else Keras's global policy.",
        "Keras has one global dtype policy; tfdist's `precision` option is per strategy.",
    ),
    Patch(
        "BaseOptimizer.apply",
        "keras.src.optimizers.base_optimizer:BaseOptimizer.apply",
        "In a replica of a custom training loop under a synchronous tfdist strategy, the replicas' "
        "gradients are summed and applied once through tfdist's update; variables held in shards "
        "(a variable partitioner, stage 3) are updated in place. Elsewhere Keras's own `apply`.",
        "Keras's `apply` in a replica clips each replica's share, builds the optimizer inside the "
        "traced step (\"You must feed a value for placeholder tensor 'cond/else/_1/cond/"
        "Placeholder'\") and cannot update a `ShardedVariable` (\"ShardedVariable doesn't support "
        "being used as a reference\"); stock `tf.distribute` alike.",
    ),
    Patch(
        "LossScaleOptimizer.apply",
        "keras:optimizers.LossScaleOptimizer.apply",
        "As `BaseOptimizer.apply`, for Keras's `LossScaleOptimizer`, which overrides it.",
        "Its loss-scale `cond` in cross-replica context fails in a compiled step under "
        "MirroredStrategy once the scale changes, and at the first step under "
        "CentralStorageStrategy.",
        verified=NEWEST,
    ),
    Patch(
        "Variable.__int__",
        "keras.src.backend.common.variables:Variable.__int__",
        "`int(v)` of a Keras variable whose value is a distributed variable reads one replica's "
        "copy (`int(model.optimizer.iterations)` under a strategy).",
        "Keras's `Variable.__int__` is `int(self.value)`, and a `MirroredVariable` has no "
        "`__int__`: \"TypeError: int() argument must be ... not 'MirroredVariable'\" (stock "
        "`tf.distribute` too; no upstream issue found).",
    ),
    Patch(
        "Variable.__float__",
        "keras.src.backend.common.variables:Variable.__float__",
        "As `Variable.__int__`, for `float(v)`.",
        "As `Variable.__int__`.",
        verified=NEWEST,
    ),
    Patch(
        "SeedGenerator.next",
        "keras.src.random.seed_generator:SeedGenerator.next",
        "Under a tfdist strategy with several replicas, replica r > 0 folds its id into the seed, "
        "so each replica draws its own dropout masks and augmentations; replica 0 draws as one "
        "device does.",
        "keras-team/keras#20611, #20612: every replica holds the same seed state and draws the "
        "same numbers.",
        verified=NEWEST,
    ),
    Patch(
        "loss.scale_loss_for_distribution",
        "keras.src.losses.loss:scale_loss_for_distribution",
        "Inside `keras_losses_unscaled()` (the Estimator-style runner's `model_fn`), Keras leaves "
        "a replica's loss unscaled; elsewhere Keras's own.",
        "Keras 3.8+ divides every `sum_over_batch_size` loss by the replica count under a strategy.",
    ),
    Patch(
        "loss.reduce_weighted_values",
        "keras.src.losses.loss:reduce_weighted_values",
        "Inside `recording_loss_reductions()` (tfdist's step), each Keras loss's reduction is "
        "recorded so the step weights each replica as one device would; elsewhere Keras's own.",
        "Keras divides a masked or weighted mean by the replica's own count or weight, one device "
        "by the whole batch's.",
    ),
    Patch(
        "CompileLoss.call",
        "keras.src.trainers.compile_utils:CompileLoss.call",
        "Inside `output_losses_weighted(w)` (tfdist's step), each output's loss metric counts the "
        "replica's value at its share of the global batch; elsewhere Keras's own.",
        "Keras counts each replica's share of a per-output loss once, whatever its size.",
    ),
    # --- Checkpoints of tfdist models are written atomically (tfdist.checkpointing). ---
    Patch(
        "Model.save",
        "keras:Model.save",
        "`save` of a tfdist model to a local `.keras`/`.h5` file writes a temporary file and "
        "renames it into place.",
        "Keras truncates the previous file and writes in place: a process killed meanwhile leaves "
        "no loadable checkpoint.",
    ),
    Patch(
        "Model.save_weights",
        "keras:Model.save_weights",
        "As `Model.save`, for `.weights.h5`.",
        "As `Model.save`.",
        verified=NEWEST,
    ),
    Patch(
        "Model.load_weights",
        "keras:Model.load_weights",
        "Loading a local weights file into a tfdist model checks the SHA-256 tfdist wrote beside it "
        "(a `.keras` file: its zip CRC-32s) and names the file in every read error.",
        "Keras loads a `.weights.h5` whose bytes were overwritten silently, and its h5py errors "
        "(\"Unable to synchronously open file (truncated file...)\") do not name the file.",
        verified=NEWEST,
    ),
    Patch(
        "BackupAndRestore.on_train_begin",
        "keras:callbacks.BackupAndRestore.on_train_begin",
        "Before restoring a tfdist model, a backup interrupted between its two renames is "
        "completed and leftover temporary files removed.",
        "As `Model.save`.",
        verified=NEWEST,
    ),
    Patch(
        "BackupAndRestore._save_model",
        "keras:callbacks.BackupAndRestore._save_model",
        "A tfdist model's backup (weights and training_metadata.json) is written atomically, as "
        "a pair.",
        "As `Model.save`.",
        verified=NEWEST,
    ),
    Patch(
        "BackupAndRestore.on_epoch_begin",
        "keras:callbacks.BackupAndRestore.on_epoch_begin",
        "A tfdist model's backup tracks the data position from each epoch's start (`tfdist.resume`).",
        "`BackupAndRestore(save_freq=N)` resumes at the start of the epoch and applies the "
        "steps since it twice.",
        verified=NEWEST,
    ),
    Patch(
        "BackupAndRestore.on_train_batch_end",
        "keras:callbacks.BackupAndRestore.on_train_batch_end",
        "A resumed epoch skips the steps already in the restored weights; after each step, a "
        "preempted job (SIGTERM, SIGINT: `tfdist.preemption`) saves the backup on every worker "
        "and exits 0.",
        "As `BackupAndRestore.on_epoch_begin`; Keras 3 has no preemption handling in `fit` "
        "(TensorFlow's `PreemptionCheckpointHandler` must be called by the user).",
        verified=NEWEST,
    ),
    Patch(
        "BackupAndRestore.on_train_end",
        "keras:callbacks.BackupAndRestore.on_train_end",
        "The backup's resume and preemption bookkeeping of a tfdist model ends with `fit`.",
        "As `BackupAndRestore.on_epoch_begin`.",
        verified=NEWEST,
    ),
    # --- Announced needs. ---
    Patch(
        "TensorFlowTrainer.fit",
        f"{_TRAINER}.fit",
        "Under a strategy whose host loop replaces Keras's (the parameter server), `fit` runs it; "
        "under one that redirects non-chief writes (multi_worker), a non-chief worker's "
        "ModelCheckpoint, TensorBoard and BackupAndRestore write to a temporary directory. Every "
        "other model: Keras's own `fit`. Under every tfdist strategy, the backup's resume and "
        "preemption bookkeeping is closed when `fit` raises or exits.",
        "keras-team/keras#20585 (Keras 3 fit under ParameterServerStrategy: \"To use this dataset, "
        "you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset\"); Keras "
        "3's callbacks know nothing of workers (tf-keras's did).",
    ),
    Patch(
        "TensorFlowTrainer.evaluate",
        f"{_TRAINER}.evaluate",
        "Under the parameter server, tfdist's coordinator loop evaluates.",
        "As `TensorFlowTrainer.fit`.",
        verified=NEWEST,
        needs=("parameter_server",),
    ),
    Patch(
        "TensorFlowTrainer.predict",
        f"{_TRAINER}.predict",
        "Under the parameter server, tfdist's coordinator loop predicts.",
        "As `TensorFlowTrainer.fit`.",
        verified=NEWEST,
        needs=("parameter_server",),
    ),
    Patch(
        "Variable.numpy",
        f"{_KERAS_VARIABLE}.numpy",
        "A Keras variable whose value is a `ShardedVariable` reads as its shards concatenated.",
        "\"'ShardedVariable' object has no attribute '__array__'\": `get_weights` and `save` fail "
        "for a partitioned model.",
        needs=("parameter_server", "sharded_parameters"),
    ),
    Patch(
        "Variable.__array__",
        f"{_KERAS_VARIABLE}.__array__",
        "As `Variable.numpy`, for `np.asarray(v)`.",
        "As `Variable.numpy`.",
        needs=("parameter_server", "sharded_parameters"),
    ),
    Patch(
        "Variable.assign_add",
        f"{_KERAS_VARIABLE}.assign_add",
        "A Keras variable on a ps task is incremented with TensorFlow's atomic `assign_add`.",
        "Keras's `assign_add` is `assign(self + value)`: concurrent workers lose increments "
        "(176 iterations counted instead of 188).",
        needs=("parameter_server", "sharded_parameters"),
    ),
    Patch(
        "Variable.assign_sub",
        f"{_KERAS_VARIABLE}.assign_sub",
        "As `Variable.assign_add`, for `assign_sub`.",
        "As `Variable.assign_add`.",
        verified=NEWEST,
        needs=("parameter_server", "sharded_parameters"),
    ),
    Patch(
        "Variable._serialize_to_tensors",
        f"{_KERAS_VARIABLE}._serialize_to_tensors",
        "`tf.train.Checkpoint` saves a sharded Keras variable whole, under the key and shape one "
        "device saves.",
        "\"AttributeError: 'ShardedVariable' object has no attribute 'device'\" from the saver.",
        verified=NEWEST,
        needs=("parameter_server", "sharded_parameters"),
    ),
    Patch(
        "GradientTape.gradient",
        "tensorflow:GradientTape.gradient",
        "A source that holds shards is differentiated through its shards and its gradient "
        "regrouped; a tape whose sources hold none runs TensorFlow's own `gradient`, unchanged.",
        "Keras 3's `Variable.handle` is `self.value.handle`: \"AttributeError: 'ShardedVariable' "
        "object has no attribute 'handle'\" (closest upstream: keras-team/keras#20585).",
        needs=("parameter_server", "sharded_parameters"),
    ),
    # --- Temporary: for the length of one call. ---
    Patch(
        "backend.compute_output_spec",
        "keras.src.backend:compute_output_spec",
        "While a model with a ragged input is built symbolically, its output spec is traced from "
        "the inputs' own specs.",
        "Keras stands a dense placeholder in for each input: \"'SymbolicTensor' object has no "
        "attribute 'to_tensor'\".",
        verified=NEWEST,
        temporary=True,
    ),
    Patch(
        "CollectiveAllReduceExtended._initialize_local_devices",
        "tensorflow.python.distribute.collective_all_reduce_strategy:"
        "CollectiveAllReduceExtended._initialize_local_devices",
        "While a multi-worker strategy with `devices_per_worker=K` initialises, a CPU worker's "
        "local devices are its K logical CPU devices.",
        "TensorFlow gives a worker without GPUs exactly one replica (\"num_local_devices = 1\").",
        verified=NEWEST,
        temporary=True,
    ),
)

# name, object, what changes, upstream (changes made to one object tfdist created or a user handed it,
# not process-wide; each is made by the function named).
OBJECT_CHANGES: tuple[tuple[str, str, str, str], ...] = (
    ("_compat.tf.configure_variable_creation", "a tfdist strategy's `extended._create_variable`",
     "non-trainable state averaged (MEAN) or written once (ONLY_FIRST_REPLICA); central storage's "
     "metric state per device", "keras-team/keras#21054, #20611"),
    ("_compat.tf.isolate_collective_keys", "a tfdist strategy's `_collective_key_base`",
     "collective group keys no other strategy in the process uses", "tensorflow/tensorflow#61314, #62790"),
    ("_compat.tf.colocate_slots_with_shards", "the parameter server strategy's variable creator",
     "optimizer slots of a partitioned variable partitioned alike", "slots land on the chief"),
    ("_compat.tf.shard_trainable_variables", "the sharded optimizer's (stage 3) variable creator, "
     "`_validate_colocate_with_variable`, `_update`", "trainable variables held in parts", "-"),
    ("_compat.tf.refuse_tf_keras_variables", "a tfdist strategy's variable creator",
     "tf-keras models refused where tfdist's step options would be ignored", "-"),
    ("_compat.keras.guard_load_weights", "a compiled tfdist model's `load_weights`",
     "all-or-nothing: restored on error", "Keras loads layer by layer and raises at the end"),
    ("_compat.keras.make_sharded_optimizer", "the sharded optimizer's `__class__`",
     "a same-named subclass holding the state in slices (Horovod's pattern)", "-"),
    ("_compat.keras.calls_replaced", "a layer's `call`, per thread, inside the step",
     "stage 3 and layer-wise reductions re-run a layer", "-"),
    ("_compat.keras.set_epoch_iterator_factory", "a tfdist model's epoch iterator", "sinking", "-"),
    ("_compat.keras.redirect_backup_and_restore", "a non-chief worker's copy of a BackupAndRestore",
     "writes to a temporary directory", "-"),
)

_implementations: dict[str, Callable[[Any], Any]] = {}
_loaders: list[Callable[[], Mapping[str, Callable[[Any], Any]]]] = []
_loaded = [0]
# name -> (owner, attribute, the owner's own value before (or _ABSENT), the installed object)
_installed: dict[str, tuple[Any, str, Any, Any]] = {}
_ABSENT = object()
# MirroredStrategy traces each replica in its own thread, and a context of `_compat.keras`
# may install its patch from there: one installer at a time.
_lock = threading.RLock()
BY_NAME = {p.name: p for p in PATCHES}


def patch(name: str) -> Patch:
    """The registry entry `name` (`KeyError` naming the known ones if none)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"No patch named {name!r} in tfdist's registry. Known: {sorted(BY_NAME)}") from None


def add_implementations(loader: Callable[[], Mapping[str, Callable[[Any], Any]]]) -> None:
    """Registers `loader() -> {patch name: wrapper(original) -> replacement}`, called before the first install.

    The `tfdist` package registers the integration layer's loader
    (`tfdist.keras_integration.patch_implementations`, which includes the
    checkpoint patches and the accessors' of `tfdist._compat.keras`).
    """
    if loader not in _loaders:
        _loaders.append(loader)


def _load_implementations() -> None:
    for loader in _loaders[_loaded[0]:]:
        for name, wrapper in loader().items():
            patch(name)  # declared, or KeyError
            _implementations[name] = wrapper
    _loaded[0] = len(_loaders)


def resolve(entry: Patch) -> tuple[Any, str]:
    """`(owner, attribute)`: the module or class `entry` patches and the attribute's name.

    The module is one Keras or TensorFlow loads with itself (read from
    `sys.modules`, not imported here).
    """
    import keras  # noqa: F401  (loads every module a Keras target names)
    import tensorflow  # noqa: F401

    owner = sys.modules.get(entry.module)
    if owner is None:
        raise RuntimeError(
            f"tfdist's patch {entry.name!r} targets {entry.target}, but Keras and TensorFlow did not load "
            f"{entry.module!r}: this Keras or TensorFlow is not one tfdist supports (docs/compat.md)."
        )
    for part in filter(None, entry.owner_path.split(".")):
        owner = getattr(owner, part)
    return owner, entry.attribute


def implementation(name: str) -> Callable[[Any], Any]:
    """The wrapper factory registered for `name`."""
    _load_implementations()
    if name not in _implementations:
        raise RuntimeError(f"tfdist's patch {name!r} is declared but no module implements it.")
    return _implementations[name]


def _install(entry: Patch, wrapper: Callable[[Any], Any]) -> None:
    owner, attribute = resolve(entry)
    own = vars(owner).get(attribute, _ABSENT)
    original = getattr(owner, attribute) if own is _ABSENT else own
    replacement = wrapper(original)
    setattr(owner, attribute, replacement)
    _installed[entry.name] = (owner, attribute, own, replacement)


def _undo(name: str) -> None:
    owner, attribute, own, replacement = _installed[name]
    if vars(owner).get(attribute, _ABSENT) is not replacement:
        raise RuntimeError(
            f"tfdist cannot undo its patch {name!r}: {owner.__name__}.{attribute} was replaced again "
            "after tfdist patched it. Undo that change first."
        )
    del _installed[name]
    if own is _ABSENT:
        delattr(owner, attribute)
    else:
        setattr(owner, attribute, own)


def install(need: str | None = None) -> list[str]:
    """Installs the patches a tfdist strategy needs: those of `needs=()`, or with `need`, those that list it.

    Idempotent; returns the names installed by this call.

    Args:
        need: str or None. None: the patches every tfdist strategy needs.
            Otherwise one of the needs a strategy announces ("multi_worker",
            "parameter_server", "sharded_parameters").
    """
    known = set(NEEDS)
    if need is not None and need not in known:
        raise ValueError(f"Argument 'need' must be None or one of {sorted(known)}. Received: need={need!r}")
    chosen = [
        p.name for p in PATCHES
        if not p.temporary and (need in p.needs if need is not None else not p.needs)
    ]
    return install_named(*chosen)


def install_named(*names: str) -> list[str]:
    """Installs the named patches that are not installed yet; returns those it installed."""
    done = []
    with _lock:
        for name in names:
            entry = patch(name)
            if entry.temporary:
                raise ValueError(f"Patch {name!r} is temporary: use `temporarily({name!r}, ...)`.")
            if name not in _installed:
                _install(entry, implementation(name))
                done.append(name)
    return done


def uninstall() -> list[str]:
    """Undoes every installed patch, the last installed first; returns their names."""
    with _lock:
        names = list(_installed)[::-1]
        for name in names:
            _undo(name)
    return names


def installed() -> list[str]:
    """The names of the installed patches, in the order they were installed."""
    return list(_installed)


def is_installed(name: str) -> bool:
    return name in _installed


@contextlib.contextmanager
def temporarily(name: str, wrapper: Callable[[Any], Any]) -> Iterator[None]:
    """Inside: the temporary patch `name` replaced by `wrapper(original)`; undone on exit."""
    entry = patch(name)
    if not entry.temporary:
        raise ValueError(f"Patch {name!r} is not temporary: install it with `install_named({name!r})`.")
    with _lock:
        _install(entry, wrapper)
    try:
        yield
    finally:
        with _lock:
            _undo(name)

"""What every tfdist strategy has on top of its `tf.distribute.Strategy`.

A tfdist strategy *is* a `tf.distribute.Strategy` (so TensorFlow, Keras and
tf-keras accept it anywhere a strategy goes); the mixin adds the name it was
registered under, its validated step options, and which gradient path the step
engine uses for it. Nothing else belongs here: shared step logic lives in
`tfdist.engine`, shared communication in `tfdist.collectives`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import tensorflow as tf

from tfdist._compat import patches, versions
from tfdist.engine import loop
from tfdist.engine import step as engine_step
from tfdist.options import Option, TrainingOptions, split_options

# Step options that only tfdist's step reads (tf-keras's `fit` never runs it).
_IGNORED_BY_TF_KERAS = ("accumulation_steps", "precision", "jit_compile", "sink_size", "allreduce_dtype", "bucket_bytes")


class TfdistStrategy:
    """Mixin marking a `tf.distribute.Strategy` as tfdist's.

    Attributes:
        name: the registry name (`"mirrored"`, ...).
        PARAMS: the strategy's own parameters, validated like step options.
        gradient_path: a `tfdist.engine.step.GradientPath`: how gradients
            cross devices in the step engine and where each update runs —
            `ALL_REDUCE` (every replica ends with the summed gradient, every
            copy is updated), `REDUCE_TO_VARIABLES` (summed onto the device
            that holds each variable, updated once), or the strategy's own.
        host_loop: a `tfdist.engine.loop.HostLoop`: who drives the epochs —
            Keras's `fit` (`KERAS_FIT`) or tfdist's own loop (the parameter
            server's `ClusterCoordinator` loop).
        asynchronous: workers step without synchronising (parameter server):
            no step collective runs and there is no global batch.
        redirects_non_chief_writes: a non-chief process's callback writes
            (checkpoints, summaries) go to a temporary directory, removed after
            `fit` (multi_worker: every worker runs the callbacks; the strategy
            provides `is_chief`, `write_dir` and `remove_write_dir`).

    What a strategy runs is declared by `unsupported(feature, model)`, which
    the engine's validation (`tfdist.engine.loop.validate_compiled_model`) and the
    Estimator runner consult; no strategy is recognised by its name.
    """

    name: ClassVar[str] = ""
    PARAMS: ClassVar[dict[str, Option]] = {}
    gradient_path: ClassVar[engine_step.GradientPath] = engine_step.ALL_REDUCE
    host_loop: ClassVar[loop.HostLoop] = loop.KERAS_FIT
    asynchronous: ClassVar[bool] = False
    redirects_non_chief_writes: ClassVar[bool] = False

    def unsupported(self, feature: str, model=None) -> str | None:
        """Why this strategy does not run `feature` (for `model`), or `None` when it does.

        Features (see `tfdist.engine.loop.model_features`): "accumulation_steps",
        "jit_compile", "synchronized_batchnorm", "custom_train_step",
        "loss_scale_optimizer", "keras_accumulation" (Keras's
        `Optimizer(gradient_accumulation_steps=...)`), "ema", "optimizer"
        (the compiled optimizer's class), "step_options" (non-default step
        options), "run_eagerly" (`compile(run_eagerly=True)`), "estimator"
        (the Estimator-style runner). The reason is
        the whole error message: it names the combination and the fix.
        """
        return None

    def explain_collective_error(self, error: Exception) -> Exception | None:
        """The error to raise instead of TensorFlow's `error` from a step's collective, or None.

        A strategy whose collectives can time out (multi_worker) returns an
        error naming its timeout option and the job's tasks; default None.
        """
        return None

    def on_compile(self, model) -> None:
        """Called at the end of `model.compile` in the strategy's scope (after validation)."""

    def on_keras_build(self, model) -> None:
        """Called where Keras builds a compiled model's missing state, before it does.

        That is the start of `fit`, `evaluate`, `train_on_batch` and
        `test_on_batch`, where Keras builds an unbuilt optimizer.
        """

    @classmethod
    def demo_kwargs(cls):
        """Arguments for `tfdist demo` on the embedded default, or `None` to leave it out."""
        return {}

    def _tfdist_init(self, values: dict[str, Any]) -> dict[str, Any]:
        """Checks the installed versions, installs tfdist's patches, validates constructor arguments.

        Returns the strategy's own parameters. Outside the TensorFlow and Keras
        versions tfdist supports, raises `UnsupportedVersionError` before
        anything is patched. The patches (`tfdist._compat.patches`) are those
        every tfdist strategy needs; a strategy that needs more announces it
        (`run_creation_hooks`).
        """
        versions.check()
        params, step = split_options(self.name, self.PARAMS, values)
        patches.install()
        self._tfdist_options = step
        self._tfdist_params = params
        return params

    def _refuse_tf_keras_if_options_are_set(self) -> None:
        """Refuses tf-keras models in this strategy's scope where a step option tf-keras would ignore is set.

        tf-keras (Keras 2) drives `tf.distribute` itself: its `fit` trains as
        under TensorFlow's own strategy, without tfdist's step, so these
        options would silently do nothing (measured before: `precision` left
        the layers in float32, `accumulation_steps=2` stepped every batch).
        """
        from tfdist._compat import tf as tfc
        from tfdist.options import STEP_OPTIONS

        ignored = [
            name for name in _IGNORED_BY_TF_KERAS
            if getattr(self.options, name) != STEP_OPTIONS[name].resolve_default()
        ]
        if not ignored:
            return
        shown = ", ".join(f"{name}={getattr(self.options, name)!r}" for name in ignored)
        tfc.refuse_tf_keras_variables(
            self,
            f"tf-keras (Keras 2) models train under the {self.name!r} strategy as under tf.distribute's own, "
            f"without tfdist's step, so its step options {shown} would be ignored. Build the model with "
            "Keras 3 (`import keras`), or create the strategy without those options.",
        )

    @property
    def options(self) -> TrainingOptions:
        """The validated step options (`tfdist.options.TrainingOptions`)."""
        return self._tfdist_options

    def experimental_distribute_dataset(self, dataset, options=None):
        # Input is staged onto the replicas' devices by tfdist.data.TransferManager
        # (step options `transfer`, `prefetch_depth`); explicit `options` win.
        from tfdist._compat import tf as tfc
        from tfdist.data import TransferManager, sinking

        manager = TransferManager.from_options(self.options)
        if options is None and self._one_local_replica():
            # One replica: `strategy.run` takes plain tensors, and a plain
            # iterator costs ~0.5-0.8 ms less per host call and ~60 ms less per
            # epoch than a one-device DistributedIterator (measured, issue 16).
            device = self.extended.worker_devices[0]
            if tf.DeviceSpec.from_string(device).device_type in (None, "CPU"):
                return dataset
            return manager.stage(dataset, device)
        explicit = options is not None
        options = manager.input_options(options)
        distributed = tfc.distribute_dataset(self, dataset, options, super().experimental_distribute_dataset)
        if explicit:
            # The caller chose how batches reach the replicas: Keras keeps the distributed iterator.
            return distributed
        # Chunked sinking (`tfdist.data.sinking`) may read the batches from the dataset itself.
        return sinking.remember_source(distributed, dataset)

    def spans_processes(self) -> bool:
        """Whether this strategy trains across processes (a collective strategy of several workers;
        the parameter server says so itself)."""
        from tfdist._compat import tf as tfc

        return tfc.in_multi_worker_mode(self)

    def feeds_every_replica_locally(self) -> bool:
        """Whether one input pipeline in this process feeds every replica (one host, synchronous).

        Sinking in windows (`tfdist.data.sinking`) serves such strategies:
        each replica's rows of a host call's batches staged on its device
        in one transfer (`sinking.WindowStage`), on CPUs and accelerators
        alike.
        """
        return not (self.asynchronous or self.spans_processes())

    def _one_local_replica(self) -> bool:
        from tfdist._compat import tf as tfc

        return (
            self.num_replicas_in_sync == 1
            and not self.asynchronous
            and not tfc.in_multi_worker_mode(self)
        )

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        from tfdist.data import DatasetFn, TransferManager

        options = TransferManager.from_options(self.options).input_options(options)
        return super().distribute_datasets_from_function(DatasetFn.wrap(dataset_fn), options)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._tfdist_params.items() if v is not None)
        return (
            f"<tfdist {type(self).__name__} name={self.name!r} "
            f"replicas={self.num_replicas_in_sync}{', ' + params if params else ''}>"
        )


def run_creation_hooks(kind: str, strategy: Any) -> None:
    """Installs the patches a strategy of `kind` needs beyond every strategy's, once it is constructed.

    `kind` is the need the strategy announces: "multi_worker" (chief-only
    callback writes in `fit`), "parameter_server" (tfdist's
    fit/evaluate/predict for ClusterCoordinator jobs, Keras variables on ps
    tasks, tapes over partitioned variables), "sharded_parameters" (the
    sharded optimizer's stage 3: tapes and optimizers that take variables
    held in shards). The patches are entries of `tfdist._compat.patches`;
    their wrappers live in the integration layer, which the `tfdist` package
    hands to the registry, so no strategy imports the layer above it.
    """
    patches.install(kind)


def is_tfdist_strategy(strategy: Any) -> bool:
    return isinstance(strategy, TfdistStrategy)

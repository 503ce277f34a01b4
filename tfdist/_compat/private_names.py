"""Every private Keras and TensorFlow name `tfdist._compat` reads: one declared table.

`tests/compat/test_private_names.py` reads `_compat`'s source and fails when it
uses a private name missing here, and checks that every name here exists in
the installed Keras and TensorFlow (within the name's own version gate), so a
release that renames one fails a test (in `make test` on the newest, in
`make test-compat` on the oldest) instead of a user's run. The targets of the
patch registry (`tfdist._compat.patches.PATCHES`) are checked with them.

`NAMES`: what `from <private module> import ...` brings in and the attributes
read through it, as `"module:dotted.path"` (`from keras.src.losses import
loss` then `loss.apply_mask` is `"keras.src.losses:loss.apply_mask"`).

`ATTRIBUTES`: private attributes read on objects (`model._compile_loss`),
each with the class whose instances have it (`"module:Class"`) and the
version gate under which `_compat` reads it (`None`: every supported version;
`("keras", (3, 13))`: Keras 3.13 and later).

Imports nothing.
"""

from __future__ import annotations

Gate = tuple  # ("keras" | "tensorflow", (major, minor)) or None

NAMES: dict[str, Gate | None] = {
    "keras.src.api_export:REGISTERED_OBJS_TO_NAMES": None,
    "keras.src.backend.common.name_scope:current_path": None,
    "keras.src.backend.common.name_scope:name_scope": None,
    "keras.src.backend.common.stateless_scope:get_stateless_scope": None,
    "keras.src.backend.common.symbolic_scope:SymbolicScope": None,
    "keras.src.backend.common.variables:in_stateless_scope": None,
    "keras.src.backend.common:global_state": None,
    "keras.src.backend.common:global_state.get_global_attribute": None,
    "keras.src.backend.common:global_state.set_global_attribute": None,
    "keras.src.backend.tensorflow.core:Variable": None,
    "keras.src.backend.tensorflow.optimizer:TFOptimizer": None,
    "keras.src.backend.tensorflow.optimizer:TFOptimizer._backend_update_step": None,
    "keras.src.backend.tensorflow.trainer:TensorFlowTrainer": None,
    "keras.src.losses:loss": None,
    "keras.src.losses:loss.apply_mask": None,
    "keras.src.losses:loss.squeeze_or_expand_to_same_rank": None,
    "keras.src.losses:loss.standardize_reduction": None,
    "keras.src.losses:loss.unscale_loss_for_distribution": None,
    "keras.src.optimizers.adam:Adam": None,
    "keras.src.optimizers.adam:Adam.update_step": None,
    "keras.src.optimizers.adamax:Adamax": None,
    "keras.src.optimizers.adamax:Adamax.update_step": None,
    "keras.src.optimizers.base_optimizer:BaseOptimizer": None,
    "keras.src.optimizers.muon:Muon": None,
    "keras.src.optimizers.nadam:Nadam": None,
    "keras.src.optimizers.nadam:Nadam.update_step": None,
    "keras.src.saving.keras_saveable:KerasSaveable": None,
    "keras.src.saving:object_registration": None,
    "keras.src.saving:saving_lib": None,
    "keras.src.saving:saving_lib.H5IOStore": None,
    "keras.src.saving:saving_lib._save_state": None,
    "keras.src.saving:object_registration.GLOBAL_CUSTOM_NAMES": None,
    "keras.src.trainers.data_adapters:data_adapter_utils": None,
    "keras.src.trainers.data_adapters:data_adapter_utils.unpack_x_y_sample_weight": None,
    "keras.src.trainers.trainer:Trainer": None,
    "keras.src.utils.python_utils:pythonify_logs": None,
    "keras.src.utils:file_utils": None,
    "keras.src.utils:file_utils.is_remote_path": None,
    "keras.src.utils:io_utils": None,
    "keras.src.utils:io_utils.ask_to_proceed_with_overwrite": None,
    "keras.src:backend": None,
    "keras.src:backend.name_scope": None,
    "keras.src:ops": None,
    "keras.src:ops.cast": None,
    "keras.src:ops.power": None,
    "tensorflow.core.framework:attr_value_pb2": None,
    "tensorflow.core.framework:attr_value_pb2.AttrValue": None,
    "tensorflow.python.distribute.ps_values:CachingVariable": None,
    "tensorflow.python.distribute.sharded_variable:ShardedVariable": None,
    "tensorflow.python.distribute.values:PerReplicaSpec": None,
    "tensorflow.python.distribute:collective_all_reduce_strategy": None,
    "tensorflow.python.distribute:collective_all_reduce_strategy._is_gpu_device": None,
    "tensorflow.python.distribute:distribute_lib._CrossReplicaThreadMode": None,
    "tensorflow.python.distribute:distribute_lib._pop_per_thread_mode": None,
    "tensorflow.python.distribute:distribute_lib._push_per_thread_mode": None,
    "tensorflow.python.distribute:mirrored_run": None,
    "tensorflow.python.distribute:mirrored_run._is_gpu_device": None,
    "tensorflow.python.distribute:mirrored_strategy": None,
    "tensorflow.python.distribute:mirrored_strategy._is_gpu_device": None,
    "tensorflow.python.distribute:cross_device_ops": None,
    "tensorflow.python.distribute:cross_device_ops.CollectiveAllReduce": None,
    "tensorflow.python.distribute:device_util": None,
    "tensorflow.python.distribute:device_util.canonicalize": None,
    "tensorflow.python.distribute:distribute_lib": None,
    "tensorflow.python.distribute:distribute_lib.get_update_replica_id": None,
    "tensorflow.python.distribute:distribute_utils": None,
    "tensorflow.python.distribute:distribute_utils.VARIABLE_CLASS_MAPPING": None,
    "tensorflow.python.distribute:distribute_utils.VARIABLE_POLICY_MAPPING": None,
    "tensorflow.python.distribute:distribute_utils.create_mirrored_variable": None,
    "tensorflow.python.distribute:values": None,
    "tensorflow.python.distribute:values.PerReplica": None,
    "tensorflow.python.eager:context": None,
    "tensorflow.python.eager:context.context": None,
    "tensorflow.python.trackable:base": None,
    "tensorflow.python.trackable:base.Trackable": None,
    "tensorflow.python.trackable:base.VARIABLE_VALUE_KEY": None,
    "tensorflow.python.trackable:data_structures": None,
    "tensorflow.python.trackable:data_structures.ListWrapper": None,
}

_MODEL = "keras:Model"
_OPTIMIZER = "keras.src.optimizers.base_optimizer:BaseOptimizer"
_BACKUP = "keras:callbacks.BackupAndRestore"
_MIRRORED = "tensorflow.python.distribute.mirrored_strategy:MirroredExtended"
_MULTI_WORKER = "tensorflow.python.distribute.collective_all_reduce_strategy:CollectiveAllReduceExtended"

ATTRIBUTES: dict[str, tuple[str, Gate | None]] = {
    # Models and layers.
    "_assert_compile_called": (_MODEL, None),
    "_call_has_training_arg": (_MODEL, None),
    "_compile_loss": (_MODEL, None),
    "_compute_loss": (_MODEL, None),
    "_distribute_strategy": (_MODEL, None),
    "_flatten_layers": (_MODEL, None),
    "_flatten_metrics_in_order": (_MODEL, None),
    "_get_metrics_result_or_logs": (_MODEL, None),
    "_initial_epoch": (_MODEL, None),
    "_loss_ids": (_MODEL, None),
    "_loss_tracker": (_MODEL, None),
    "_should_eval": (_MODEL, None),
    "_symbolic_build": (_MODEL, None),
    "_keras_mask": ("tensorflow:Tensor", None),
    # TensorFlow's GPU-branch predicate, replaced by the test helper devices_read_as_gpu.
    "_is_gpu_device": ("tensorflow.python.distribute:mirrored_run", None),
    # The compiled loss.
    "_flat_losses": ("keras.src.trainers.compile_utils:CompileLoss", None),
    "_metrics": ("keras.src.trainers.compile_utils:CompileLoss", None),
    # Optimizers.
    "_distribution_strategy": (_OPTIMIZER, None),
    "_backend_update_step": (_OPTIMIZER, None),
    "_check_variables_are_known": (_OPTIMIZER, None),
    "_clip_gradients": (_OPTIMIZER, None),
    "_filter_empty_gradients": (_OPTIMIZER, None),
    "_get_variable_index": (_OPTIMIZER, None),
    "_iterations": (_OPTIMIZER, None),
    "_model_variables_moving_average": (_OPTIMIZER, None),
    "_trainable_variables": (_OPTIMIZER, None),
    "_trainable_variables_indices": (_OPTIMIZER, None),
    "_use_weight_decay": (_OPTIMIZER, None),
    "_var_key": (_OPTIMIZER, None),
    "_overwrite_variable_with_gradient": (_OPTIMIZER, None),
    "_u_product": ("keras:optimizers.Nadam", None),
    "_should_use_adamw": ("keras:optimizers.Muon", None),
    "_inner_optimizers": ("keras:optimizers.MultiOptimizer", ("keras", (3, 13))),
    "_var_to_optimizer_idx": ("keras:optimizers.MultiOptimizer", ("keras", (3, 13))),
    # Variables.
    "_value": ("keras:Variable", None),
    "_unique_id": ("tensorflow:Variable", None),
    # Epoch iterators and callbacks.
    "_get_iterator": ("keras.src.trainers.epoch_iterator:EpochIterator", None),
    "_distributed_dataset": ("keras.src.backend.tensorflow.trainer:TFEpochIterator", None),
    "_current_epoch": (_BACKUP, None),
    "_last_batch_seen": (_BACKUP, None),
    "_batches_seen_since_last_saving": (_BACKUP, None),
    "_prev_training_metadata_path": (_BACKUP, None),
    "_prev_weights_path": (_BACKUP, None),
    "_training_metadata_path": (_BACKUP, None),
    "_weights_path": (_BACKUP, None),
    # tf.distribute.
    "_collective_key_base": ("tensorflow:distribute.MirroredStrategy", None),
    "_create_variable": (_MIRRORED, None),
    "_get_cross_device_ops": (_MIRRORED, None),
    "_get_replica_id_in_sync_group": (_MIRRORED, None),
    "_in_multi_worker_mode": (_MIRRORED, None),
    "_update": (_MIRRORED, None),
    "_validate_colocate_with_variable": (_MIRRORED, None),
    "_host_cross_device_ops": (_MULTI_WORKER, None),
    "_worker_device": (_MULTI_WORKER, None),
    "_launchers": ("tensorflow.python.distribute.cross_device_ops:CollectiveAllReduce", None),
    "_all_gather": ("tensorflow.python.distribute.cross_device_utils:CollectiveReplicaLauncher", None),
    "_value_specs": ("tensorflow.python.distribute.values:PerReplicaSpec", None),
    # tf.data, graphs, checkpoints.
    "_as_serialized_graph": ("tensorflow:data.Dataset", None),
    "_inputs": ("tensorflow:data.Dataset", None),
    "_set_attr": ("tensorflow:Operation", None),
    "_storage": ("tensorflow.python.trackable.data_structures:ListWrapper", None),
    "_trackable_children": ("tensorflow.python.trackable.base:Trackable", None),
    # Python's own (the caller's frame, to tell tf-keras's variable creation from Keras's).
    "_getframe": ("sys:", None),
}


def applies(gate: Gate | None, installed: dict) -> bool:
    """Whether a name under `gate` is read with the installed versions (`{"keras": (3, 15, 1), ...}`)."""
    if gate is None:
        return True
    package, since = gate
    return tuple(installed[package][: len(since)]) >= tuple(since)

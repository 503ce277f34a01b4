"""Atomic checkpoint writes for models under a tfdist strategy.

Keras writes a checkpoint in place: `model.save("model.keras")` opens the file
for writing (truncating the previous one) and fills it, and `BackupAndRestore`
does the same to `latest.weights.h5`. A process killed during that write (a
preempted worker, the OOM killer, a restart by the launcher) leaves a truncated
file where the last good checkpoint was, and the restarted job cannot resume
(`OSError: ... bad object header version number`, `BadZipFile`).

For a model built under a tfdist strategy, the registry's patches
(`patch_implementations`, installed with every tfdist strategy) make these writes
atomic: each file is written to a temporary file in the same folder
(`.tfdist-<pid>-<name>`), flushed to disk, and renamed over the target with
`os.replace`. Until the rename the previous checkpoint is untouched; after it
the new one is whole. Covered:

* `model.save(path)` (`.keras`, `.h5`) and `model.save_weights(path)`
  (`.weights.h5`), so also `ModelCheckpoint`, which calls them;
* `BackupAndRestore`: its weights and `training_metadata.json` are written as
  a pair (both temporary files first, then the weights renamed, then the
  metadata). A kill between the two renames leaves the metadata's temporary
  file alone; the next `fit` renames it before restoring, so the restored
  epoch always belongs to the restored weights. Temporary files of
  interrupted writes are removed then.

Every other model runs Keras's own code, unchanged. Keras's own (non-atomic)
writes remain for what a rename cannot cover: remote paths (`gs://`, ...),
`zipped=False` folders, sharded weights (`max_shard_size`), file objects, and
`keras.saving.save_model(model, ...)` called directly rather than through
`model.save`. docs/operations.md ("Checkpoints") has the guarantees and the
measured kill tests.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from typing import Callable, TypeVar

from tfdist._compat import keras as kc
from tfdist.strategies.base import is_tfdist_strategy

T = TypeVar("T")

TEMPORARY_PREFIX = ".tfdist-"
_TEMPORARY = re.compile(r"^\.tfdist-(\d+)-(.+)$")
_MODEL_SUFFIXES = (".keras", ".h5", ".hdf5")
_WEIGHTS_SUFFIX = ".weights.h5"


def _is_tfdist_model(model) -> bool:
    return is_tfdist_strategy(kc.model_strategy(model))


# ---------------------------------------------------------------------------
# Writing one file atomically.
# ---------------------------------------------------------------------------


def temporary_path(path: str) -> str:
    """The temporary file this process writes `path` to before renaming it into place.

    Same folder (a rename within one file system is atomic), same suffix (Keras
    checks it), hidden, and named by the writer's pid so that a leftover of a
    killed writer can be told from a write in progress.
    """
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{TEMPORARY_PREFIX}{os.getpid()}-{name}")


def _parse_temporary(entry: str):
    """(writer pid, target name) of a temporary file's name, or None."""
    match = _TEMPORARY.match(entry)
    if match is None:
        return None
    pid, name = int(match.group(1)), match.group(2)
    # A save wrapped twice (the parameter-server loop's own rename) nests the names.
    while (inner := _TEMPORARY.match(name)) is not None:
        name = inner.group(2)
    return pid, name


def _writer_is_gone(pid: int) -> bool:
    if pid == os.getpid():  # a pid reused by this process: its writer is gone
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_leftovers(folder: str, name: str) -> list[str]:
    """Removes the temporary files of killed writes of `name` in `folder`.

    A temporary file is a leftover when the process that wrote it no longer
    runs on this host. Returns the names removed, sorted.

    Args:
        folder: str. The folder holding the checkpoint.
        name: str. The checkpoint's file name, e.g. `"model.keras"`.

    Example:

    ```python
    tfdist.checkpointing.remove_leftovers("/ckpt", "model.keras")
    ```
    """
    removed = []
    for entry in _listdir(folder):
        parsed = _parse_temporary(entry)
        if parsed is not None and parsed[1] == name and _writer_is_gone(parsed[0]):
            _remove(os.path.join(folder, entry))
            removed.append(entry)
    return sorted(removed)


def write_atomically(path: str, write: Callable[[str], T]) -> T:
    """Runs `write(temporary)` and renames the temporary file over `path`.

    The file at `path` is either the previous one or the whole new one, whenever
    the process is killed; a write that raises leaves `path` untouched and no
    temporary file. The new file is flushed to disk before the rename.

    Args:
        path: str. The file to write; its folder must exist.
        write: callable. Writes a complete file at the path it is given.

    Returns:
        What `write` returned.

    Example:

    ```python
    write_atomically("/ckpt/model.keras", lambda temporary: model.save(temporary))
    ```
    """
    folder, name = os.path.split(os.path.abspath(path))
    remove_leftovers(folder, name)
    temporary = temporary_path(path)
    try:
        result = write(temporary)
        _fsync(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            _remove(temporary)
    _fsync(folder)
    return result


def _fsync(path: str) -> None:
    # Without it a machine that loses power may show the renamed file empty.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a folder this process may write but not read
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync of a folder
        pass
    finally:
        os.close(fd)


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------
# model.save / model.save_weights.
# ---------------------------------------------------------------------------


def _is_remote(path) -> bool:
    path = os.fspath(path)
    return "://" in path or kc.is_remote_path(path)


def _local_file(filepath, suffixes) -> str | None:
    """`filepath` as a local path when a rename can make its write atomic, else None."""
    if not isinstance(filepath, (str, os.PathLike)):
        return None  # a file object
    path = os.fspath(filepath)
    if not isinstance(path, str) or not path.endswith(suffixes) or _is_remote(path):
        return None
    folder, name = os.path.split(os.path.abspath(path))
    if name.startswith(TEMPORARY_PREFIX) or not os.path.isdir(folder):
        return None  # already a temporary file; or let Keras report the missing folder
    return path


def _patched_save(original):
    @functools.wraps(original)
    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        path = _local_file(filepath, _MODEL_SUFFIXES) if zipped in (None, True) else None
        if path is None or not _is_tfdist_model(self):
            return original(self, filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        if not overwrite and os.path.exists(path) and not kc.ask_to_proceed_with_overwrite(path):
            return None
        return write_atomically(
            path, lambda temporary: original(self, temporary, overwrite=True, zipped=zipped, **kwargs)
        )

    return save


def _patched_save_weights(original):
    @functools.wraps(original)
    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        path = _local_file(filepath, (_WEIGHTS_SUFFIX,)) if max_shard_size is None else None
        if path is None or not _is_tfdist_model(self):
            return original(self, filepath, overwrite=overwrite, max_shard_size=max_shard_size)
        if not overwrite and os.path.exists(path) and not kc.ask_to_proceed_with_overwrite(path):
            return None
        return write_atomically(path, lambda temporary: original(self, temporary, overwrite=True))

    return save_weights


# ---------------------------------------------------------------------------
# BackupAndRestore: weights and metadata as one atomic pair.
# ---------------------------------------------------------------------------


def recover_backup(backup_dir: str, weights: str, metadata: str, writer: bool) -> list[str]:
    """Completes or discards a `BackupAndRestore` write that a kill interrupted.

    The backup is written as: weights to a temporary file, metadata to a
    temporary file, weights renamed into place, metadata renamed into place. A
    metadata temporary file without a weights temporary file of the same
    writer was therefore complete, and its weights already in place: it is
    renamed now. Every other temporary file belongs to a write that never
    finished; the previous backup is whole, and the writer (`writer=True`: the
    process that writes this folder) removes them. A reader (a non-chief
    worker restoring from the chief's folder) only completes the rename, which
    is the same rename whoever makes it.

    Args:
        backup_dir: str. The `BackupAndRestore`'s folder.
        weights: str. Its `latest.weights.h5` path.
        metadata: str. Its `training_metadata.json` path.
        writer: bool. Whether this process writes the folder.

    Returns:
        The names of the temporary files removed, sorted.
    """
    weights_name, metadata_name = os.path.basename(weights), os.path.basename(metadata)
    temporaries = {}
    for entry in _listdir(backup_dir):
        parsed = _parse_temporary(entry)
        if parsed is not None:
            temporaries[entry] = parsed
    writing_weights = {pid for pid, name in temporaries.values() if name == weights_name}
    pending = [
        entry for entry, (pid, name) in temporaries.items() if name == metadata_name and pid not in writing_weights
    ]
    if pending:
        newest = max(pending, key=lambda e: os.stat(os.path.join(backup_dir, e)).st_mtime_ns)
        try:
            os.replace(os.path.join(backup_dir, newest), metadata)
        except FileNotFoundError:  # another process completed it first
            pass
        del temporaries[newest]
    if not writer:
        return []
    for entry in temporaries:
        _remove(os.path.join(backup_dir, entry))
    return sorted(temporaries)


def _save_backup(callback) -> None:
    """`BackupAndRestore._save_model` for a tfdist model: the same files, written atomically."""
    weights, metadata, previous_weights, previous_metadata = kc.backup_and_restore_files(callback)
    os.makedirs(callback.backup_dir, exist_ok=True)
    if callback.double_checkpoint:
        for current, previous in ((weights, previous_weights), (metadata, previous_metadata)):
            if os.path.exists(current):
                write_atomically(previous, functools.partial(shutil.copyfile, current))
    weights_temporary, metadata_temporary = temporary_path(weights), temporary_path(metadata)
    try:
        # Keras's own save (with its collectives, where the strategy has them);
        # the name is already a temporary one, so it is written as given.
        callback.model.save_weights(weights_temporary, overwrite=True)
        _fsync(weights_temporary)
        with open(metadata_temporary, "w") as f:
            f.write(json.dumps(kc.backup_and_restore_position(callback)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(weights_temporary, weights)
    except BaseException:
        _remove(weights_temporary)
        _remove(metadata_temporary)
        raise
    os.replace(metadata_temporary, metadata)
    _fsync(callback.backup_dir)


def _patched_backup_save(original):
    @functools.wraps(original)
    def _save_model(self):
        if not _is_tfdist_model(self.model) or _is_remote(self.backup_dir):
            return original(self)
        return _save_backup(self)

    return _save_model


def _patched_backup_restore(original):
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        if _is_tfdist_model(self.model) and not _is_remote(self.backup_dir):
            weights, metadata, _, _ = kc.backup_and_restore_files(self)
            writer = getattr(kc.model_strategy(self.model), "is_chief", True)
            recover_backup(os.fspath(self.backup_dir), weights, metadata, writer=writer)
        return original(self, logs)

    return on_train_begin


def patch_implementations() -> dict:
    """`{patch name: wrapper(original) -> replacement}` for the registry's checkpoint patches.

    Declared in `tfdist._compat.patches` (`Model.save`, `Model.save_weights`,
    `BackupAndRestore.on_train_begin`, `BackupAndRestore._save_model`);
    installed with every tfdist strategy, so checkpoint writes of models
    under it are atomic. Every other model runs Keras's own code.
    """
    return {
        "Model.save": _patched_save,
        "Model.save_weights": _patched_save_weights,
        "BackupAndRestore.on_train_begin": _patched_backup_restore,
        "BackupAndRestore._save_model": _patched_backup_save,
    }

"""Checkpoints of models under a tfdist strategy: atomic, checksummed, named in errors, resumable exactly.

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

Also, for those models:

* a `.weights.h5` it writes carries a SHA-256 of its variables' values (an
  attribute of the file, `tfdist_sha256`), checked by `load_weights` and by
  `BackupAndRestore` before anything is loaded; a `.keras` file's members are
  checked against the CRC-32 the zip format keeps (`verify`). Corruption is a
  `CheckpointError` naming the file, and the model keeps its state;
* every read or write error names the file (`CheckpointError`, an `OSError`);
* a write that would not fit beside the previous file is written in memory
  first, so a full disk is a `CheckpointError` (`errno.ENOSPC`) instead of
  h5py's segmentation fault;
* `BackupAndRestore` resumes exactly: its metadata records the input's
  position (`tfdist.resume`), and a stop signal during `fit` saves it at the
  next step boundary (`tfdist.preemption`).

Every other model runs Keras's own code, unchanged. Keras's own (non-atomic)
writes remain for what a rename cannot cover: remote paths (`gs://`, ...),
`zipped=False` folders, sharded weights (`max_shard_size`), file objects, and
`keras.saving.save_model(model, ...)` called directly rather than through
`model.save`. docs/operations.md ("Checkpoints", "Preemption") has the
guarantees and the measured kill tests.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import inspect
import io
import json
import os
import re
import shutil
import weakref
import zipfile
from typing import Callable, Optional, TypeVar

import h5py
import numpy as np

from tfdist import launch, preemption, resume
from tfdist._compat import keras as kc
from tfdist.engine.loop import KERAS_FIT
from tfdist.strategies.base import is_tfdist_strategy

T = TypeVar("T")

TEMPORARY_PREFIX = ".tfdist-"
_TEMPORARY = re.compile(r"^\.tfdist-(\d+)-(.+)$")
_MODEL_SUFFIXES = (".keras", ".h5", ".hdf5")
_WEIGHTS_SUFFIX = ".weights.h5"


def _is_tfdist_model(model) -> bool:
    return is_tfdist_strategy(kc.model_strategy(model))


class CheckpointError(OSError):
    """A checkpoint could not be read or written; the message names the file, the cause and the fix."""


def _error(action: str, path: str, cause: BaseException, fix: str = "") -> CheckpointError:
    """A `CheckpointError` for `cause`, keeping its errno (ENOSPC, EACCES, ...)."""
    detail = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
    message = f"Cannot {action} checkpoint '{os.fspath(path)}': {detail}"
    if fix:
        message += f". {fix}"
    number = getattr(cause, "errno", None)
    return CheckpointError(number, message) if isinstance(number, int) else CheckpointError(message)


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
    except OSError as e:
        if isinstance(e, CheckpointError):
            raise
        raise _error("write", path, e, _untouched(path)) from e
    finally:
        if os.path.lexists(temporary):
            _remove(temporary)
    _fsync(folder)
    return result


def _untouched(path: str) -> str:
    return "The previous checkpoint there is untouched" if os.path.exists(path) else "Nothing was written there"


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
# Free space, and `.weights.h5` files written whole or not at all.
# ---------------------------------------------------------------------------

# Beyond the variables' bytes, an HDF5 weights file's own structure: measured
# 4-20 KiB for the test models; 64 KiB leaves room for large layer counts.
_H5_OVERHEAD_BYTES = 64 * 1024


def estimated_size(model) -> int:
    """Bytes a `.weights.h5` of `model` takes, about: its variables' values and the optimizer's, plus 64 KiB.

    Args:
        model: a built Keras model.

    Example:

    ```python
    tfdist.checkpointing.estimated_size(model) / 2**20   # MiB an atomic write needs free
    ```
    """
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables += list(optimizer.variables)
    total = 0
    for v in variables:
        total += int(np.prod(v.shape)) * np.dtype(getattr(v, "dtype", "float32")).itemsize
    return total + _H5_OVERHEAD_BYTES


def free_bytes(folder: str) -> Optional[int]:
    """Bytes an unprivileged write may still use in `folder`'s file system, or None where unknown."""
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def _write_weights(model, temporary: str, target: str, keras_save_weights: Callable[[str], object]) -> None:
    """Writes `model`'s `.weights.h5` to `temporary`, with its checksum.

    h5py writes the file as Keras fills it; when the disk fills up midway its
    close fails and the process dies of a segmentation fault (h5py 3.14,
    HDF5 1.14: `File.close` after failed writes), in plain Keras too. Where
    the folder has less than twice the estimated size free, the file is made
    in memory and written with Python's own I/O, so that a full disk is an
    `OSError` (ENOSPC) naming the file, as for any other write.
    """
    folder = os.path.dirname(os.path.abspath(temporary))
    needed = estimated_size(model)
    free = free_bytes(folder)
    if free is None or free >= 2 * needed:
        keras_save_weights(temporary)
        seal(temporary)
        return
    buffer = io.BytesIO()
    kc.write_weights_h5(model, buffer)
    _seal_file(buffer)
    data = buffer.getvalue()
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
    except OSError as e:
        if e.errno == errno.ENOSPC:
            _remove(temporary)
            raise _error(
                "write", target, e,
                f"It needs {_mib(len(data))} beside the previous file until the rename replaces it; "
                f"{_mib(free_bytes(folder) or 0)} are free in {folder}. Free "
                "space there or write elsewhere (docs/operations.md, Checkpoints). "
                + _untouched(target),
            ) from e
        raise


# ---------------------------------------------------------------------------
# Checksums: `.weights.h5` files carry one; `.keras` files their zip CRC-32s.
# ---------------------------------------------------------------------------

CHECKSUM_ATTRIBUTE = "tfdist_sha256"


def _digest(h5: h5py.File) -> str:
    """SHA-256 over every dataset's path, dtype, shape and bytes, in path order."""
    sha = hashlib.sha256()
    names: list = []
    h5.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    for name in sorted(names):
        dataset = h5[name]
        value = dataset[()]
        sha.update(f"{name}|{dataset.dtype.str}|{dataset.shape}|".encode())
        if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU":
            sha.update(np.ascontiguousarray(value).tobytes())
        else:
            sha.update(repr(value).encode())
    return sha.hexdigest()


def _seal_file(file) -> str:
    with h5py.File(file, "r+") as h5:
        digest = _digest(h5)
        h5.attrs[CHECKSUM_ATTRIBUTE] = digest
    return digest


def seal(path: str) -> str:
    """Writes the SHA-256 of a `.weights.h5` file's values into it (`tfdist_sha256`); returns it.

    Args:
        path: str. A `.weights.h5` file, before it is renamed into place.

    Example:

    ```python
    tfdist.checkpointing.seal("/ckpt/.tfdist-123-model.weights.h5")
    ```
    """
    return _seal_file(path)


def verify(path: str) -> Optional[str]:
    """Checks a checkpoint file against its checksum; returns the `.weights.h5` SHA-256, if it has one.

    A `.weights.h5` written by tfdist holds the SHA-256 of its values; a
    `.keras` (zip) file holds a CRC-32 of each member, which Keras does not
    read back (h5py reads the weights with seeks). Files without a checksum
    (a `.weights.h5` written by plain Keras) are only opened.

    Args:
        path: str. A `.weights.h5` or `.keras` file.

    Raises:
        CheckpointError: the file cannot be opened, or its content does not
            match its checksum; the message names the file.

    Example:

    ```python
    tfdist.checkpointing.verify("/runs/backup/latest.weights.h5")
    ```
    """
    path = os.fspath(path)
    fix = ("The file was changed or damaged after it was written (a copy cut short, a disk error); "
           "restore it from another copy, or delete it to start over")
    if path.endswith(".keras"):
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as e:
            raise _error("read", path, e, fix) from None
        if bad is not None:
            raise _error("read", path, ValueError(f"member {bad!r} does not match its CRC-32"), fix)
        return None
    if not path.endswith(".h5"):
        return None
    try:
        with h5py.File(path, "r") as h5:
            stored = h5.attrs.get(CHECKSUM_ATTRIBUTE)
            if stored is None:
                return None
            stored = stored.decode() if isinstance(stored, bytes) else str(stored)
            actual = _digest(h5)
    except OSError as e:
        raise _error("read", path, e, fix) from None
    if actual != stored:
        raise _error("read", path, ValueError(f"its values do not match its SHA-256 ({stored[:12]}..., "
                                              f"computed {actual[:12]}...)"), fix)
    return stored


# ---------------------------------------------------------------------------
# model.save / model.save_weights / model.load_weights.
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
        write_atomically(
            path,
            lambda temporary: _write_weights(
                self, temporary, path, lambda t: original(self, t, overwrite=True)
            ),
        )
        return None

    return save_weights


def _patched_load_weights(original):
    @functools.wraps(original)
    def load_weights(self, filepath, *args, **kwargs):
        if not _is_tfdist_model(self) or not isinstance(filepath, (str, os.PathLike)) or _is_remote(filepath):
            return original(self, filepath, *args, **kwargs)
        path = os.fspath(filepath)
        verify(path)
        try:
            return original(self, filepath, *args, **kwargs)
        except CheckpointError:
            raise
        except OSError as e:
            raise _error("read", path, e) from e
        except ValueError as e:
            if path in str(e):
                raise
            raise ValueError(f"Cannot load checkpoint '{path}' into model '{self.name}': {e}") from e

    return load_weights


# ---------------------------------------------------------------------------
# BackupAndRestore: weights and metadata as one atomic pair, resumed exactly.
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


def _read_metadata(path: str) -> dict:
    """A backup's `training_metadata.json`, validated; `CheckpointError` naming it otherwise."""
    fix = ("The backup's weights were not loaded. Restore the file from another copy, or delete the "
           "backup folder to start over")
    try:
        with open(path) as f:
            data = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise _error("read", path, e, fix) from None
    if not isinstance(data, dict) or not isinstance(data.get("epoch"), int):
        raise _error("read", path, ValueError(f"expected an object with an integer 'epoch', got {data!r}"), fix)
    return data


def _load_backup(callback, weights: str, metadata: str) -> Optional[resume.Position]:
    """`BackupAndRestore._load_model` for a tfdist model: metadata checked first, weights verified, then loaded."""
    model = callback.model
    if not model.built:
        raise ValueError(
            "To use the BackupAndRestore callback, you model must be built before you call `fit()`. "
            f"Model {model} is unbuilt. You can build it beforehand by calling it on a batch of data."
        )
    data = _read_metadata(metadata) if os.path.exists(metadata) else None
    if os.path.exists(weights):
        digest = verify(weights)
        saved = ((data or {}).get("tfdist") or {}).get("weights_sha256")
        if digest is not None and saved is not None and saved != digest:
            raise _error("read", weights, ValueError(
                f"its SHA-256 ({digest[:12]}...) is not the one {os.path.basename(metadata)} recorded for the "
                f"backup ({saved[:12]}...): the two files come from different saves"),
                "Restore both from the same backup, or delete the folder to start over")
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            # As Keras: the optimizer's variables must exist before they are loaded.
            optimizer.build(model.trainable_variables)
        model.load_weights(weights)  # all or nothing (keras_integration's guard)
    if data is None:
        return None
    kc.set_resume_epoch(model, data["epoch"])
    return resume.Position.from_metadata(data)


def _restore_backup(callback) -> Optional[resume.Position]:
    weights, metadata, previous_weights, previous_metadata = kc.backup_and_restore_files(callback)
    try:
        return _load_backup(callback, weights, metadata)
    except CheckpointError as error:
        # As Keras: with double_checkpoint, a damaged backup gives way to the one before it.
        if not callback.double_checkpoint or not os.path.exists(previous_weights):
            raise
        print(f"tfdist: {error}; restoring the previous backup {previous_weights} instead.", flush=True)
        write_atomically(weights, functools.partial(shutil.copyfile, previous_weights))
        if os.path.exists(previous_metadata):
            write_atomically(metadata, functools.partial(shutil.copyfile, previous_metadata))
        elif os.path.exists(metadata):
            _remove(metadata)
        return _load_backup(callback, weights, metadata)


class _Fit:
    """What one `fit` of a tfdist model with a `BackupAndRestore` keeps: its position and its preemption watch."""

    def __init__(self, callback, tracker: resume.FitTracker, watch: Optional[preemption.PreemptionWatch]):
        self.callback = callback
        self.tracker = tracker
        self.watch = watch
        self.in_batch_end = False

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.tracker.close()


# The `fit` in progress of each model, and how it was called.
_fits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_fit_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _job_size(strategy) -> tuple[int, int]:
    return int(getattr(strategy, "num_workers", 1) or 1), int(strategy.num_replicas_in_sync)


def _position(callback, epoch_end: bool) -> Optional[resume.Position]:
    fit = _fits.get(callback.model)
    if fit is None or fit.callback is not callback:
        return None
    optimizer = callback.model.optimizer
    step = int(optimizer.iterations.numpy()) if optimizer is not None else None
    workers, replicas = _job_size(kc.model_strategy(callback.model))
    return fit.tracker.position(epoch_end, step, workers, replicas)


def _save_backup(callback, position: Optional[resume.Position] = None) -> None:
    """`BackupAndRestore._save_model` for a tfdist model: the same files, written atomically, with the position."""
    weights, metadata, previous_weights, previous_metadata = kc.backup_and_restore_files(callback)
    os.makedirs(callback.backup_dir, exist_ok=True)
    if callback.double_checkpoint:
        for current, previous in ((weights, previous_weights), (metadata, previous_metadata)):
            if os.path.exists(current):
                write_atomically(previous, functools.partial(shutil.copyfile, current))
    record = kc.backup_and_restore_position(callback)
    if position is None:
        fit = _fits.get(callback.model)
        position = _position(callback, epoch_end=not (fit is not None and fit.in_batch_end))
    if position is not None:
        record = {"epoch": position.epoch, "batch": max(position.steps_done - 1, 0),
                  "tfdist": position.to_metadata()}
    weights_temporary, metadata_temporary = temporary_path(weights), temporary_path(metadata)
    try:
        # Keras's own save (with its collectives, where the strategy has them);
        # the name is already a temporary one, so it is written as given.
        _write_weights(callback.model, weights_temporary, weights,
                       lambda t: callback.model.save_weights(t, overwrite=True))
        _fsync(weights_temporary)
        if "tfdist" in record:
            with h5py.File(weights_temporary, "r") as h5:
                record["tfdist"]["weights_sha256"] = str(h5.attrs[CHECKSUM_ATTRIBUTE])
        with open(metadata_temporary, "w") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(weights_temporary, weights)
    except OSError as e:
        _remove(weights_temporary)
        _remove(metadata_temporary)
        if isinstance(e, CheckpointError):
            raise
        raise _error("write", weights, e, _untouched(weights)) from e
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
        if not _is_tfdist_model(self.model) or _is_remote(self.backup_dir):
            return original(self, logs)
        strategy = kc.model_strategy(self.model)
        weights, metadata, _, _ = kc.backup_and_restore_files(self)
        writer = getattr(strategy, "is_chief", True)
        recover_backup(os.fspath(self.backup_dir), weights, metadata, writer=writer)
        position = _restore_backup(self)
        if self.model in _fits or getattr(strategy, "host_loop", KERAS_FIT) is not KERAS_FIT:
            return None  # a second BackupAndRestore in one fit; or a loop of the strategy's own
        keeps_iterator = _fit_calls.get(self.model, {}).get("steps_per_epoch") is not None
        tracker = resume.FitTracker(self.model, keeps_iterator=keeps_iterator, resume=position)
        tracker.install()
        watch = preemption.PreemptionWatch(strategy)
        _fits[self.model] = _Fit(self, tracker, watch if watch.start() else None)
        if position is not None and writer:
            steps = (self.params or {}).get("steps")
            workers, replicas = _job_size(strategy)
            saved_by = (f"saved by {position.workers} worker(s), {position.replicas} replica(s); now {workers}, "
                        f"{replicas}" if position.workers is not None else "saved by Keras's own callback")
            if not position.steps_done:
                following = "the epoch begins"
            elif steps and position.steps_done >= steps:
                following = "its steps are done; the epoch ends"
            else:
                following = f"the next step is {position.steps_done + 1}"
            print(f"{launch.RESUMED_PREFIX}{os.fspath(self.backup_dir)} at {position.describe(steps)}: {following} "
                  f"({saved_by}).", flush=True)
        return None

    return on_train_begin


def _patched_backup_epoch_begin(original):
    @functools.wraps(original)
    def on_epoch_begin(self, epoch, logs=None):
        fit = _fits.get(self.model)
        if fit is not None and fit.callback is self:
            fit.tracker.on_epoch_begin(epoch)
        return original(self, epoch, logs)

    return on_epoch_begin


def _patched_backup_batch_end(original):
    @functools.wraps(original)
    def on_train_batch_end(self, batch, logs=None):
        fit = _fits.get(self.model)
        if fit is None or fit.callback is not self:
            return original(self, batch, logs)
        fit.tracker.on_batch_end(batch)
        if fit.tracker.skipping:
            # A resumed epoch's steps already in the weights: no save, no preemption boundary.
            kc.set_backup_and_restore_batch(self, batch)
            return None
        fit.in_batch_end = True
        try:
            original(self, batch, logs)
        finally:
            fit.in_batch_end = False
        if fit.watch is not None:
            fit.watch.at_step_boundary(lambda: _save_for_preemption(self, fit))
        return None

    return on_train_batch_end


def _save_for_preemption(callback, fit: _Fit) -> tuple[str, str]:
    position = _position(callback, epoch_end=False)
    _save_backup(callback, position)
    steps = (callback.params or {}).get("steps")
    if getattr(kc.model_strategy(callback.model), "is_chief", True):
        place = os.fspath(callback.backup_dir)
    else:
        place = "its own temporary copy (the chief's backup is the one a relaunch reads)"
    return position.describe(steps), place


def _patched_backup_train_end(original):
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        fit = _fits.get(self.model)
        if fit is not None and fit.callback is self:
            _fits.pop(self.model, None).close()
        return original(self, logs)

    return on_train_end


def fit_bookkeeping(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        if not _is_tfdist_model(self):
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
            _fit_calls[self] = {"steps_per_epoch": bound.arguments.get("steps_per_epoch")}
        except TypeError:
            pass  # Keras reports the bad arguments
        try:
            return original(self, *args, **kwargs)
        finally:
            # A fit that raised (or exited on preemption) never reached on_train_end.
            _fit_calls.pop(self, None)
            fit_state = _fits.pop(self, None)
            if fit_state is not None:
                fit_state.close()

    return fit


def patch_implementations() -> dict:
    """`{patch name: wrapper(original) -> replacement}` for the registry's checkpoint patches.

    Declared in `tfdist._compat.patches` (`Model.save`, `Model.save_weights`,
    `Model.load_weights`, and `BackupAndRestore`'s `on_train_begin`,
    `on_epoch_begin`, `on_train_batch_end`, `on_train_end` and `_save_model`);
    installed with every tfdist strategy, so checkpoint writes of models under
    it are atomic and checked, backups resume mid-epoch exactly, and a
    preempted job saves at its next step. Every other model runs Keras's own
    code. `fit_bookkeeping` wraps `fit` inside the integration layer's own
    `fit` patch (one registry entry per attribute).
    """
    return {
        "Model.save": _patched_save,
        "Model.save_weights": _patched_save_weights,
        "Model.load_weights": _patched_load_weights,
        "BackupAndRestore.on_train_begin": _patched_backup_restore,
        "BackupAndRestore.on_epoch_begin": _patched_backup_epoch_begin,
        "BackupAndRestore.on_train_batch_end": _patched_backup_batch_end,
        "BackupAndRestore.on_train_end": _patched_backup_train_end,
        "BackupAndRestore._save_model": _patched_backup_save,
    }

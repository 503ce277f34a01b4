"""The TensorFlow and Keras versions tfdist supports, declared once.

`setup.py` builds its requirements from these bounds (it reads this file
without importing tfdist), `make test-compat` trains the parity smoke at the
lower bounds, the suite at the newest, and a tfdist strategy refuses to be
created outside them (`check`), naming the installed and supported versions
and the fix. Each bound is a release that was tested (lower) or the next
minor after the newest tested (upper, exclusive). docs/compat.md says how.

Imports neither TensorFlow nor Keras at import time.
"""

from __future__ import annotations

import re

# (oldest supported release, first unsupported minor): `>=low,<high`.
TENSORFLOW = ("2.16.1", "2.22")
# Keras 3.10 is the first whose metric variables synchronise on read (each
# replica's updates kept apart and summed when read): on 3.8 and 3.9 every
# strategy's logged and evaluated metrics differ from one device's (accuracy
# 0.140 for 0.117). 3.5 to 3.7 also lack the per-replica loss scaling
# (`keras.src.losses.loss.scale_loss_for_distribution`) tfdist's step weighs against.
KERAS = ("3.10.0", "3.16")
# tf-keras (the `legacy` extra) is released with TensorFlow, one minor each.
TF_KERAS = ("2.16.0", "2.22")

_PACKAGES = {"tensorflow": TENSORFLOW, "keras": KERAS, "tf-keras": TF_KERAS}
_LABELS = {"tensorflow": "TensorFlow", "keras": "Keras"}


class UnsupportedVersionError(RuntimeError):
    """TensorFlow or Keras is outside the versions tfdist supports; the message names both and the fix."""


def requirement(package: str) -> str:
    """The pip requirement of `package` ("tensorflow", "keras", "tf-keras"): `"keras>=3.8.0,<3.16"`."""
    low, high = _PACKAGES[package]
    return f"{package}>={low},<{high}"


def parse(version: str) -> tuple[int, ...]:
    """`"2.21.0"` → (2, 21, 0); a pre-release or build suffix is dropped (`"2.22.0-dev2025"` → (2, 22, 0))."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"Argument 'version' must start with major.minor. Received: version={version!r}")
    return tuple(int(part) for part in match.groups(default="0"))


def installed() -> dict[str, tuple[int, ...]]:
    """The installed TensorFlow's and Keras's versions, as `parse` reads them: the one place tfdist reads them."""
    import keras
    import tensorflow as tf

    return {"tensorflow": parse(tf.__version__), "keras": parse(keras.__version__)}


def _within(version: tuple[int, ...], bounds: tuple[str, str]) -> bool:
    low, high = parse(bounds[0]), parse(bounds[1])[:2]
    return low <= version and version[:2] < high


def check() -> None:
    """Raises `UnsupportedVersionError` unless the installed TensorFlow and Keras are within the declared bounds.

    Called when a tfdist strategy is created, before any patch is installed.
    """
    found = installed()
    outside = [name for name in ("tensorflow", "keras") if not _within(found[name], _PACKAGES[name])]
    if not outside:
        return
    have = " and ".join(f"{_LABELS[name]} {'.'.join(map(str, found[name]))}" for name in ("tensorflow", "keras"))
    wanted = " and ".join(f"{_LABELS[name]} {requirement(name).split(name, 1)[1]}" for name in ("tensorflow", "keras"))
    raise UnsupportedVersionError(
        f"tfdist supports {wanted}; this process has {have}. Install supported versions, e.g. "
        f"pip install '{requirement('tensorflow')}' '{requirement('keras')}' (docs/compat.md), "
        "then restart the process. Models outside tfdist strategies are unaffected."
    )


if __name__ == "__main__":
    # `python tfdist/_compat/versions.py --oldest`: the pip pins of the oldest supported
    # versions, for `make test-compat` (run by path: no tfdist import, no TensorFlow).
    import sys

    if sys.argv[1:] != ["--oldest"]:
        sys.exit("usage: python tfdist/_compat/versions.py --oldest")
    print(f"tensorflow=={TENSORFLOW[0]} keras=={KERAS[0]}")

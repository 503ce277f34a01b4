"""The 8x8 handwritten-digits dataset (UCI, CC BY 4.0), bundled with tfdist."""

from __future__ import annotations

import gzip
import os

import numpy as np

_PATH = os.path.join(os.path.dirname(__file__), "digits.csv.gz")


def load_digits(
    normalize: bool = True, flatten: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Loads the bundled 8x8 handwritten-digits dataset.

    Args:
        normalize: bool. If `True` (default), pixels are float32 in [0, 1];
            otherwise the raw integers 0..16 as float32.
        flatten: bool. If `True` (default), images have shape `(64,)`;
            otherwise `(8, 8, 1)`.

    Returns:
        A tuple `(x, y)`: `x` of shape `(1797, 64)` (or `(1797, 8, 8, 1)`)
        and `y` int32 labels 0..9 of shape `(1797,)`.

    Example:

    ```python
    x, y = tfdist.datasets.load_digits()
    ```
    """
    with gzip.open(_PATH, "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = data[:, :64]
    y = data[:, 64].astype(np.int32)
    if normalize:
        x = x / 16.0
    if not flatten:
        x = x.reshape(-1, 8, 8, 1)
    return x.astype(np.float32), y

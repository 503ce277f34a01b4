"""Real variable-length text for the data tests: docstrings of the Python standard library."""

from __future__ import annotations

import importlib
import inspect
import re
import zlib

import numpy as np

MODULES = ("json", "collections", "functools", "textwrap", "string", "random", "statistics", "fractions", "calendar", "csv")
VOCAB = 512


def docstring_examples(modules=MODULES, max_examples=None):
    """`(token ids int32 [length], label)` per docstring; label 1 for a class, 0 for a function."""
    examples = []
    for name in modules:
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            doc = inspect.getdoc(obj)
            words = re.findall(r"\w+", doc or "")
            if not words:
                continue
            ids = np.array([zlib.crc32(w.encode()) % (VOCAB - 1) + 1 for w in words], np.int32)
            examples.append((ids, int(inspect.isclass(obj))))
    return examples[:max_examples] if max_examples else examples

"""Small real datasets bundled with tfdist, so tests and demos never download."""

from tfdist.datasets.digits import load_digits

__all__ = ["load_digits"]

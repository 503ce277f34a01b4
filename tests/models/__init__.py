"""A zoo of small Keras models, one per family, for conformance tests under every strategy."""

"""Private Keras and TensorFlow APIs, version-gated, behind named functions.

`tfdist._compat.keras` and `tfdist._compat.tf` are the only modules of tfdist
that import `keras.src` or `tensorflow.python`, or read a private attribute of
a Keras or TensorFlow object (`tests/test_layering.py` checks it). They import
no other tfdist module, so every layer may use them.
"""

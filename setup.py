"""tfdist: distribution strategies for Keras 3 and TensorFlow."""

import os
import runpy

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    LONG_DESCRIPTION = f.read()

# The supported TensorFlow and Keras versions, declared once in tfdist/_compat/versions.py
# (read here without importing tfdist; a strategy checks them at creation, docs/compat.md).
VERSIONS = runpy.run_path(os.path.join(HERE, "tfdist", "_compat", "versions.py"))
requirement = VERSIONS["requirement"]

setup(
    name="tfdist",
    version="0.1.0",
    description="Distribution strategies for Keras 3 and TensorFlow: mirrored, multi-worker, "
    "central storage, parameter server, sharded optimizer (ZeRO).",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["tfdist", "tfdist.*"]),
    package_data={"tfdist": ["datasets/*.csv.gz", "datasets/README.md"]},
    install_requires=[
        requirement("tensorflow"),
        requirement("keras"),
        "numpy",
        "absl-py",
        'tomli>=1.1; python_version < "3.11"',
    ],
    extras_require={
        "legacy": [requirement("tf-keras")],
        # kubernetes: the API models tests/test_kubernetes.py validates examples/kubernetes/ against.
        "test": ["pytest>=7", "pytest-xdist>=3", requirement("tf-keras"), "tensorboard", "ruff", "kubernetes"],
        # torch: PyTorch DDP in benchmarks/vs_ddp.py (the CPU wheel; skipped there when absent).
        "bench": ["psutil", "torch==2.13.0"],
    },
    entry_points={"console_scripts": ["tfdist=tfdist.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

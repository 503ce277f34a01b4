"""Shared pieces of the step-engine tests: a tiny model, strategies, graph inspection."""

from __future__ import annotations

import collections

import keras
import numpy as np

import tfdist
from tests.conftest import DEVICES

# The synchronous strategies that run in-process on local devices. multi_worker
# runs here as one local worker (no TF_CONFIG): one replica.
LOCAL_SYNCHRONOUS = ["mirrored", "central_storage", "sharded_optimizer"]
SYNCHRONOUS = LOCAL_SYNCHRONOUS + ["multi_worker"]


def make_strategy(name: str, replicas: int = 4, **options):
    if name == "central_storage":
        return tfdist.get_strategy(name, compute_devices=DEVICES[replicas], **options)
    if name == "multi_worker":
        return tfdist.get_strategy(name, **options)
    return tfdist.get_strategy(name, devices=DEVICES[replicas], **options)


def tiny_model(
    optimizer_fn=None,
    sync_bn: bool = False,
    seed: int = 0,
    hidden: int = 16,
    bn_momentum: float = 0.99,
    **compile_kwargs,
) -> keras.Model:
    """64 → hidden (→ synchronized BatchNorm) → relu → 10, compiled; deterministic weights.

    The hidden layer has no bias when BatchNorm follows it: BatchNorm cancels
    a bias, whose gradient is then rounding noise that no comparison can use.
    """
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,)), keras.layers.Dense(hidden, use_bias=not sync_bn)]
    if sync_bn:
        layers.append(keras.layers.BatchNormalization(synchronized=True, momentum=bn_momentum))
    layers += [keras.layers.Activation("relu"), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    optimizer = optimizer_fn() if optimizer_fn else keras.optimizers.SGD(0.1)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    return model


def with_policy(policy: str | None, fn):
    """Runs `fn()` with Keras's global dtype policy set to `policy` (None: leave it)."""
    if policy is None:
        return fn()
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return fn()
    finally:
        keras.config.set_dtype_policy(previous)


def max_relative_difference(reference, model) -> float:
    """max over weights of max|a - b| / max|a|."""
    worst = 0.0
    for a, b in zip(reference.get_weights(), model.get_weights()):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-12)))
    return worst


def op_counts(graph) -> collections.Counter:
    """Op types in `graph` and in every function it calls (branches, loop bodies), recursively."""
    counts = collections.Counter(op.type for op in graph.get_operations())
    for fn in graph._functions.values():
        inner = getattr(fn, "graph", None)
        if inner is not None:
            counts.update(op_counts(inner))
    return counts


def branch_graphs(graph, op_types=("If", "StatelessIf")) -> list:
    """`(then_graph, else_graph)` of every conditional op in `graph` and its functions."""
    found = []
    for op in graph.get_operations():
        if op.type in op_types:
            then_name = op.get_attr("then_branch").name
            else_name = op.get_attr("else_branch").name
            found.append((graph._functions[then_name].graph, graph._functions[else_name].graph))
    for fn in graph._functions.values():
        inner = getattr(fn, "graph", None)
        if inner is not None:
            found.extend(branch_graphs(inner, op_types))
    return found

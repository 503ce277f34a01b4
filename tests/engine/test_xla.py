"""XLA: each replica's forward and backward pass compiled, collectives outside."""

from __future__ import annotations

import pytest
from tensorflow.python.eager import context

from tests.engine.common import make_strategy, max_relative_difference, tiny_model


def _fit_and_collect_executed_ops(model, x, y):
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
        md = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return [n for fg in md.function_graphs for pg in fg.partition_graphs for n in pg.node]


@pytest.mark.parametrize(
    "name,how",
    [("mirrored", "compile"), ("central_storage", "option"), ("mirrored", "off")],
)
def test_jit_compile_runs_every_replica_step_under_xla(name, how, digits):
    # Upstream, model.compile(jit_compile=True) under a 2-device MirroredStrategy
    # fails with InvalidArgumentError. Synchronized BatchNorm puts a collective in
    # the middle of the forward pass: it stays outside XLA.
    x, y = digits
    x, y = x[:64], y[:64]
    reference = tiny_model(sync_bn=True)
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    strategy = make_strategy(name, replicas=2, jit_compile=how == "option")
    with strategy.scope():
        model = tiny_model(sync_bn=True, jit_compile=how == "compile")
    nodes = _fit_and_collect_executed_ops(model, x, y)
    xla_devices = {n.device.rsplit(":", 1)[-1] for n in nodes if n.op == "_XlaRun"}
    if how == "off":
        assert xla_devices == set()
    else:
        # Both replicas' devices run XLA clusters.
        assert {"0", "1"} <= xla_devices, f"_XlaRun on devices {sorted(xla_devices)}"
    assert max_relative_difference(reference, model) < 1e-4

"""XLA: each replica's forward and backward pass compiled, collectives outside."""

from __future__ import annotations

import pytest
from tensorflow.python.eager import context

from tests.engine.common import make_strategy, max_relative_difference, tiny_model


def _fit_and_collect_executed_ops(model, x, y):
    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.export_run_metadata()  # drops what an earlier test left collected
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
        model = tiny_model(sync_bn=True, **({"jit_compile": True} if how == "compile" else {}))
    nodes = _fit_and_collect_executed_ops(model, x, y)
    xla_devices = {n.device.rsplit(":", 1)[-1] for n in nodes if n.op == "_XlaRun"}
    if how == "off":
        assert xla_devices == set()
    else:
        # Both replicas' devices run XLA clusters.
        assert {"0", "1"} <= xla_devices, f"_XlaRun on devices {sorted(xla_devices)}"
    assert max_relative_difference(reference, model) < 1e-4


def _compiled_programs(nodes):
    """Devices of the compiled function calls (`_XlaMustCompile`) in the executed graphs."""
    return sorted(n.device.rsplit(":", 1)[-1] for n in nodes if n.attr["_XlaMustCompile"].b)


@pytest.mark.parametrize("sink", [1, 4])
def test_one_replica_compiles_the_whole_step_as_one_program_like_keras(sink, digits):
    # Keras's jit_compile=True compiles forward, backward and the Adam update
    # as one function; tfdist with one replica runs the same single program.
    import keras

    x, y = digits
    x, y = x[:128], y[:128]

    def adam():
        return keras.optimizers.Adam(1e-2)

    reference = tiny_model(adam, jit_compile=True)
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    strategy = make_strategy("mirrored", replicas=1, jit_compile=True, sink_size=sink)
    with strategy.scope():
        model = tiny_model(adam)
    nodes = _fit_and_collect_executed_ops(model, x, y)
    assert _compiled_programs(nodes) == ["0"]
    assert not [n for n in nodes if n.op == "_XlaRun"]
    assert max_relative_difference(reference, model) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 4


@pytest.mark.parametrize("name", ["mirrored", "multi_worker", "sharded_optimizer"])
def test_each_replica_compiles_its_forward_and_backward_as_one_program(name, digits):
    # Two replicas: one compiled forward/backward per replica device, the
    # gradient all-reduce and the update outside (a collective cannot run in XLA
    # on CPU). BatchNorm's moving statistics, written by the forward pass, are
    # recorded inside the program and assigned after it.
    import keras

    x, y = digits
    x, y = x[:128], y[:128]

    def bn_model(**kw):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(16, use_bias=False), keras.layers.BatchNormalization(),
             keras.layers.Activation("relu"), keras.layers.Dense(10)]
        )
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kw)
        return model

    # sharded_optimizer: stage 3, whose replicas compile their pass on the
    # parameters they gathered (the gathering outside, a copy from each part).
    options = {"stage": 3} if name == "sharded_optimizer" else {}
    with make_strategy(name, replicas=2, **options).scope():
        reference = bn_model()
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    with make_strategy(name, replicas=2, jit_compile=True, **options).scope():
        model = bn_model()
    nodes = _fit_and_collect_executed_ops(model, x, y)
    if name == "sharded_optimizer":
        assert _compiled_programs(nodes) == ["0", "1"]
    elif name == "mirrored":
        assert _compiled_programs(nodes) == ["0", "1"]
        assert [n.op for n in nodes if n.op.startswith("Collective")], "the all-reduce ran outside XLA"
    else:  # multi_worker without TF_CONFIG: one worker, one replica, the whole step compiled
        assert _compiled_programs(nodes) == ["0"]
    assert not [n for n in nodes if n.op == "_XlaRun"]
    moving_mean = [v for v in model.variables if "moving_mean" in v.path][0]
    assert float(abs(moving_mean.numpy()).max()) > 0.0
    assert max_relative_difference(reference, model) < 1e-4


def test_compile_jit_compile_false_against_the_strategys_jit_compile_is_an_error():
    # Before: accepted silently; XLA ran (the option wins) while model.jit_compile read False.
    strategy = make_strategy("mirrored", 2, jit_compile=True)
    with strategy.scope():
        with pytest.raises(ValueError) as info:
            tiny_model(jit_compile=False)
        assert str(info.value) == (
            "The strategy's jit_compile=True and compile(jit_compile=False) disagree; both say whether "
            "the training step is compiled with XLA. Pass only one of them (or True to both). The model "
            "was left as it was (not compiled)."
        )
        # jit_compile=True or left to Keras's "auto" agree with the option.
        assert tiny_model(jit_compile=True).compiled
        assert tiny_model().compiled

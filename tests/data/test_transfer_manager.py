"""TransferManager: input staged on each replica's device, in order, exactly once (issue 8)."""

from __future__ import annotations

import pytest
import tensorflow as tf

import tfdist
from tests.strategies.parity import strategy_for


def replica_device(i: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:CPU:{i}"


def collect(strategy, dataset):
    """Per step: [(values of replica r, device of replica r) for r]."""
    steps = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        steps.append([(v.numpy().tolist(), v.device) for v in strategy.experimental_local_results(batch)])
    return steps


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
@pytest.mark.parametrize("options", [{}, {"prefetch_depth": 1}, {"prefetch_depth": 4}], ids=["default", "depth1", "depth4"])
def test_every_example_arrives_once_in_order_on_its_replica(name, options):
    # 96 examples in global batches of 8 over 4 replicas: replica r of step s
    # gets examples 8s + 2r and 8s + 2r + 1, on its own device.
    strategy = strategy_for(name, 4, **options)
    steps = collect(strategy, tf.data.Dataset.range(96).batch(8))
    assert len(steps) == 12
    for s, replicas in enumerate(steps):
        assert [values for values, _ in replicas] == [[8 * s + 2 * r, 8 * s + 2 * r + 1] for r in range(4)]
        assert [device for _, device in replicas] == [replica_device(r) for r in range(4)]


def test_transfer_off_keeps_batches_on_the_host_in_the_same_order():
    strategy = strategy_for("mirrored", 4, transfer=False)
    steps = collect(strategy, tf.data.Dataset.range(96).batch(8))
    assert [[values for values, _ in replicas] for replicas in steps] == [
        [[8 * s + 2 * r, 8 * s + 2 * r + 1] for r in range(4)] for s in range(12)
    ]
    assert {device for replicas in steps for _, device in replicas} == {replica_device(0)}


def test_strategy_options_choose_the_input_options():
    assert tfdist.data.TransferManager.from_options(strategy_for("mirrored", 2).options).input_options() == (
        tf.distribute.InputOptions(experimental_fetch_to_device=True, experimental_per_replica_buffer_size=2)
    )
    off = tfdist.data.TransferManager.from_options(strategy_for("mirrored", 2, transfer=False).options)
    assert off.input_options() == tf.distribute.InputOptions(
        experimental_fetch_to_device=False, experimental_per_replica_buffer_size=0
    )
    explicit = tf.distribute.InputOptions(experimental_per_replica_buffer_size=5)
    assert off.input_options(explicit) is explicit


def test_explicit_input_options_win_under_central_storage():
    # Upstream CentralStorageStrategy fails on any InputOptions (a typo in
    # TensorFlow 2.21); tfdist._compat.tf.distribute_dataset works around it.
    strategy = strategy_for("central_storage", 2)
    options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(4), options)
    batch = next(iter(dist))
    assert [(v.numpy().tolist(), v.device) for v in strategy.experimental_local_results(batch)] == [
        ([0, 1], replica_device(0)),
        ([2, 3], replica_device(0)),
    ]


def test_stage_on_one_device_keeps_order():
    manager = tfdist.data.TransferManager(prefetch_depth=3)
    staged = manager.stage(tf.data.Dataset.range(10).batch(3), "/cpu:1")
    got = [(b.numpy().tolist(), b.device) for b in staged]
    assert got == [([0, 1, 2], replica_device(1)), ([3, 4, 5], replica_device(1)), ([6, 7, 8], replica_device(1)), ([9], replica_device(1))]
    plain = tf.data.Dataset.range(4)
    assert tfdist.data.TransferManager(enabled=False).stage(plain, "/cpu:1") is plain


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prefetch_depth": 0}, "Argument 'prefetch_depth' must be an integer >= 1 (batches staged ahead on each replica's device). Received: prefetch_depth=0"),
        ({"enabled": "yes"}, "Argument 'enabled' must be True or False. Received: enabled='yes'"),
    ],
)
def test_bad_manager_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        tfdist.data.TransferManager(**kwargs)
    assert str(info.value) == message


def test_bad_prefetch_depth_option():
    with pytest.raises(tfdist.OptionError) as info:
        tfdist.get_strategy("mirrored", prefetch_depth=0)
    assert str(info.value) == (
        "option 'prefetch_depth' must be an integer >= 1 (batches staged ahead on each replica's device). "
        "Received: prefetch_depth=0"
    )


def test_fit_trains_the_same_with_transfer_on_and_off(digits):
    from tests.conftest import build_model, max_relative_difference

    x, y = digits
    models = []
    for transfer in (True, False):
        with strategy_for("mirrored", 2, transfer=transfer).scope():
            model = build_model()
        model.fit(x[:320], y[:320], batch_size=32, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    assert max_relative_difference(models[0].get_weights(), models[1].get_weights()) < 1e-6

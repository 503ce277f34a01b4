"""Synchronized BatchNorm: statistics over the global batch under every synchronous strategy."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.common import LOCAL_SYNCHRONOUS, make_strategy, tiny_model


@pytest.mark.parametrize("name", LOCAL_SYNCHRONOUS)
def test_batch_statistics_are_those_of_the_global_batch(name, digits):
    x, y = digits
    x, y = x[:32], y[:32]
    # momentum 0: after one step the moving statistics are that step's batch statistics.
    reference = tiny_model(sync_bn=True, bn_momentum=0.0)
    kernel = reference.layers[0].kernel.numpy()
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)

    with make_strategy(name).scope():
        model = tiny_model(sync_bn=True, bn_momentum=0.0)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)

    hidden = x.astype(np.float64) @ kernel  # the forward pass saw the initial kernel
    bn, ref_bn = model.layers[1], reference.layers[1]
    np.testing.assert_allclose(bn.moving_mean.numpy(), hidden.mean(axis=0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), hidden.var(axis=0), rtol=1e-4, atol=1e-5)
    # One replica's share (8 samples) has visibly different statistics: the
    # assertions above could not pass on per-replica statistics.
    assert np.max(np.abs(hidden[:8].mean(axis=0) - hidden.mean(axis=0))) > 0.1
    np.testing.assert_allclose(bn.moving_mean.numpy(), ref_bn.moving_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), ref_bn.moving_variance.numpy(), rtol=1e-5, atol=1e-6)

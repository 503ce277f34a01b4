"""The `precision` step option: which Keras dtype policy a strategy's layers get.

`precision="mixed_bfloat16"` on a tfdist strategy is equivalent to
`keras.config.set_dtype_policy("mixed_bfloat16")` for the layers built inside
that strategy's scope, and nothing outside it: layers compute in bfloat16,
their variables stay float32 (the master copies the optimizer updates), and
gradients reach the optimizer in float32. `"mixed_float16"` also makes
`model.compile` wrap the optimizer in a `keras.optimizers.LossScaleOptimizer`
(as Keras does for a mixed_float16 model); the step engine performs its
dynamic loss scaling across replicas (`tfdist.engine.update`).
`"float32"` (the default) leaves Keras's global policy in charge.
"""

from __future__ import annotations

import keras
import tensorflow as tf

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


def policy_for(precision: str) -> keras.DTypePolicy | None:
    """Returns the Keras dtype policy of a `precision` value, or `None` for "float32".

    Args:
        precision: str. One of `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`.

    Example:

    ```python
    tfdist.precision.policy_for("mixed_bfloat16").compute_dtype  # 'bfloat16'
    ```
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"Argument 'precision' must be one of {', '.join(repr(p) for p in PRECISIONS)}. "
            f"Received: precision={precision!r}"
        )
    if precision == "float32":
        return None
    return keras.DTypePolicy(precision)


def current_policy() -> keras.DTypePolicy | None:
    """The policy of the tfdist strategy whose scope is entered, or `None`.

    `None` means Keras's own global policy applies: no strategy scope is
    entered, the strategy is not tfdist's, or its precision is "float32".
    """
    from tfdist.strategies.base import is_tfdist_strategy

    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if not is_tfdist_strategy(strategy):
        return None
    return policy_for(strategy.options.precision)

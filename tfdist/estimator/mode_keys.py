"""The three modes a `model_fn` is called in."""

from __future__ import annotations


class ModeKeys:
    """Names of the modes in which `Estimator` calls a `model_fn`.

    The values are those of TensorFlow 1's `tf.estimator.ModeKeys`, so scripts
    that compare `mode` with string literals keep working.

    Attributes:
        TRAIN: `"train"`: `Estimator.train` and the training side of
            `train_and_evaluate`.
        EVAL: `"eval"`: `Estimator.evaluate` and the evaluator.
        PREDICT: `"infer"`: `Estimator.predict` and `export_saved_model`.

    Example:

    ```python
    def model_fn(features, labels, mode, params):
        logits = keras.layers.Dense(10)(features)
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions=tf.argmax(logits, axis=1))
        ...
    ```
    """

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"

    ALL = (TRAIN, EVAL, PREDICT)


def check_mode(mode, where: str) -> str:
    """Returns `mode` if it is one of `ModeKeys.ALL`, else raises `ValueError` naming it."""
    if mode not in ModeKeys.ALL:
        raise ValueError(
            f"{where} must be one of ModeKeys.TRAIN ('train'), ModeKeys.EVAL ('eval') or "
            f"ModeKeys.PREDICT ('infer'). Received: mode={mode!r}"
        )
    return mode

"""What a `model_fn` returns: `EstimatorSpec`."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Union

import keras
import tensorflow as tf

from tfdist.estimator.mode_keys import ModeKeys, check_mode


class EstimatorSpec(NamedTuple):
    """The ops and objects a `model_fn` returns for one mode.

    Args:
        mode: str. The mode the `model_fn` was called in (a `ModeKeys` value).
        predictions: tensor or dict of tensors, batch-major. Required in
            PREDICT mode; what `Estimator.predict` yields and what
            `export_saved_model` serves. Default `None`.
        loss: scalar float tensor: the mean loss over this replica's batch.
            Required in TRAIN and EVAL mode. Default `None`.
        train_op: TRAIN mode only, instead of `optimizer`: a callable with no
            arguments that performs the update itself (called once per step
            on every replica), or the result of an update already made inside
            `model_fn` (a tensor or operation). Default `None`.
        eval_metric_ops: EVAL mode: dict mapping names to Keras metric objects
            (`keras.metrics.Metric`) that `model_fn` has updated with
            `update_state`; `Estimator.evaluate` reports each `result()`.
            Default `None`.
        export_outputs: PREDICT mode: dict mapping signature names to a tensor
            or a dict of tensors, served by `export_saved_model` (default: the
            `predictions` under `"serving_default"`). Default `None`.
        optimizer: TRAIN mode: a `keras.optimizers.Optimizer`. The runner
            differentiates `loss` with respect to the trainable variables
            `model_fn` created, sums the gradients over replicas and applies
            them with this optimizer under the strategy. Default `None`.

    Example:

    ```python
    def model_fn(features, labels, mode, params):
        logits = keras.layers.Dense(10)(keras.layers.Dense(32, activation="relu")(features))
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions={"class": tf.argmax(logits, 1)})
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
        if mode == ModeKeys.EVAL:
            accuracy = keras.metrics.SparseCategoricalAccuracy()
            accuracy.update_state(labels, logits)
            return EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
        return EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1))
    ```
    """

    mode: str
    predictions: Any = None
    loss: Any = None
    train_op: Union[Callable[[], Any], Any, None] = None
    eval_metric_ops: Mapping[str, keras.metrics.Metric] | None = None
    export_outputs: Mapping[str, Any] | None = None
    optimizer: keras.optimizers.Optimizer | None = None


def check_spec(spec: Any, mode: str) -> EstimatorSpec:
    """Validates what `model_fn` returned when called in `mode`; raises naming the problem."""
    if not isinstance(spec, EstimatorSpec):
        raise TypeError(
            "model_fn must return a tfdist.estimator.EstimatorSpec. "
            f"Received: {type(spec).__name__} ({spec!r:.200})"
        )
    check_mode(spec.mode, "EstimatorSpec mode")
    if spec.mode != mode:
        raise ValueError(
            f"model_fn was called with mode={mode!r} but returned EstimatorSpec(mode={spec.mode!r}). "
            "Pass the mode model_fn received: EstimatorSpec(mode, ...)."
        )
    if mode in (ModeKeys.TRAIN, ModeKeys.EVAL):
        if spec.loss is None:
            needs = "loss= and optimizer= (or train_op=)" if mode == ModeKeys.TRAIN else "loss="
            raise ValueError(
                f"model_fn returned EstimatorSpec(mode={mode!r}) without a loss. In {mode.upper()} "
                f"mode the spec needs {needs}. Received: loss=None"
            )
        if spec.loss.shape.rank not in (0, None):
            raise ValueError(
                "EstimatorSpec loss must be a scalar (the mean loss over the batch). "
                f"Received: loss with shape {spec.loss.shape}"
            )
    if mode == ModeKeys.TRAIN:
        if spec.optimizer is None and spec.train_op is None:
            raise ValueError(
                "model_fn returned EstimatorSpec(mode='train') with neither optimizer= nor "
                "train_op=. Pass optimizer=keras.optimizers.<Name>(...) (the runner then computes "
                "and applies the gradients), or train_op= a callable that makes the update itself."
            )
        if spec.optimizer is not None and not isinstance(spec.optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "EstimatorSpec optimizer must be a keras.optimizers.Optimizer. TF1 optimizers "
                "(tf.compat.v1.train.*) have no Keras 3 counterpart: use e.g. "
                "keras.optimizers.SGD(learning_rate). "
                f"Received: optimizer of type {type(spec.optimizer).__name__}"
            )
    if mode == ModeKeys.EVAL:
        for name, metric in (spec.eval_metric_ops or {}).items():
            if not isinstance(metric, keras.metrics.Metric):
                hint = (
                    " A (value, update_op) pair is TF1's tf.metrics style: create a keras.metrics "
                    "object, call its update_state(...) in model_fn, and return the object."
                    if isinstance(metric, tuple)
                    else ""
                )
                raise TypeError(
                    f"eval_metric_ops[{name!r}] must be a keras.metrics.Metric.{hint} "
                    f"Received: {type(metric).__name__}"
                )
    if mode == ModeKeys.PREDICT and spec.predictions is None:
        raise ValueError(
            "model_fn returned EstimatorSpec(mode='infer') without predictions. In PREDICT mode the "
            "spec needs predictions= (a tensor or a dict of tensors). Received: predictions=None"
        )
    return spec


def predictions_as_dict(predictions: Any) -> dict[str, tf.Tensor]:
    """`predictions` as a dict (a single tensor is named `"output"`, as TF1's PredictOutput did)."""
    if isinstance(predictions, Mapping):
        return dict(predictions)
    return {"output": predictions}

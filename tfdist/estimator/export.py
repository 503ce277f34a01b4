"""Serving inputs and SavedModel export for `Estimator.export_saved_model`."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable, Mapping, NamedTuple, Union

import tensorflow as tf

from tfdist.estimator.estimator_spec import predictions_as_dict
from tfdist.estimator.mode_keys import ModeKeys


class ServingInputReceiver(NamedTuple):
    """What a served model receives, and how that becomes `model_fn`'s features.

    TF1 built placeholders here; TensorFlow 2 describes inputs with
    `tf.TensorSpec`s instead.

    Args:
        features: the features passed to `model_fn`: `None` to pass the
            received tensors as they are (a dict, or the single tensor when
            `receiver_tensors` is one `tf.TensorSpec`), or a callable mapping
            the dict of received tensors to features (e.g. parsing
            `tf.train.Example`s).
        receiver_tensors: a `tf.TensorSpec` or dict of name to `tf.TensorSpec`:
            the inputs of the serving signature.

    Example:

    ```python
    def serving_input_receiver_fn():
        return ServingInputReceiver(None, {"x": tf.TensorSpec([None, 64], tf.float32)})
    ```
    """

    features: Union[Callable[[dict], Any], None]
    receiver_tensors: Union[tf.TensorSpec, Mapping[str, tf.TensorSpec]]


def build_raw_serving_input_receiver_fn(
    features: Union[tf.TensorSpec, Mapping[str, tf.TensorSpec]], default_batch_size: int | None = None
) -> Callable[[], ServingInputReceiver]:
    """A `serving_input_receiver_fn` whose served inputs are the features themselves.

    Args:
        features: a `tf.TensorSpec` or dict of name to `tf.TensorSpec`
            (replacing TF1's placeholders); shapes without the batch dimension
            get one prepended, of size `default_batch_size`.
        default_batch_size: Optional int. Default `None`: any batch size.

    Example:

    ```python
    fn = build_raw_serving_input_receiver_fn({"x": tf.TensorSpec([64], tf.float32)})
    path = estimator.export_saved_model("/tmp/export", fn)
    ```
    """

    def with_batch(spec):
        if not isinstance(spec, tf.TensorSpec):
            raise TypeError(f"build_raw_serving_input_receiver_fn takes tf.TensorSpec values. "
                            f"Received: {type(spec).__name__}")
        if spec.shape.rank and spec.shape[0] is None:
            return spec
        return tf.TensorSpec([default_batch_size] + spec.shape.as_list(), spec.dtype, spec.name)

    specs = {k: with_batch(v) for k, v in features.items()} if isinstance(features, Mapping) else with_batch(features)

    def serving_input_receiver_fn() -> ServingInputReceiver:
        return ServingInputReceiver(None, specs)

    return serving_input_receiver_fn


def _receiver(fn: Callable) -> tuple[dict, Callable[[dict], Any]]:
    receiver = fn()
    if not isinstance(receiver, ServingInputReceiver):
        raise TypeError("serving_input_receiver_fn must return a tfdist.estimator.ServingInputReceiver. "
                        f"Received: {type(receiver).__name__}")
    tensors = receiver.receiver_tensors
    if isinstance(tensors, tf.TensorSpec):
        specs = {"input": tensors}

        def to_features(received):
            return received["input"]
    else:
        specs = dict(tensors)

        def to_features(received):
            return received
    if callable(receiver.features):
        parse = receiver.features

        def to_features(received):  # noqa: F811 (the receiver's own mapping wins)
            return parse(received)
    return specs, to_features


def write_saved_model(graph, export_dir_base: str, serving_input_receiver_fn: Callable,
                      checkpoint_path: str) -> str:
    """Builds the PREDICT graph on one device, restores `checkpoint_path` and saves it.

    `graph`: the estimator's `_Graph` for the default (one-device) strategy,
    made by the caller (this module sits below `tfdist.estimator.estimator`).
    """
    specs, to_features = _receiver(serving_input_receiver_fn)
    names = sorted(specs)
    signature = [tf.TensorSpec(specs[n].shape, specs[n].dtype, name=n) for n in names]
    built = []

    def serve(*tensors, allow_creation=False):
        features = to_features(dict(zip(names, tensors)))
        spec = graph.call_model_fn(features, None, ModeKeys.PREDICT, allow_creation=allow_creation)
        if allow_creation:
            built.append(spec)
        outputs = spec.export_outputs or {}
        served = outputs.get("serving_default", spec.predictions)
        return predictions_as_dict(served)

    tf.function(lambda *t: serve(*t, allow_creation=True), autograph=False).get_concrete_function(*signature)
    graph.specs[ModeKeys.PREDICT] = built[0]
    graph.restore(checkpoint_path)

    module = tf.Module()
    module.model_variables = list(graph.store.variables.values())
    module.global_step = graph.global_step
    module.serve = tf.function(serve, input_signature=signature, autograph=False)
    signatures = {"serving_default": module.serve.get_concrete_function()}
    for key, _outputs in (built[0].export_outputs or {}).items():
        if key == "serving_default":
            continue

        def extra(*tensors, _key=key):
            features = to_features(dict(zip(names, tensors)))
            spec = graph.call_model_fn(features, None, ModeKeys.PREDICT)
            return predictions_as_dict(spec.export_outputs[_key])

        signatures[key] = tf.function(extra, input_signature=signature, autograph=False).get_concrete_function()
    stamp = int(time.time())
    while os.path.exists(os.path.join(os.fspath(export_dir_base), str(stamp))):
        stamp += 1
    final = os.path.join(os.fspath(export_dir_base), str(stamp))
    temp = os.path.join(os.fspath(export_dir_base), f"temp-{stamp}")
    tf.saved_model.save(module, temp, signatures=signatures)
    # A reader never sees a half-written SavedModel: it appears under its name complete.
    os.replace(temp, final)
    shutil.rmtree(temp, ignore_errors=True)
    return final

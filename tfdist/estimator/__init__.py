"""Estimator-style training on TensorFlow 2 and Keras 3: model_fn, input_fn, RunConfig.

`tf.estimator` was removed in TensorFlow 2.16. `tfdist.estimator` keeps the
shape of Estimator scripts — an `input_fn`, a `model_fn(features, labels, mode,
params)` returning an `EstimatorSpec`, a `RunConfig` carrying the strategy and
checkpoint settings, and `train_and_evaluate` driving every TF_CONFIG role —
and runs them on tfdist's strategies. See docs/estimator_migration.md.

```python
from tfdist import estimator as est

estimator = est.Estimator(model_fn, config=est.RunConfig(
    model_dir="/tmp/digits", train_distribute=tfdist.get_strategy("mirrored")))
est.train_and_evaluate(estimator, est.TrainSpec(train_input_fn, max_steps=1000),
                       est.EvalSpec(eval_input_fn, steps=None))
```
"""

from tfdist.estimator.estimator import Estimator
from tfdist.estimator.estimator_spec import EstimatorSpec
from tfdist.estimator.export import ServingInputReceiver, build_raw_serving_input_receiver_fn
from tfdist.estimator.exporter import Exporter, FinalExporter, LatestExporter
from tfdist.estimator.mode_keys import ModeKeys
from tfdist.estimator.run_config import RunConfig
from tfdist.estimator.training import EvalSpec, TrainSpec, train_and_evaluate

__all__ = [
    "Estimator",
    "EstimatorSpec",
    "EvalSpec",
    "Exporter",
    "FinalExporter",
    "LatestExporter",
    "ModeKeys",
    "RunConfig",
    "ServingInputReceiver",
    "TrainSpec",
    "build_raw_serving_input_receiver_fn",
    "train_and_evaluate",
]

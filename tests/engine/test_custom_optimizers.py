"""Users' own optimizers train under every synchronous strategy exactly as on one device (issue 37).

Every strategy's update runs the optimizer's own `update_step`, through the
engine's one update (`tfdist.engine.update.apply_update`), on real
variables: every copy of a mirrored variable, the one copy under central
storage, a replica's chunk of the flat parameters or a whole owned variable
under the sharded optimizer (stages 1 and 2), a part or a whole variable at
stage 3. So an optimizer the user wrote — its own `build` and
`update_step`, or a subclass of a built-in that changes `update_step` —
sees exactly what it sees on one device.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfdist
from tests.conftest import DEVICES, max_relative_difference
from tfdist.strategies.sharded import OwnedState, SlicedState, sharded_state, updates_elementwise


class MomentumSGD(keras.optimizers.Optimizer):
    """A user's optimizer from scratch: its own `build` (a velocity per variable) and `update_step`."""

    def __init__(self, learning_rate=0.05, momentum=0.9, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.velocities = [self.add_variable_from_reference(v, "velocity") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        velocity = self.velocities[self._get_variable_index(variable)]
        lr = ops.cast(learning_rate, variable.dtype)
        self.assign(velocity, ops.subtract(ops.multiply(velocity, self.momentum), ops.multiply(gradient, lr)))
        self.assign_add(variable, velocity)


class StepClippedAdam(keras.optimizers.Adam):
    """The issue's subclass: Adam's own step (`super().update_step`), then each element's step clipped to ±lr/2."""

    def update_step(self, gradient, variable, learning_rate):
        before = ops.copy(variable)
        super().update_step(gradient, variable, learning_rate)
        half = ops.cast(learning_rate, variable.dtype) / 2
        self.assign(variable, ops.add(before, ops.clip(ops.subtract(variable, before), -half, half)))


class ReadsWhereUsedAdam(keras.optimizers.Adam):
    """Adam, then a step that reads the variable where it is used, as a TensorFlow variable reads.

    `ops.convert_to_tensor` of a variable is the variable itself, read by
    each op that uses it: after `super().update_step`, `after - before` is 0
    on one device, and the assignment keeps Adam's step. A stand-in that
    took the value when converted (the sharded optimizer's, before) clipped
    instead: 0.57 relative from one device after 8 steps. Declared
    element-wise, it is updated by slices (chunk by chunk) and by parts.
    """

    tfdist_elementwise = True

    def update_step(self, gradient, variable, learning_rate):
        before = ops.convert_to_tensor(variable)
        super().update_step(gradient, variable, learning_rate)
        half = ops.cast(learning_rate, variable.dtype) / 2
        after = ops.convert_to_tensor(variable)
        variable.assign(ops.add(before, ops.clip(ops.subtract(after, before), -half, half)))


OPTIMIZERS = {
    "own_momentum_sgd": lambda: MomentumSGD(0.05),
    "step_clipped_adam": lambda: StepClippedAdam(0.05),
    "reads_where_used_adam": lambda: ReadsWhereUsedAdam(0.05),
}

STRATEGIES = {
    "mirrored": lambda: tfdist.get_strategy("mirrored", devices=DEVICES[2]),
    "central_storage": lambda: tfdist.get_strategy("central_storage", compute_devices=DEVICES[2]),
    "multi_worker": lambda: tfdist.get_strategy("multi_worker"),
    "stage_1": lambda: tfdist.get_strategy("sharded_optimizer", stage=1, devices=DEVICES[2]),
    # Buckets of 256 bytes: the slices' update runs chunk by chunk (several chunks per replica).
    "stage_2": lambda: tfdist.get_strategy("sharded_optimizer", stage=2, devices=DEVICES[2], shard_bucket_bytes=256),
    "stage_3": lambda: tfdist.get_strategy("sharded_optimizer", stage=3, devices=DEVICES[2]),
}

rng = np.random.RandomState(0)
DENSE = (rng.rand(64, 12).astype("float32"), rng.randint(0, 3, 64))
TOKENS = (rng.randint(0, 20, (64, 5)).astype("int32"), rng.randint(0, 3, 64))


def _model(kind: str, optimizer_fn):
    keras.utils.set_random_seed(0)
    if kind == "dense":
        layers = [keras.Input((12,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    else:  # Embedding + Dense: sparse rows, summed or all-gathered
        layers = [keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                  keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    model = keras.Sequential(layers)
    model.compile(optimizer=optimizer_fn(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _train(kind: str, optimizer_fn, strategy=None):
    if strategy is None:
        model = _model(kind, optimizer_fn)
    else:
        with strategy.scope():
            model = _model(kind, optimizer_fn)
    x, y = DENSE if kind == "dense" else TOKENS
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("kind", ["dense", "embedding"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_users_optimizers_match_one_device_under_every_synchronous_strategy(name, kind):
    reference = _train(kind, OPTIMIZERS[name])
    differences = {}
    for strategy_name, make in STRATEGIES.items():
        model = _train(kind, OPTIMIZERS[name], make())
        differences[strategy_name] = max_relative_difference(reference.get_weights(), model.get_weights())
        assert int(model.optimizer.iterations.numpy()) == 8
        state = sharded_state(model.optimizer)
        if strategy_name in ("stage_1", "stage_2"):
            # Declared element-wise: flat slices; otherwise whole variables on their owners.
            assert isinstance(state, SlicedState if name == "reads_where_used_adam" else OwnedState)
            if isinstance(state, SlicedState) and strategy_name == "stage_2":
                assert state.layout.num_buckets > 1
    assert max(differences.values()) < 1e-6, differences


def test_which_optimizers_update_slices():
    # Safe by default: Keras's element-wise built-ins, unchanged, update slices; any
    # other optimizer whole variables, unless its class declares `tfdist_elementwise`.
    slices = [keras.optimizers.SGD(), keras.optimizers.Adam(), keras.optimizers.AdamW(), keras.optimizers.Nadam(),
              keras.optimizers.RMSprop(), keras.optimizers.Lion(), keras.optimizers.Ftrl(),
              keras.optimizers.Adadelta(), keras.optimizers.Adagrad(), keras.optimizers.Adamax(),
              keras.optimizers.ScheduleFreeAdamW(), ReadsWhereUsedAdam()]
    whole = [keras.optimizers.Lamb(), keras.optimizers.Adafactor(), keras.optimizers.Muon(),
             keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(keras.optimizers.SGD(), {})),
             MomentumSGD(), StepClippedAdam()]
    assert [updates_elementwise(o) for o in slices] == [True] * len(slices)
    assert [updates_elementwise(o) for o in whole] == [False] * len(whole)

    class Undeclared(keras.optimizers.Adam):
        tfdist_elementwise = False

    assert not updates_elementwise(Undeclared())


class GanStep(keras.Sequential):
    """A custom `train_step` whose `optimizer.apply` takes its own gradients (the sharded update's `apply`)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_custom_train_step_applies_a_users_optimizer_to_whole_variables_as_one_device(stage):
    def build():
        keras.utils.set_random_seed(0)
        model = GanStep([keras.Input((12,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        model.compile(optimizer=StepClippedAdam(0.05, global_clipnorm=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = build()
    reference.fit(*DENSE, batch_size=16, shuffle=False, verbose=0)
    with tfdist.get_strategy("sharded_optimizer", stage=stage, devices=DEVICES[2]).scope():
        model = build()
    model.fit(*DENSE, batch_size=16, shuffle=False, verbose=0)
    assert isinstance(sharded_state(model.optimizer), OwnedState)
    assert max_relative_difference(reference.get_weights(), model.get_weights()) < 1e-6

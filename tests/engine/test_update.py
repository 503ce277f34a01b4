"""The update template (tfdist.engine.update): every built-in Keras optimizer, every synchronous strategy.

Each optimizer trains a small model for 2 steps under each synchronous strategy
(mirrored and central_storage on 2 replicas, the sharded optimizer
(stage 2) on 3 replicas, multi_worker as one local worker) and must end where
single-device Keras ends. Under the sharded optimizer, optimizers whose update
needs whole tensors (Lamb, Adafactor, Muon, MultiOptimizer) update whole
variables on their owners; the others slices. A float8 `Dense`
(`overwrite_with_gradient`) takes the replicas' largest amax.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES, max_relative_difference
from tests.engine.common import make_strategy


def _multi():
    # Adam on the first Dense layer's variables, SGD with momentum on the rest.
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.1, momentum=0.5), {"hidden/.*": keras.optimizers.Adam(0.02)}
        )
    )


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.02),
    "adamw": lambda: keras.optimizers.AdamW(0.02, weight_decay=0.1),
    "adamax": lambda: keras.optimizers.Adamax(0.02),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "nadam": lambda: keras.optimizers.Nadam(0.02),
    "lion": lambda: keras.optimizers.Lion(0.01, weight_decay=0.1),
    "ftrl": lambda: keras.optimizers.Ftrl(0.2, l1_regularization_strength=0.01),
    "lamb": lambda: keras.optimizers.Lamb(0.02),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "muon": lambda: keras.optimizers.Muon(0.02, weight_decay=0.1),
    "schedule_free_adamw": lambda: keras.optimizers.ScheduleFreeAdamW(0.02),
    "multi_optimizer": _multi,
    "loss_scale_optimizer": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.02)),
    "adam_ema": lambda: keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2),
}

STRATEGIES = {
    "mirrored": lambda: make_strategy("mirrored", replicas=2),
    "central_storage": lambda: make_strategy("central_storage", replicas=2),
    # The stages differ only in how gradients reach the slice (covered in
    # tests/strategies/test_sharded_optimizer.py); the update is the same.
    "sharded_optimizer": lambda: _sharded(2),
    "multi_worker": lambda: make_strategy("multi_worker"),
}


def _sharded(stage):
    import tfdist

    return tfdist.get_strategy("sharded_optimizer", stage=stage, devices=DEVICES[3])


rng = np.random.RandomState(0)
X = rng.rand(32, 8).astype("float32")
Y = rng.randint(0, 3, 32)


def _train(optimizer_fn, strategy=None):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="head"),
        ])
        model.compile(optimizer=optimizer_fn(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.fit(X, Y, batch_size=16, shuffle=False, verbose=0)
    return model


def _reference(name):
    if name == "schedule_free_adamw":
        # Measured: one-device Keras `fit` (3.15) starts ScheduleFreeAdamW's
        # momentum at zero, though its `build` copies the weights into it (a
        # bare `optimizer.build` does); under stock tf.distribute strategies
        # it starts at the weights. Compare with stock
        # tf.distribute.MirroredStrategy, which runs Keras's own update.
        # Reduced without collectives: every stock MirroredStrategy starts its
        # collective keys at group 1, instance 100, so a later stock strategy in
        # this test process whose first all-reduce has another shape would fail
        # ("Shape mismatch in the collective instance 100", tensorflow#62790).
        return _train(OPTIMIZERS[name], tf.distribute.MirroredStrategy(
            DEVICES[2], cross_device_ops=tf.distribute.ReductionToOneDevice()))
    return _train(OPTIMIZERS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_builtin_optimizer_matches_one_device_under_every_synchronous_strategy(name):
    reference = _reference(name)
    differences = {}
    for strategy_name, make in STRATEGIES.items():
        model = _train(OPTIMIZERS[name], make())
        differences[strategy_name] = max_relative_difference(reference.get_weights(), model.get_weights())
        assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    assert max(differences.values()) < 1e-5, differences


# float8 Dense: overwrite_with_gradient -------------------------------------------------------------


class Float8Step(keras.Model):
    """A custom train_step: its optimizer.apply gets the float8 layers' new scales too."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def _float8_model(custom_step=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden, head = keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)
    outputs = head(hidden(inputs))
    model = (Float8Step if custom_step else keras.Model)(inputs, outputs)
    hidden.quantize("float8")
    head.quantize("float8")
    model.compile(keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.fixture(scope="module")
def float8_data():
    rng = np.random.RandomState(3)
    x = rng.normal(size=(64, 12)).astype("float32")
    x[:8] *= 10  # replica 0's share of the first batch holds the largest inputs
    return x, (x[:, :3] * 2.0 + 0.5).astype("float32")


@pytest.fixture(scope="module")
def float8_reference(float8_data):
    model = _float8_model()
    model.fit(*float8_data, batch_size=16, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name,custom_step", [("mirrored", False), ("central_storage", False), ("mirrored", True)])
def test_float8_scales_and_amax_histories_take_the_largest_replica_value(
    name, custom_step, float8_data, float8_reference
):
    # One device's amax history records the largest magnitude over the whole
    # batch; each replica sees its share, so the replicas' new values are
    # combined with MAX (summing or averaging them, as for gradients, left the
    # scales 34-60x off). Keras's float8 Dense adds its bias in bfloat16, so the
    # bias gradient, summed over shares, rounds as bfloat16 does (~3e-3).
    with make_strategy(name, replicas=2).scope():
        model = _float8_model(custom_step)
    model.fit(*float8_data, batch_size=16, shuffle=False, verbose=0)
    overwritten = {"scale", "amax_history"}
    worst = {"overwritten": 0.0, "trained": 0.0}
    for v, a, b in zip(float8_reference.weights, float8_reference.get_weights(), model.get_weights()):
        kind = "overwritten" if any(v.name.endswith(k) for k in overwritten) else "trained"
        worst[kind] = max(worst[kind], max_relative_difference([a], [b]))
    assert worst["overwritten"] < 1e-4 and worst["trained"] < 1e-2, worst


def test_float8_under_the_sharded_optimizer_is_refused_by_name():
    with pytest.raises(NotImplementedError) as info:
        with make_strategy("sharded_optimizer", replicas=2).scope():
            model = _float8_model()
        model.fit(np.zeros((4, 12), "float32"), np.zeros((4, 3), "float32"), verbose=0)
    assert str(info.value).startswith("The 'sharded_optimizer' strategy does not train '")
    assert str(info.value).endswith(
        "a float8 layer's scales and amax histories take their gradient as their value "
        "(overwrite_with_gradient), and the flat slices hold optimizer-updated weights only. "
        "Train float8 models under mirrored, central_storage or multi_worker."
    )


def _adam_steps(placement, optimizer, steps=5):
    """`steps` updates of a small ReLU model's variables by `optimizer` through `placement`."""
    from tfdist.engine import update

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    optimizer.build(model.trainable_variables)
    x = np.random.RandomState(1).rand(16, 8).astype("float32")

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        update.apply_update(optimizer, grads, model.trainable_variables, placement)

    for _ in range(steps):
        step()
    ops = step.get_concrete_function().graph.get_operations()
    return [v.numpy() for v in model.weights + optimizer.variables], ops


def _depends(op, on) -> bool:
    """Whether `op` runs after `on` in its graph (a path of data or control edges)."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        if current is on:
            return True
        if current in seen:
            continue
        seen.add(current)
        todo.extend(t.op for t in current.inputs)
        todo.extend(current.control_inputs)
    return False


def _ops_on(ops, variable, op_type) -> list:
    """The ops of `op_type` in `ops` whose resource input is `variable`'s captured handle."""
    inner = {id(external): internal for external, internal in ops[0].graph.captures}
    handle = inner[id(variable.value.handle)]
    return [op for op in ops if op.type == op_type and op.inputs[0] is handle]


def _slots(optimizer):
    """Per variable, its slots numerator first: (m, v[, v_hat]) of Adam, AdamW and Nadam, (m, u) of Adamax."""
    if isinstance(optimizer, keras.optimizers.Adamax):
        return list(zip(optimizer._m, optimizer._u))
    if getattr(optimizer, "amsgrad", False):
        return list(zip(optimizer._momentums, optimizer._velocities, optimizer._velocity_hats))
    return list(zip(optimizer._momentums, optimizer._velocities))


def _only(ops, variable, op_types) -> tf.Operation:
    [op] = [op for op_type in op_types for op in _ops_on(ops, variable, op_type)]
    return op


_WRITES = ("AssignAddVariableOp", "AssignVariableOp")


def _critical_sections(ops) -> list:
    """`(MutexLock, ConsumeMutexLock)` of each critical section executed in `ops`."""
    consumed = {op.inputs[0].op: op for op in ops if op.type == "ConsumeMutexLock"}
    return [(lock, consumed[lock]) for lock in ops if lock.type == "MutexLock"]


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.Adam(0.05),
    lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    lambda: keras.optimizers.Adam(0.05, amsgrad=True),
    lambda: keras.optimizers.Adamax(0.05),
    lambda: keras.optimizers.Nadam(0.05),
], ids=["adam", "adamw", "amsgrad", "adamax", "nadam"])
def test_parameter_server_placement_locks_each_variables_update_and_matches_keras(make):
    # Workers update ps variables concurrently: a worker that reads another's new m must
    # also read that worker's new v, or its step divides by a v without the square (where
    # v was 0, lr * m / epsilon). Each variable's update_step (Keras's own ops) runs
    # inside one critical section: every read and write of the variable and its slots
    # comes after the section's lock and before its release.
    from tfdist.engine import update

    expected, _ = _adam_steps(update.InPlace(), make())
    optimizer = make()
    got, ops = _adam_steps(update.LockedInPlace(), optimizer)
    assert max_relative_difference(got, expected) == 0  # Keras's ops on the same values
    model_variables = optimizer._trainable_variables
    sections = _critical_sections(ops)
    assert len(sections) == len(model_variables)
    for variable, slots in zip(model_variables, _slots(optimizer)):
        accesses = [op for s in slots for t in ("ReadVariableOp",) + _WRITES for op in _ops_on(ops, s, t)]
        accesses += [op for t in _WRITES for op in _ops_on(ops, variable, t)]
        assert accesses
        assert any(
            all(_depends(op, lock) and _depends(release, op) for op in accesses) for lock, release in sections
        ), variable.path

    # Keras's own update_step orders none of the writes: the race this placement closes.
    optimizer = make()
    _, ops = _adam_steps(update.InPlace(), optimizer)
    assert not _critical_sections(ops)
    for m, v, *_ in _slots(optimizer):
        m_writes = [w for t in _WRITES for w in _ops_on(ops, m, t)]
        v_writes = [w for t in _WRITES for w in _ops_on(ops, v, t)]
        assert m_writes and v_writes and not any(_depends(w, x) for w in m_writes for x in v_writes)


class OwnAdam(keras.optimizers.Adam):
    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)


@pytest.mark.parametrize("make", [
    lambda: OwnAdam(0.05),
    lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    lambda: keras.optimizers.RMSprop(0.05, momentum=0.9),
], ids=["subclass", "sgd", "rmsprop"])
def test_parameter_server_placement_runs_every_optimizers_own_update_step(make):
    from tfdist.engine import update

    expected, _ = _adam_steps(update.InPlace(), make())
    got, _ = _adam_steps(update.LockedInPlace(), make())
    assert max_relative_difference(got, expected) == 0

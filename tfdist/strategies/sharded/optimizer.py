"""The sharded optimizer: the user's optimizer class, as a same-named subclass whose state a `ShardedState` holds.

As Horovod's `DistributedOptimizer` derives from the optimizer it wraps, the
compiled optimizer's class becomes a subclass of the user's class with the
same name (`make_sharded_optimizer`): `isinstance(opt, Adam)` holds, `super()`
reaches the user's own `update_step`, and `.keras` files name the user's
class, so they load without tfdist. What the subclass changes — where the
optimizer is built, how it applies gradients from a custom loop, clips,
finalises EMA and saves — goes to the instance's `ShardedState`.

Which optimizers may update a slice of a variable (`updates_elementwise`):
an optimizer whose update of a variable is element-wise can update any slice
of it with the slices of its slots, so the strategy gives each replica an even
flat slice of every variable (`tfdist.strategies.sharded.slices`). Any other
optimizer (Lamb's trust ratio, Adafactor's factored moments, Muon's
orthogonalisation, a user's per-tensor norm) gets whole variables, each
updated on the replica that owns it (`tfdist.strategies.sharded.owned`). The
rule is safe by default: Keras's built-in optimizers whose update is
element-wise are known; any other class gets whole variables unless it
declares `tfdist_elementwise = True`.
"""

from __future__ import annotations

from typing import Sequence

from tfdist._compat import keras as kc

# The class attribute with which an optimizer declares that its update is element-wise.
ELEMENTWISE = "tfdist_elementwise"


def updates_elementwise(optimizer) -> bool:
    """Whether `optimizer` may update any slice of a variable alone, with the same slice of its slots.

    True for Keras's built-in optimizers whose update is element-wise (SGD,
    Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, Nadam, Lion, Ftrl,
    ScheduleFreeAdamW) while their `update_step` is Keras's own, and for any
    class that declares it with a class attribute `tfdist_elementwise = True`;
    False for everything else (a user's own `update_step`, Lamb, Adafactor,
    Muon, MultiOptimizer), which then updates whole variables.

    Args:
        optimizer: a Keras optimizer (not a `LossScaleOptimizer`).

    Example:

    ```python
    class ClippedAdam(keras.optimizers.Adam):
        tfdist_elementwise = True  # its update_step clips each element: slices are exact

        def update_step(self, gradient, variable, learning_rate):
            ...
    ```
    """
    declared = getattr(type(optimizer), ELEMENTWISE, None)
    if declared is not None:
        return bool(declared)
    return kc.keras_update_is_elementwise(optimizer)


class RecordsSlots:
    """Records each slot the optimizer creates: `(reference variable, slot name, slot)`.

    Keras's `add_variable_from_reference` is where every per-variable slot is
    made (Adam's momentum and velocity, EMA, ...); recording it here maps
    slots to variables without parsing variable names.
    """

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        variable = super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        self.__dict__.setdefault("_tfdist_slots", []).append((reference_variable, name, variable))
        return variable


class ShardedOptimizer(RecordsSlots):
    """Put before the user's optimizer class: build, apply, clipping, EMA's end and saving go to the `ShardedState`."""

    def build(self, variables):
        return self.__dict__["_tfdist_sharded"].build(variables)

    def apply(self, grads, trainable_variables=None):
        return self.__dict__["_tfdist_sharded"].apply(grads, trainable_variables)

    def _clip_gradients(self, grads):
        return self.__dict__["_tfdist_sharded"].clip(grads)

    def finalize_variable_values(self, var_list):
        return self.__dict__["_tfdist_sharded"].finalize_variable_values(var_list)

    def save_own_variables(self, store):
        return self.__dict__["_tfdist_sharded"].save_own_variables(store)

    def load_own_variables(self, store):
        return self.__dict__["_tfdist_sharded"].load_own_variables(store)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return self.__dict__["_tfdist_sharded"].trackable_children(save_type, **kwargs)


class ShardedLossScale:
    """A `LossScaleOptimizer` whose inner optimizer is sharded: saves as a single-device one does.

    Keras's `save_own_variables` writes `variables` (its own, then the inner
    optimizer's, which here are slices); this writes its own, then the inner
    optimizer's canonical single-device state, so `.keras` and `.weights.h5`
    files load on any strategy and replica count.
    """

    def save_own_variables(self, store):
        inner = self.inner_optimizer.__dict__["_tfdist_sharded"]
        values = [v.numpy() for v in self._variables] + list(inner.canonical_values())
        for i, value in enumerate(values):
            store[str(i)] = value

    def load_own_variables(self, store):
        inner = self.inner_optimizer.__dict__["_tfdist_sharded"]
        own = len(self._variables)
        if inner.loads_as_unbuilt(store, self.name) or inner.skips_other_state(len(store.keys()), own):
            return
        values = [store[str(i)] for i in range(len(store.keys()))]
        inner.load_canonical_values(values[own:])  # validates before anything is written
        for variable, value in zip(self._variables, values[:own]):
            variable.assign(value)


_MIXINS = (ShardedOptimizer, RecordsSlots, ShardedLossScale)


def unsharded_class(optimizer):
    """The user's optimizer class under tfdist's derived one (itself if not derived)."""
    cls = type(optimizer)
    while cls.__bases__ and cls.__bases__[0] in _MIXINS:
        cls = cls.__bases__[1]
    return cls


def make_sharded_optimizer(optimizer, state, loss_scale_optimizer=None) -> None:
    """Makes `optimizer` (unbuilt) the sharded optimizer whose state `state` holds.

    The instance changes class to a same-named subclass of its own class with
    `ShardedOptimizer` in front, so the user's reference is the compiled
    optimizer, and optimizers outside the sharded strategy are untouched.
    Keras calls `optimizer.build(model.trainable_variables)` from `fit`,
    `compile_from_config` and `apply`; every such call now builds the sharded
    state. `apply` (and `apply_gradients`, which calls it) from a custom
    `train_step` or training loop runs the sharded update.
    `loss_scale_optimizer`, the `LossScaleOptimizer` whose inner optimizer
    `optimizer` is (mixed_float16), saves its inner state in the single-device
    layout (`ShardedLossScale`).
    """
    object.__setattr__(optimizer, "_tfdist_sharded", state)
    optimizer.__class__ = kc.same_named_subclass(type(optimizer), ShardedOptimizer)
    if loss_scale_optimizer is not None:
        loss_scale_optimizer.__class__ = kc.same_named_subclass(type(loss_scale_optimizer), ShardedLossScale)


def sharded_state(optimizer):
    """The `ShardedState` of a sharded optimizer (or of a LossScaleOptimizer's sharded inner one), or `None`.

    Args:
        optimizer: a Keras optimizer, or None.

    Example:

    ```python
    state = sharded_state(model.optimizer)
    state.layout.shard_size if state is not None else None
    ```
    """
    if optimizer is None:
        return None
    return vars(kc.inner_optimizer(optimizer)).get("_tfdist_sharded")


def build_optimizer(optimizer, variables: Sequence) -> None:
    """Runs the user's optimizer class's own `build` (not the sharded one) on `variables`."""
    unsharded_class(optimizer).build(optimizer, list(variables))


def class_trackable_children(optimizer, save_type, **kwargs) -> dict:
    """What the user's optimizer class (not the sharded one) checkpoints for `optimizer`."""
    return kc.trackable_children(unsharded_class(optimizer), optimizer, save_type, **kwargs)


def recording_copy(optimizer):
    """An unbuilt optimizer of the user's class and `optimizer`'s config that records its slots."""
    return kc.same_named_subclass(unsharded_class(optimizer), RecordsSlots).from_config(optimizer.get_config())


def slot_records(optimizer) -> list:
    """`(reference variable, slot name, slot)` for each slot a recording optimizer created, in order."""
    return list(vars(optimizer).get("_tfdist_slots", []))

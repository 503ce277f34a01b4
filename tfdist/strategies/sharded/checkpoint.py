"""The sharded optimizer's checkpoint layout: the state a single-device optimizer would save.

Whatever the kind of sharding, `.keras` and `.weights.h5` files,
`tf.train.Checkpoint` and SavedModels hold the optimizer's variables in a
single-device optimizer's order, under its keys, with their whole values
(`ShardedState.canonical_values`); saving gathers them from the replicas,
restoring scatters them. So checkpoints move between this strategy, mirrored,
one device and other replica counts, in both directions.
"""

from __future__ import annotations

import keras
import numpy as np

from tfdist._compat import tf as tfc
from tfdist.strategies.sharded.optimizer import class_trackable_children, recording_copy, slot_records


def canonical_optimizer_layout(optimizer, references: list, num_variables: int) -> tuple[list, dict]:
    """How `optimizer`'s state, built on the per-chunk `references`, maps to a single-device build.

    A template of the user's optimizer class (same config) is built on
    `num_variables` one-element proxies; its `variables` list is the order a
    single-device optimizer would save. Slots are matched by what
    `add_variable_from_reference` recorded (reference and slot name), no
    variable name is parsed. Returns `(entries, slots)`: one entry per
    template variable, `("slot", slot_name, variable_index)` for a
    per-variable slot (Adam's momentum of variable 3, ...) or `("plain",
    variable)` for the optimizer's own state (iterations, learning rate,
    Nadam's `u_product`), matched in order; and `{slot_name: [the slot built
    on each reference, in order]}`.
    """
    template = recording_copy(optimizer)
    proxies = [keras.Variable(np.zeros((1,), "float32"), name=f"proxy{i}") for i in range(num_variables)]
    template.build(proxies)
    index = {id(p): i for i, p in enumerate(proxies)}
    template_slots = {id(v): (name, index[id(ref)]) for ref, name, v in slot_records(template) if id(ref) in index}
    position = {id(r): k for k, r in enumerate(references)}
    slots: dict = {}
    for ref, name, v in slot_records(optimizer):
        if id(ref) in position:
            slots.setdefault(name, [None] * len(references))[position[id(ref)]] = v
    slot_ids = {id(v) for per_reference in slots.values() for v in per_reference}
    plain = iter([v for v in optimizer.variables if id(v) not in slot_ids])
    entries = []
    for tv in template.variables:
        if id(tv) in template_slots and template_slots[id(tv)][0] in slots:
            name, i = template_slots[id(tv)]
            entries.append(("slot", name, i))
            continue
        v = next(plain, None)
        if v is None or tuple(v.shape) != tuple(tv.shape):
            raise NotImplementedError(
                f"{type(optimizer).__name__} keeps state the sharded optimizer cannot map to its "
                f"single-device layout (variable {tv.name!r}). Declare it as updating whole variables "
                "(tfdist_elementwise = False), or use the mirrored strategy."
            )
        entries.append(("plain", v))
    return entries, slots


def canonical_children(state, slot_values: list) -> dict:
    """The single-device optimizer's checkpoint children, its slot entries given by `slot_values` (in order).

    Keras optimizers also keep each slot's list as an attribute, checkpointed
    by its name, which each class chooses (Adam's `_momentums`, SGD's
    `momentums`, Adamax's `_m` and `_u`, Ftrl's `_linears`, gradient
    accumulation's `_accumulated_gradients`, ...): any list of one slot's
    variables gets that slot's canonical values, one per model variable.
    Left as it was, it checkpointed one replica's slice under a key of its
    own, restored into every replica (SGD's momentum: 0.50 relative from
    uninterrupted training after one epoch).
    """
    canonical = []
    by_slot: dict = {}
    values = iter(slot_values)
    for entry in state.entries:
        if entry[0] == "plain":
            canonical.append(entry[1])
        else:
            value = next(values)
            canonical.append(value)
            by_slot.setdefault(entry[1], []).append(value)
    children = {
        "_variables": tfc.trackable_list(canonical),
        "_trainable_variables": tfc.trackable_list(state.variables),
    }
    slot_of = state.slot_names()
    for attribute, child in class_trackable_children(state.optimizer, "checkpoint").items():
        if attribute in children or not isinstance(child, (list, tuple)):
            continue
        names = {slot_of.get(id(item)) for item in child}
        if len(names) == 1 and (slot := next(iter(names))) in by_slot:
            children[attribute] = tfc.trackable_list(by_slot[slot])
    return children


def snapshot(model, state) -> tuple:
    """Host copies of the model's weights and its optimizer's state (canonical where sharded), for `restore`."""
    optimizer = model.optimizer
    if state is None:
        values = [(v, np.array(v.numpy())) for v in (optimizer.variables if optimizer is not None else [])]
    else:
        values = state.canonical_values() if state.built else None
    return [np.array(v.numpy()) for v in model.weights], state, values


def restore(model, saved: tuple) -> None:
    """Writes back what `snapshot` took: a failed `load_weights` leaves the model and its optimizer as they were."""
    weights, state, values = saved
    for v, value in zip(model.weights, weights):
        v.assign(value)
    if state is None:
        for v, value in values:
            v.assign(value)
    elif values is not None:
        state.write_canonical_values(values)

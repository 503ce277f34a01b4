"""The variables of a `model_fn`: created on its first call, reused on every later one.

A TF1 `model_fn` built a graph once; here it is called once per trace (and
per replica), and every call builds new Keras layers. The store sits under
each call as a variable creator: the first time a variable is asked for it is
created (under whatever strategy scope is current) and kept under a key; every
later request for the same key gets the kept variable, so the new layers share
the first call's weights. Keys are Keras variable paths (`dense/kernel`, made
the same on every call by `keras_integration.fresh_keras_names`) or, for plain
`tf.Variable`s, their names, with `#n` appended for the n-th repeat in one call.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import tensorflow as tf

from tfdist._compat import keras as kc


def _create(next_creator, key: str, kwargs: dict) -> tf.Variable:
    """Creates a variable eagerly, even while `model_fn` is being traced.

    tf.function cannot lift the initializers of a variable that a
    MirroredStrategy creates inside a trace (the replicas' copies read the
    first copy's value through a `cond`: "Unable to lift tensor ..."), so a
    variable asked for in a trace is created outside it, in the eager context
    and under the strategy scope that is current there.
    """
    if not tf.inside_function():
        return next_creator(**kwargs)
    initial_value = kwargs.get("initial_value")
    if isinstance(initial_value, tf.Tensor):
        constant = tf.get_static_value(initial_value)
        if constant is None:
            raise ValueError(
                f"model_fn creates the variable {key!r} from a tensor computed in the graph; "
                "give it a constant or a callable initial value instead (e.g. "
                "tf.Variable(lambda: tf.random.normal(shape)) or a Keras layer's initializer)."
            )
        kwargs = dict(kwargs, initial_value=constant)
    with tf.init_scope():
        return tf.Variable(**kwargs)


class ModelFnCall:
    """What one `model_fn` call touched: the variables, in order of first use."""

    def __init__(self):
        self.variables: list[tf.Variable] = []
        self.created: list[str] = []

    @property
    def trainable_variables(self) -> list[tf.Variable]:
        return [v for v in self.variables if v.trainable]


class VariableStore:
    """Keeps a `model_fn`'s variables by key across calls."""

    def __init__(self):
        self.variables: dict[str, tf.Variable] = {}
        self._creating = False

    def key_of(self, variable) -> str:
        for key, v in self.variables.items():
            if v is variable:
                return key
        raise KeyError(variable)

    @contextlib.contextmanager
    def call(self, allow_creation: bool = True) -> Iterator[ModelFnCall]:
        """Context for one `model_fn` call; yields the `ModelFnCall` record.

        Args:
            allow_creation: bool. If `False`, a variable the store does not
                hold yet raises `RuntimeError` (the runner creates variables in
                a build pass and forbids it in the traced steps).
        """
        record = ModelFnCall()
        repeats: collections.Counter = collections.Counter()

        def creator(next_creator, **kwargs):
            if self._creating:
                # The eager creation below passes through this scope again.
                return next_creator(**kwargs)
            name = kwargs.get("name") or "Variable"
            name = str(name).split(":")[0]
            path = kc.keras_name_scope_path()
            base = f"{path}/{name}" if path else name
            key = base if repeats[base] == 0 else f"{base}#{repeats[base]}"
            repeats[base] += 1
            if key in self.variables:
                variable = self.variables[key]
            elif not allow_creation:
                raise RuntimeError(
                    f"model_fn created a variable {key!r} that its first call in this mode did not "
                    "create. model_fn must create the same variables on every call (build layers "
                    "unconditionally, in the same order)."
                )
            else:
                self._creating = True
                try:
                    variable = _create(next_creator, key, kwargs)
                finally:
                    self._creating = False
                self.variables[key] = variable
                record.created.append(key)
            if not any(variable is v for v in record.variables):
                record.variables.append(variable)
            return variable

        with kc.fresh_keras_names(), tf.variable_creator_scope(creator):
            yield record

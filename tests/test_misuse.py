"""Mistakes named at `compile`, with the fix (issue 38, item 5).

Without these checks: a `mirrored` script under `tfdist launch --workers 2`
trained two independent copies that wrote the same checkpoint and exited 0;
an optimizer created outside the scope failed at `fit` with `RuntimeError:
Mixing different tf.distribute.Strategy objects`; one optimizer shared by two
models failed at the second `fit` with `KeyError: 'sequential_1/dense_2/kernel_100'`.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import tfdist
from tests.conftest import DEVICES


def dense():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)], name="net")


@pytest.mark.parametrize("environment, source", [
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                               "task": {"type": "worker", "index": 1}}), "TFDIST_RESTART_COUNT": "0"},
     "the TF_CONFIG set by `tfdist launch`"),
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, "srun (SLURM_STEP_NUM_TASKS)"),
])
def test_a_one_process_strategy_in_a_job_of_several_processes_is_refused_with_the_fix(environment, source,
                                                                                       monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    strategy = tfdist.get_strategy("mirrored", devices=DEVICES[2])
    with strategy.scope():
        model = dense()
        with pytest.raises(ValueError) as error:
            model.compile(optimizer="sgd", loss="mse")
    assert str(error.value) == (
        f"The strategy {strategy!r} trains on this process's devices only, but {source} describes a job of 2 "
        "training processes: each would train its own copy of the model on the whole input and write the same "
        "checkpoints. For a job of several processes use tfdist.get_strategy('multi_worker') (or "
        "'sharded_optimizer', which reads the same cluster; with srun pass cluster='slurm'); to train in one "
        "process, start the script alone (python train.py, without tfdist launch or srun -n). The model was "
        "left as it was (not compiled)."
    )
    assert not model.compiled


def test_an_optimizer_created_outside_the_scope_is_refused_at_compile_with_the_fix():
    strategy = tfdist.get_strategy("sharded_optimizer", devices=DEVICES[2])
    optimizer = keras.optimizers.Adam(name="outside")
    with strategy.scope():
        model = dense()
        with pytest.raises(ValueError) as error:
            model.compile(optimizer=optimizer, loss="mse")
    assert str(error.value) == (
        f"The optimizer 'outside' (Adam) was created outside any strategy scope, and is being compiled with "
        f"model 'net' of {strategy!r}: its variables (the step counter, the learning rate) are not the "
        "strategy's, and fit would fail with 'Mixing different tf.distribute.Strategy objects'. Create the "
        "optimizer inside the scope:\n"
        "    with strategy.scope():\n"
        "        model = build_model()\n"
        "        model.compile(optimizer=keras.optimizers.Adam(...), ...)\n"
        "(or pass its name, optimizer='adam'). The model was left as it was (not compiled)."
    )
    assert not model.compiled


def test_one_optimizer_for_two_models_is_refused_at_the_second_compile_with_the_fix():
    with tfdist.get_strategy("mirrored", devices=DEVICES[2]).scope():
        optimizer = keras.optimizers.Adam(name="shared")
        first = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)], name="first")
        first.compile(optimizer=optimizer, loss="mse")
        second = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)], name="second")
        with pytest.raises(ValueError) as error:
            second.compile(optimizer=optimizer, loss="mse")
        # A model whose variables are all the first's (a part of it) may share it, as in plain Keras.
        part = keras.Sequential([first.layers[0]], name="part")
        part.compile(optimizer=optimizer, loss="mse")
    assert str(error.value) == (
        "The optimizer 'shared' (Adam) is already the optimizer of model 'first', and is being compiled with "
        "model 'second', whose variables are not all 'first''s: an optimizer keeps its state (step counter, "
        "moments) for the variables it was built for, and the second model's fit would fail on an unknown "
        "variable. Give each model an optimizer of its own, e.g. model.compile(optimizer="
        "keras.optimizers.Adam.from_config(optimizer.get_config()), ...). The model was left as it was (not "
        "compiled)."
    )
    assert not second.compiled
    first.fit(np.ones((4, 8), np.float32), np.zeros((4, 3), np.float32), verbose=0)


def test_preemption_settings_are_validated_and_named():
    from tfdist import preemption

    with pytest.raises(tfdist.OptionError) as error:
        preemption.configure(grace_period=0)
    assert str(error.value) == "option 'grace_period' must be a number of seconds > 0. Received: grace_period=0"
    with pytest.raises(tfdist.OptionError) as error:
        preemption.configure(exit_code=300)
    assert str(error.value) == "option 'exit_code' must be an integer exit status in 0..255. Received: exit_code=300"

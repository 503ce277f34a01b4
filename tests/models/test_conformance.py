"""Model zoo conformance (issue 13): each zoo model trains under each local synchronous strategy
and step option with parity to single-device Keras, or raises naming the combination.

A cell trains a zoo model (`tests/models/zoo.py`, dropout 0) for 3 steps of a
global batch of 16 under one strategy on 2 logical CPU devices with one step
option, and compares its weights with single-device Keras trained on the same
data from the same seed: for `mixed_bfloat16` under the same dtype policy, for
`accumulation_steps=2` with Keras's own `gradient_accumulation_steps=2` on the
same micro-batches of 8 (so BatchNorm sees the same batches). It passes within
the model's stated tolerance with exactly 3 optimizer steps, or raises the
`NotImplementedError` expected for the combination. Besides the cells: the
trained model's `evaluate` and `predict` match one device on the same weights,
its `.keras` file loads under another strategy and under none with identical
weights and predictions, and the model trains with dropout 0.3.

A cell takes 4 s (median; 25 s at most, XLA) on the idle 2-core CI machine,
nearly all of it tracing, so the whole product of 9 models x 5 strategies x 6
options would take over 15 minutes. `make test` runs a covering plan instead
(about 5 minutes for this file): each model once with each option, the
strategy rotating, so every (model, strategy), (model, option) and
(strategy, option) pair is trained (54 cells). `TFDIST_ZOO_FULL=1` runs all
270 cells, and evaluate/predict, saving and dropout under every strategy.

The table of the covering plan's results is compared with
`docs/models_verified.md` and the "Models verified" section of
`docs/correctness.md`;
`TFDIST_UPDATE_ZOO=1` rewrites both from a run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import re
import tempfile
import textwrap
from typing import Optional

import keras
import numpy as np
import pytest

import tfdist
from tests.conftest import DEVICES, max_relative_difference
from tests.engine.common import with_policy
from tests.models.zoo import ZOO

REPO = pathlib.Path(__file__).resolve().parents[2]
TABLE_FILE = REPO / "docs" / "models_verified.md"
README_FILE = REPO / "docs" / "correctness.md"  # the user-facing copy of the table
README_HEADING = "## Models verified"
FULL = os.environ.get("TFDIST_ZOO_FULL", "") not in ("", "0")

STEPS = 3  # optimizer steps per cell: zoo data is 3 global batches
DROPOUT = 0.3
DROPOUT_EPOCHS = 5
# Evaluation and prediction on the same weights: float32 forward passes on
# 8-sample shares against the 16-sample batch.
FORWARD_TOLERANCE = 1e-5

# column name: (registered strategy name, its parameters for 2 local replicas)
STRATEGIES = {
    "mirrored": ("mirrored", {"devices": DEVICES[2]}),
    "central_storage": ("central_storage", {"compute_devices": DEVICES[2]}),
    "sharded_optimizer stage 1": ("sharded_optimizer", {"devices": DEVICES[2], "stage": 1}),
    "sharded_optimizer stage 2": ("sharded_optimizer", {"devices": DEVICES[2], "stage": 2}),
    "sharded_optimizer stage 3": ("sharded_optimizer", {"devices": DEVICES[2], "stage": 3}),
}


@dataclasses.dataclass(frozen=True)
class StepOption:
    """A step option as a cell trains it, and the single-device run it is compared with."""

    options: dict
    reference: str  # "float32", "mixed_bfloat16" or "accumulation"
    micro_batches: int = 1


OPTIONS = {
    "default": StepOption({}, "float32"),  # gradients bucketed in 25 MiB buffers
    "bucket_bytes=0": StepOption({"bucket_bytes": 0}, "float32"),
    "accumulation_steps=2": StepOption({"accumulation_steps": 2}, "accumulation", micro_batches=2),
    "mixed_bfloat16": StepOption({"precision": "mixed_bfloat16"}, "mixed_bfloat16"),
    "jit_compile": StepOption({"jit_compile": True}, "float32"),
    "sink_size=8": StepOption({"sink_size": 8}, "float32"),
}


# (model, option): the exact refusal, under every strategy. Every cell trains today.
EXPECTED_REFUSALS: dict = {}

MODELS = list(ZOO)
STRATEGY_NAMES = list(STRATEGIES)


def _rotated(model_index: int, shift: int) -> str:
    return STRATEGY_NAMES[(model_index + shift) % len(STRATEGY_NAMES)]


# Model i trains option j under strategy (i + j) mod 5: 6 consecutive options
# reach all 5 strategies, and 9 consecutive models give each (strategy,
# option) 1 or 2 models.
COVERING_PLAN = [
    (model, _rotated(i, j), option) for i, model in enumerate(MODELS) for j, option in enumerate(OPTIONS)
]
FULL_PLAN = [(model, strategy, option) for model in MODELS for strategy in STRATEGY_NAMES for option in OPTIONS]
# The model trained with the default option is the one evaluated and saved.
COVERING_FORWARD = [(model, _rotated(i, 0)) for i, model in enumerate(MODELS)]
COVERING_SAVES = [(model, _rotated(i, 0), _rotated(i, 1)) for i, model in enumerate(MODELS)]
COVERING_DROPOUT = [(model, _rotated(i, 3)) for i, model in enumerate(MODELS)]
if FULL:
    PLAN = FULL_PLAN
    FORWARD = [(model, strategy) for model in MODELS for strategy in STRATEGY_NAMES]
    SAVES = [
        (model, strategy, STRATEGY_NAMES[(k + 1) % len(STRATEGY_NAMES)])
        for model in MODELS
        for k, strategy in enumerate(STRATEGY_NAMES)
    ]
    DROPOUT_PLAN = FORWARD
else:
    PLAN, FORWARD, SAVES, DROPOUT_PLAN = COVERING_PLAN, COVERING_FORWARD, COVERING_SAVES, COVERING_DROPOUT

# Cells near or over ~20 s on the CI machine (measured 16–25 s; the median cell takes
# 4 s): XLA compiling the transformer's step.
SLOW_CELLS = {("transformer", "jit_compile")}


@dataclasses.dataclass
class Result:
    """What one check found: `status` is "yes", "refused", "MISMATCH" or "FAILS"."""

    status: str
    detail: str = ""
    difference: Optional[float] = None
    tolerance: Optional[float] = None
    model: Optional[keras.Model] = None


def make_strategy(strategy_name: str, **options):
    name, parameters = STRATEGIES[strategy_name]
    return tfdist.get_strategy(name, **parameters, **options)


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def tolerance(model_name: str, option_name: str) -> float:
    entry = ZOO[model_name]
    return entry.bf16_tolerance if OPTIONS[option_name].reference == "mixed_bfloat16" else entry.tolerance


@functools.cache
def reference(model_name: str, kind: str) -> keras.Model:
    """Single-device Keras, trained once per model and kind of reference."""
    entry = ZOO[model_name]
    x, y = entry.data()
    batch_size = entry.batch_size
    if kind == "accumulation":
        model = entry.make(gradient_accumulation_steps=2)
        batch_size //= 2
    elif kind == "mixed_bfloat16":
        model = with_policy("mixed_bfloat16", entry.make)
    else:
        model = entry.make()
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


@functools.cache
def train_cell(model_name: str, strategy_name: str, option_name: str) -> Result:
    entry, option = ZOO[model_name], OPTIONS[option_name]
    x, y = entry.data()
    try:
        with make_strategy(strategy_name, **option.options).scope():
            model = entry.make()
        model.fit(x, y, batch_size=entry.batch_size // option.micro_batches, shuffle=False, verbose=0)
    except NotImplementedError as e:
        return Result("refused", first_line(e))
    except Exception as e:
        return Result("FAILS", f"{type(e).__name__}: {first_line(e)}")
    expected = reference(model_name, option.reference)
    difference = max_relative_difference(expected.get_weights(), model.get_weights())
    steps = int(np.asarray(model.optimizer.iterations))
    limit = tolerance(model_name, option_name)
    policies = [layer.dtype_policy.name for layer in model.layers]
    expected_policies = [layer.dtype_policy.name for layer in expected.layers]
    if policies != expected_policies:
        # Rounding hides in the tolerance; computing in another dtype must not.
        return Result("MISMATCH", f"layer dtype policies {policies}, one device {expected_policies}")
    if difference <= limit and steps == STEPS:
        return Result("yes", "", difference, limit, model)
    return Result(
        "MISMATCH",
        f"max relative difference {difference:.1e} (tolerance {limit:g}) after {steps} optimizer steps",
        difference,
        limit,
        model,
    )


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-12))


def _outputs(prediction) -> list:
    """A prediction or data (array or dict of arrays) as a list of arrays in a fixed order."""
    if isinstance(prediction, dict):
        return [prediction[k] for k in sorted(prediction)]
    return [prediction]


def _trained(model_name: str, strategy_name: str) -> tuple[Optional[keras.Model], Result]:
    cell = train_cell(model_name, strategy_name, "default")
    if cell.model is None:
        return None, Result("FAILS", f"training failed: {cell.detail}")
    return cell.model, cell


@functools.cache
def forward_check(model_name: str, strategy_name: str) -> Result:
    """`evaluate` and `predict` under the strategy vs one device on the same weights."""
    trained, failed = _trained(model_name, strategy_name)
    if trained is None:
        return failed
    entry = ZOO[model_name]
    x, y = entry.data()
    single = entry.make()
    single.set_weights(trained.get_weights())
    try:
        got = trained.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)
        got_prediction = trained.predict(x, batch_size=entry.batch_size, verbose=0)
    except Exception as e:
        return Result("FAILS", f"{type(e).__name__}: {first_line(e)}")
    want = single.evaluate(x, y, batch_size=entry.batch_size, verbose=0, return_dict=True)
    want_prediction = single.predict(x, batch_size=entry.batch_size, verbose=0)
    if sorted(got) != sorted(want):
        return Result("MISMATCH", f"evaluate returned {sorted(got)}, one device {sorted(want)}")
    difference = max(
        max(_relative(want[k], got[k]) for k in want),
        max_relative_difference(_outputs(want_prediction), _outputs(got_prediction)),
    )
    status = "yes" if difference <= FORWARD_TOLERANCE else "MISMATCH"
    return Result(status, f"max relative difference {difference:.1e}", difference, FORWARD_TOLERANCE)


@functools.cache
def save_load_check(model_name: str, source: str, target: str) -> Result:
    """The `.keras` file of a model trained under `source`, loaded under `target` and under none."""
    trained, failed = _trained(model_name, source)
    if trained is None:
        return failed
    entry = ZOO[model_name]
    x, _ = entry.data()
    expected = _outputs(trained.predict(x, batch_size=entry.batch_size, verbose=0))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, f"{model_name}.keras")
        try:
            trained.save(path)
            with make_strategy(target).scope():
                under_target = keras.models.load_model(path)
            plain = keras.models.load_model(path)
        except Exception as e:
            return Result("FAILS", f"{type(e).__name__}: {first_line(e)}")
    for loaded, where in ((under_target, target), (plain, "no strategy")):
        same = all(np.array_equal(a, b) for a, b in zip(trained.get_weights(), loaded.get_weights()))
        if not same or len(loaded.get_weights()) != len(trained.get_weights()):
            return Result("MISMATCH", f"weights loaded under {where} differ from the saved model's")
        steps = int(np.asarray(loaded.optimizer.iterations))
        if steps != STEPS:
            return Result("MISMATCH", f"optimizer loaded under {where} has iterations={steps}, saved {STEPS}")
    difference = max(
        max_relative_difference(expected, _outputs(model.predict(x, batch_size=entry.batch_size, verbose=0)))
        for model in (under_target, plain)
    )
    status = "yes" if difference <= FORWARD_TOLERANCE else "MISMATCH"
    return Result(status, f"predictions differ by {difference:.1e}", difference, FORWARD_TOLERANCE)


@functools.cache
def dropout_check(model_name: str, strategy_name: str) -> Result:
    """The model with dropout 0.3 under the strategy: a finite loss that falls over 5 epochs.

    Its first epoch starts from the weights of the float32 reference (dropout
    0, one device), so a first-epoch loss equal to the reference's would mean
    dropout did nothing under the strategy.
    """
    entry = ZOO[model_name]
    x, y = entry.data()
    try:
        with make_strategy(strategy_name).scope():
            model = entry.make(dropout=DROPOUT)
        history = model.fit(
            x, y, batch_size=entry.batch_size, epochs=DROPOUT_EPOCHS, shuffle=False, verbose=0
        )
    except Exception as e:
        return Result("FAILS", f"{type(e).__name__}: {first_line(e)}")
    losses = history.history["loss"]
    without = reference(model_name, "float32").history.history["loss"][0]
    detail = (
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {DROPOUT_EPOCHS} epochs; "
        f"first epoch without dropout {without:.3f}"
    )
    falls = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    active = abs(losses[0] - without) > 1e-3 * abs(without)
    return Result("yes" if falls and active else "MISMATCH", detail)


# --- the tests ---------------------------------------------------------------------------------


def _id(*names: str) -> str:
    return "-".join(names).replace(" ", "_")


def _cell_param(model, strategy, option):
    marks = [pytest.mark.slow] if (model, option) in SLOW_CELLS else []
    return pytest.param(model, strategy, option, marks=marks, id=_id(model, strategy, option))


@pytest.mark.parametrize(("model_name", "strategy_name", "option_name"), [_cell_param(*c) for c in PLAN])
def test_zoo_model_trains_like_one_device_or_refuses_by_name(model_name, strategy_name, option_name):
    result = train_cell(model_name, strategy_name, option_name)
    refusal = EXPECTED_REFUSALS.get((model_name, option_name))
    if refusal is not None:
        assert (result.status, result.detail) == ("refused", refusal)
    else:
        assert result.status == "yes", f"{result.status}: {result.detail}"
        assert result.difference <= tolerance(model_name, option_name)


@pytest.mark.parametrize(("model_name", "strategy_name"), FORWARD, ids=[_id(*p) for p in FORWARD])
def test_evaluate_and_predict_under_strategy_match_one_device_on_same_weights(model_name, strategy_name):
    result = forward_check(model_name, strategy_name)
    assert result.status == "yes", f"{result.status}: {result.detail}"
    assert result.difference <= FORWARD_TOLERANCE


@pytest.mark.parametrize(("model_name", "source", "target"), SAVES, ids=[_id(*p) for p in SAVES])
def test_keras_file_saved_under_one_strategy_loads_under_another_and_none_identically(model_name, source, target):
    result = save_load_check(model_name, source, target)
    assert result.status == "yes", f"{result.status}: {result.detail}"
    assert result.difference <= FORWARD_TOLERANCE


@pytest.mark.parametrize(("model_name", "strategy_name"), DROPOUT_PLAN, ids=[_id(*p) for p in DROPOUT_PLAN])
def test_zoo_model_with_dropout_trains_to_a_lower_finite_loss(model_name, strategy_name):
    result = dropout_check(model_name, strategy_name)
    assert result.status == "yes", f"{result.status}: {result.detail}"


def _dropout_rates(model: keras.Model) -> list:
    return [layer.rate for layer in model.layers if isinstance(layer, keras.layers.Dropout)]


@pytest.mark.parametrize("model_name", MODELS)
def test_zoo_model_weights_and_data_depend_only_on_the_seed(model_name):
    entry = ZOO[model_name]
    first, again, other = entry.build(0, 0.0), entry.build(0, 0.0), entry.build(1, 0.0)
    assert all(np.array_equal(a, b) for a, b in zip(first.get_weights(), again.get_weights()))
    assert not all(np.array_equal(a, b) for a, b in zip(first.get_weights(), other.get_weights()))
    # The data is generated afresh (not only cached) identically.
    x, y = entry.data()
    fresh_x, fresh_y = entry.data.__wrapped__()
    arrays, fresh = _outputs(x) + _outputs(y), _outputs(fresh_x) + _outputs(fresh_y)
    assert len(arrays) == len(fresh) and all(np.array_equal(a, b) for a, b in zip(arrays, fresh))
    assert all(len(a) == STEPS * entry.batch_size for a in arrays)
    # Dropout is always in the model; its rate is the `dropout` argument and
    # leaves the initial weights as they are.
    dropped = entry.build(0, DROPOUT)
    assert _dropout_rates(first) and set(_dropout_rates(first)) == {0.0}
    assert set(_dropout_rates(dropped)) == {DROPOUT}
    assert all(np.array_equal(a, b) for a, b in zip(first.get_weights(), dropped.get_weights()))


def test_covering_plan_meets_every_pair_of_model_strategy_and_option():
    cells = set(COVERING_PLAN)
    assert len(cells) == len(MODELS) * len(OPTIONS) == 54
    assert {(m, s) for m, s, _ in cells} == {(m, s) for m in MODELS for s in STRATEGY_NAMES}
    assert {(m, o) for m, _, o in cells} == {(m, o) for m in MODELS for o in OPTIONS}
    per_strategy_option = {(s, o): 0 for s in STRATEGY_NAMES for o in OPTIONS}
    for _, s, o in cells:
        per_strategy_option[s, o] += 1
    assert min(per_strategy_option.values()) >= 1
    # The extra checks reach every strategy (through 1 or 2 models each).
    for plan in (COVERING_FORWARD, [(m, t) for m, _, t in COVERING_SAVES], COVERING_DROPOUT):
        assert sorted({s for _, s in plan}) == sorted(STRATEGY_NAMES)
        assert min(sum(1 for _, s in plan if s == name) for name in STRATEGY_NAMES) >= 1


# --- the table ---------------------------------------------------------------------------------


class _Notes:
    """Numbered footnotes; the same text gets the same number."""

    def __init__(self):
        self.lines: list[str] = []

    def ref(self, text: str) -> int:
        if text not in self.lines:
            self.lines.append(text)
        return self.lines.index(text) + 1


def _mark(result: Result, label: str, where: str, notes: _Notes) -> str:
    """`label` for a pass, else `label: no|MISMATCH|FAILS (n)` with footnote n."""
    if result.status == "yes":
        return label
    if result.status == "refused":
        # The refusal names the combination itself.
        return f"{label}: no ({notes.ref(f'`NotImplementedError: {result.detail}`')})"
    detail = f"`{result.detail}`" if result.status == "FAILS" else result.detail
    return f"{label}: {result.status} ({notes.ref(f'{where}: {detail}')})"


def _worst(values) -> str:
    values = [v for v in values if v is not None]
    return f"{max(values):.0e}" if values else "-"


def render() -> str:
    """The markdown of `docs/models_verified.md`, from the covering plan's results."""
    notes = _Notes()
    lines = [
        "<!-- Generated by tests/models/test_conformance.py (TFDIST_UPDATE_ZOO=1); checked by it. -->",
        "| model | " + " | ".join(STRATEGY_NAMES) + " | tolerance float32 / bfloat16 | worst measured float32 / bfloat16 |",
        "|---|" + "---|" * (len(STRATEGY_NAMES) + 2),
    ]
    for model in MODELS:
        entry = ZOO[model]
        cells, float32, bfloat16 = [], [], []
        for strategy in STRATEGY_NAMES:
            marks = []
            for m, s, option in COVERING_PLAN:
                if (m, s) != (model, strategy):
                    continue
                result = train_cell(m, s, option)
                marks.append(_mark(result, option, f"{m} × {s} × {option}", notes))
                if OPTIONS[option].reference == "mixed_bfloat16":
                    bfloat16.append(result.difference)
                else:
                    float32.append(result.difference)
            cells.append(", ".join(marks))
        lines.append(
            f"| {model} | " + " | ".join(cells) + f" | {entry.tolerance:.0e} / {entry.bf16_tolerance:.0e} | "
            f"{_worst(float32)} / {_worst(bfloat16)} |"
        )
    lines += [
        "",
        "| model | evaluate, predict | .keras saved → loaded (→ no strategy) | trains with dropout 0.3 |",
        "|---|---|---|---|",
    ]
    for (model, forward_strategy), (_, source, target), (_, dropout_strategy) in zip(
        COVERING_FORWARD, COVERING_SAVES, COVERING_DROPOUT
    ):
        forward = _mark(forward_check(model, forward_strategy), forward_strategy, f"{model} evaluate", notes)
        saved = _mark(save_load_check(model, source, target), f"{source} → {target}", f"{model} save", notes)
        dropout = _mark(dropout_check(model, dropout_strategy), dropout_strategy, f"{model} dropout", notes)
        lines.append(f"| {model} | {forward} | {saved} | {dropout} |")
    lines += [
        "",
        "Each strategy cell lists the step options trained under it: the option's name alone means "
        f"parity with single-device Keras (max over weights of max|a-b|/max|a| after {STEPS} steps of "
        "a global batch of 16 on 2 replicas, within the model's tolerance). `default` buckets "
        "gradients (25 MiB); `accumulation_steps=2` is compared with Keras's "
        "`gradient_accumulation_steps=2` on the same micro-batches; `mixed_bfloat16` with one device "
        "under the same policy; `jit_compile` and `sink_size=8` with plain float32 Keras. "
        "Evaluate/predict and saving use the model trained with `default`; they and the "
        f"dropout check (a finite loss that falls over {DROPOUT_EPOCHS} epochs) name the strategy. "
        f"Forward passes match within {FORWARD_TOLERANCE:.0e}; loaded weights are identical.",
        "",
        "Tolerances:",
        "",
    ]
    for model in MODELS:
        entry = ZOO[model]
        lines.append(
            f"- {model} ({entry.family}): {entry.tolerance:.0e} ({entry.why}); "
            f"bfloat16 {entry.bf16_tolerance:.0e} ({entry.bf16_why})"
        )
    if notes.lines:
        lines += ["", "Notes (no: the combination raises `NotImplementedError`, naming itself):", ""]
        lines += [f"{i}. {text}" for i, text in enumerate(notes.lines, 1)]
    return "\n".join(lines) + "\n"


README_INTRO = (
    "Every model of the zoo in `tests/models/zoo.py` (small models on generated data; the MLP on the "
    "bundled digits) is trained under each local synchronous strategy on 2 logical CPU devices with "
    "each step option and compared with single-device Keras on the same data, seed and global "
    "batch. `make test` runs each model with each option once, rotating the strategy, so every "
    "model meets every strategy and every strategy every option (`TFDIST_ZOO_FULL=1` runs all "
    "270 combinations). The table is generated by `tests/models/test_conformance.py`, which fails "
    "if `docs/models_verified.md` or this copy disagrees with its results (the last column, the worst "
    "difference measured where the table was last generated, varies with the CPU: XLA compiles for "
    "the host, so it is checked against the tolerance, not the digits):"
)


def _measured_column_blank(table: str) -> str:
    """`table` with each model row's last cell, the worst measured differences, blanked.

    They vary from host to host (XLA's CPU code is compiled for the host's
    instruction set); whether they are within tolerance is what the marks say.
    """
    return re.sub(r"\| [0-9e.+-]+ / [0-9e.+-]+ \|$", "| measured |", table, flags=re.M)


def _readme_section(readme: str) -> tuple[int, int]:
    """Start and end offsets of the README's "Models verified" section body."""
    start = readme.index(README_HEADING + "\n") + len(README_HEADING) + 1
    end = readme.find("\n## ", start)
    return start, (len(readme) if end < 0 else end + 1)


def _wrap(text: str, width: int = 100) -> str:
    """`text` filled to `width` columns, never breaking inside a `code span`."""
    spans = text.split("`")
    kept = "`".join(part.replace(" ", "\0") if i % 2 else part for i, part in enumerate(spans))
    return textwrap.fill(kept, width).replace("\0", " ")


def _readme_body(table: str) -> str:
    body = "".join(table.splitlines(keepends=True)[1:])  # without the generated-file comment
    return f"\n{_wrap(README_INTRO)}\n\n{body}\n"


@pytest.mark.slow
def test_models_verified_table_matches_docs_and_readme():
    table = render()
    if os.environ.get("TFDIST_UPDATE_ZOO"):
        TABLE_FILE.write_text(table)
        readme = README_FILE.read_text()
        start, end = _readme_section(readme)
        README_FILE.write_text(readme[:start] + _readme_body(table) + readme[end:])
    assert _measured_column_blank(TABLE_FILE.read_text()) == _measured_column_blank(table), (
        "docs/models_verified.md differs from this run's table; rerun with TFDIST_UPDATE_ZOO=1.\n" + table
    )
    readme = README_FILE.read_text()
    start, end = _readme_section(readme)
    assert _measured_column_blank(readme[start:end]) == _measured_column_blank(_readme_body(table)), (
        "docs/correctness.md's 'Models verified' section differs from this run's table; rerun with TFDIST_UPDATE_ZOO=1."
    )

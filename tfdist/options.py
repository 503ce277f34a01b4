"""Every tfdist option: its one name, type, default, validation and doc.

Options reach tfdist three ways — keyword arguments to `tfdist.get_strategy`,
keys of a TOML preset, and flags of the `tfdist` command — and all three are
validated here, by the same code, so an option has one spelling and one error
message everywhere.

Two kinds of option exist:

* step options (`TrainingOptions`), shared by every strategy: how the training
  step runs (gradient fusion, ...);
* strategy parameters, particular to one strategy (`devices=` for mirrored,
  `parameter_device=` for central storage, ...). Each strategy declares its own
  with the same `Option` record, so they validate the same way.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Any, Callable, Mapping, Optional


class OptionError(ValueError):
    """An option has the wrong type or value; the message names both and the fix."""


@dataclasses.dataclass(frozen=True)
class Option:
    """The declaration of one option.

    Args:
        name: str. The option's name in code, TOML and on the command line.
        default: The value used when the option is not given.
        types: tuple of types. Accepted Python types (`None` is accepted when
            the default is `None`).
        expected: str. What a valid value looks like, for error messages.
        doc: str. One sentence for the README and `--help`.
        check: Optional callable returning `True` for a valid value (beyond its
            type).
        env: Optional environment variable that overrides the default.
    """

    name: str
    default: Any
    types: tuple
    expected: str
    doc: str
    check: Optional[Callable[[Any], bool]] = None
    env: Optional[str] = None

    def resolve_default(self) -> Any:
        if self.env and os.environ.get(self.env, "") != "":
            raw = os.environ[self.env]
            try:
                value = type(self.default)(raw) if self.default is not None else raw
            except ValueError:
                raise OptionError(
                    f"Environment variable {self.env} must be {self.expected}. "
                    f"Received: {self.env}={raw!r}"
                ) from None
            return self.validate(value, source=f"environment variable {self.env}")
        return self.default

    def validate(self, value: Any, source: str = "") -> Any:
        """Returns `value` if valid, else raises `OptionError` naming it."""
        where = f"{source}: " if source else ""
        if value is None and self.default is None:
            return None
        # A NumPy integer (`np.int64(4)`, a value computed with NumPy) is an int.
        if int in self.types and isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            value = int(value)
        # bool is an int subclass; an int option must not accept True/False.
        bad_bool = isinstance(value, bool) and bool not in self.types
        if bad_bool or not isinstance(value, self.types):
            raise OptionError(
                f"{where}option '{self.name}' must be {self.expected}. "
                f"Received: {self.name}={value!r} (type {type(value).__name__})"
            )
        if self.check is not None and not self.check(value):
            raise OptionError(
                f"{where}option '{self.name}' must be {self.expected}. "
                f"Received: {self.name}={value!r}"
            )
        return value


def _nonneg_int(v: Any) -> bool:
    return v >= 0


def _device_list(v: Any) -> bool:
    return len(v) > 0 and all(isinstance(d, str) and d for d in v)


def _sink_size(v: Any) -> bool:
    # "epoch" or a positive int (bool is rejected by the type check).
    return v == "epoch" if isinstance(v, str) else v >= 1


def _positive_int(v: Any) -> bool:
    return v >= 1


def _accumulation_steps(v: Any) -> bool:
    return v >= 1


DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# Wire dtypes of the all-reduce (the `allreduce_dtype` step option).
ALLREDUCE_DTYPES = ("float32", "bfloat16", "float16")

# The step options, shared by every strategy. Add new ones here only.
STEP_OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        Option(
            name="bucket_bytes",
            default=DEFAULT_BUCKET_BYTES,
            types=(int,),
            expected="an integer >= 0 (bytes per fused gradient buffer; 0 turns fusion off)",
            doc=(
                "Gradients are packed into fused buffers of at most this many bytes "
                "before they cross devices; 0 sends one collective per variable. "
                "Default 25 MiB; environment override TFDIST_BUCKET_BYTES."
            ),
            check=_nonneg_int,
            env="TFDIST_BUCKET_BYTES",
        ),
        Option(
            name="allreduce_dtype",
            default="float32",
            types=(str,),
            expected=f"one of {', '.join(repr(d) for d in ALLREDUCE_DTYPES)}",
            doc=(
                "Compressed exchange: float32 buckets are cast to this dtype before the "
                "all-reduce and back after it (float16 is pre-scaled by 1/replicas against "
                "overflow); 'float32' sends them as they are. Environment override "
                "TFDIST_ALLREDUCE_DTYPE."
            ),
            check=lambda v: v in ALLREDUCE_DTYPES,
            env="TFDIST_ALLREDUCE_DTYPE",
        ),
        Option(
            name="accumulation_steps",
            default=1,
            types=(int,),
            expected="an integer >= 1 (micro-batches per optimizer step; 1 turns accumulation off)",
            doc=(
                "Gradient accumulation: sum the gradients of this many micro-batches on "
                "each replica and communicate and update once, on the last one."
            ),
            check=_accumulation_steps,
        ),
        Option(
            name="precision",
            default="float32",
            types=(str,),
            expected="one of 'float32', 'mixed_float16', 'mixed_bfloat16'",
            doc=(
                "Keras dtype policy of the layers built in the strategy's scope; "
                "variables stay float32; 'mixed_float16' adds dynamic loss scaling. "
                "'float32' defers to keras.config.dtype_policy()."
            ),
            check=lambda v: v in ("float32", "mixed_float16", "mixed_bfloat16"),
        ),
        Option(
            name="jit_compile",
            default=False,
            types=(bool,),
            expected="True or False",
            doc=(
                "Compile each replica's forward and backward pass with XLA (as "
                "model.compile(jit_compile=True)); collectives stay outside XLA."
            ),
        ),
        Option(
            name="sink_size",
            default=None,
            types=(int, str),
            expected='a positive integer or "epoch" (training steps per host call)',
            doc=(
                "Data sinking: run this many training steps per host call in an "
                'on-device loop (as Keras\'s steps_per_execution), or "epoch" for a '
                "whole epoch per call. Default: the model's steps_per_execution."
            ),
            check=_sink_size,
        ),
        Option(
            name="transfer",
            default=True,
            types=(bool,),
            expected="True or False",
            doc=(
                "Stage input batches onto each replica's device ahead of compute "
                "(tfdist.data.TransferManager); False leaves batches on the host "
                "until the step needs them."
            ),
        ),
        Option(
            name="prefetch_depth",
            default=2,
            types=(int,),
            expected="an integer >= 1 (batches staged ahead on each replica's device)",
            doc=(
                "Batches the TransferManager keeps staged on each replica's device; "
                "2 is double buffering. Environment override TFDIST_PREFETCH_DEPTH."
            ),
            check=_positive_int,
            env="TFDIST_PREFETCH_DEPTH",
        ),
    ]
}

# Strategy parameters that more than one strategy takes.
DEVICES = Option(
    name="devices",
    default=None,
    types=(list, tuple),
    expected="a non-empty list of device strings such as ['/cpu:0', '/cpu:1']",
    doc="Devices to replicate over; default: every local GPU, else every logical CPU.",
    check=_device_list,
)


# Communication of the synchronous strategies that cross processes (multi_worker
# today; mirrored can adopt them for its cross-device ops).
COMMUNICATION_IMPLEMENTATIONS = ("auto", "ring", "nccl")
COMMUNICATION = Option(
    name="communication",
    default="auto",
    types=(str,),
    expected=f"one of {', '.join(repr(c) for c in COMMUNICATION_IMPLEMENTATIONS)}",
    doc=(
        "Collective implementation: 'ring' (gRPC ring, CPU or GPU), 'nccl' (GPUs only) or "
        "'auto' (TensorFlow picks: NCCL on GPUs, ring otherwise)."
    ),
    check=lambda v: v in COMMUNICATION_IMPLEMENTATIONS,
)
HIERARCHICAL = Option(
    name="hierarchical",
    default=True,
    types=(bool,),
    expected="True or False",
    doc=(
        "With several replicas on each of several CPU workers, sum each gradient bucket within the "
        "worker first, all-reduce it across workers from one device per worker, then copy the sum to "
        "the worker's other replicas (False: one ring through every device of every worker)."
    ),
)
# Timeouts of multi-process jobs (docs/operations.md, "Timeouts").
DEFAULT_STARTUP_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
STARTUP_TIMEOUT = Option(
    name="startup_timeout",
    default=None,
    types=(int, float),
    expected="a number of seconds > 0",
    doc=(
        "Seconds a task of a multi-process job waits at start-up for the other tasks to answer "
        "before it exits with an error naming those that did not; default 300. Environment "
        "override TFDIST_STARTUP_TIMEOUT (`tfdist launch --startup-timeout S` sets it)."
    ),
    check=lambda v: v > 0,
    env="TFDIST_STARTUP_TIMEOUT",
)
COLLECTIVE_TIMEOUT = Option(
    name="collective_timeout",
    default=None,
    types=(int, float),
    expected="a number of seconds >= 0 (0 for no timeout)",
    doc=(
        "Seconds a collective (all-reduce, broadcast) may wait for its peers before the step fails "
        "instead of hanging when a worker is gone or stuck; default 600 in a job of several "
        "workers, none for one process; 0 turns it off. Environment override "
        "TFDIST_COLLECTIVE_TIMEOUT."
    ),
    check=lambda v: v >= 0,
    env="TFDIST_COLLECTIVE_TIMEOUT",
)


def seconds(option: Option, value: Any, default: float) -> float:
    """A timeout in seconds: `value` if given, else `option.env` if set, else `default`.

    Raises `OptionError` naming the option (or the environment variable) for a bad value.
    """
    if value is not None:
        return float(option.validate(value))
    raw = os.environ.get(option.env or "", "").strip()
    if not raw:
        return float(default)
    try:
        parsed = float(raw)
    except ValueError:
        raise OptionError(
            f"Environment variable {option.env} must be {option.expected}. Received: {option.env}={raw!r}"
        ) from None
    return float(option.validate(parsed, source=f"environment variable {option.env}"))


DEVICES_PER_WORKER = Option(
    name="devices_per_worker",
    default=None,
    types=(int,),
    expected="an integer >= 1 (replicas each worker trains on: its GPUs, else its logical CPU devices)",
    doc=(
        "Replicas each worker contributes: that many of its GPUs, or on a worker without GPUs that "
        "many of its logical CPU devices (`tfdist.configure_local_devices`); default every GPU of "
        "the worker, or one CPU replica (environment TFDIST_DEVICES_PER_WORKER, set by "
        "`tfdist launch --devices-per-worker`)."
    ),
    check=lambda v: v >= 1,
)


class TrainingOptions:
    """The validated step options a tfdist strategy carries into `model.fit`.

    One attribute per entry of `STEP_OPTIONS` (e.g. `bucket_bytes`), each
    validated; unknown names raise `TypeError`. Immutable.

    Example:

    ```python
    opts = tfdist.options.TrainingOptions.from_mapping({"bucket_bytes": 0})
    opts.bucket_bytes  # 0
    ```
    """

    __slots__ = ("_values",)

    def __init__(self, **values: Any):
        unknown = sorted(set(values) - set(STEP_OPTIONS))
        if unknown:
            raise TypeError(f"Unknown step option {unknown[0]!r}. Valid: {', '.join(sorted(STEP_OPTIONS))}")
        resolved = {
            name: opt.validate(values[name]) if name in values else opt.resolve_default()
            for name, opt in STEP_OPTIONS.items()
        }
        object.__setattr__(self, "_values", resolved)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("TrainingOptions is immutable; build a new one with from_mapping().")

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainingOptions) and self._values == other._values

    def __repr__(self) -> str:
        return "TrainingOptions(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "") -> TrainingOptions:
        """Validates `values` (naming `source` in errors) and returns the options."""
        checked = {
            name: STEP_OPTIONS[name].validate(value, source=source)
            for name, value in values.items()
            if name in STEP_OPTIONS
        }
        return cls(**checked)


def split_options(
    strategy_name: str,
    params: Mapping[str, Option],
    values: Mapping[str, Any],
    source: str = "",
) -> tuple[dict[str, Any], TrainingOptions]:
    """Splits `values` into validated strategy parameters and step options.

    Raises `TypeError` for a name that is neither, listing the valid ones (as
    Python does for an unexpected keyword argument), and `OptionError` for a
    known name with a bad value.
    """
    valid = sorted(set(params) | set(STEP_OPTIONS))
    unknown = [k for k in values if k not in params and k not in STEP_OPTIONS]
    if unknown:
        where = f"{source}: " if source else ""
        raise TypeError(
            f"{where}unknown option {unknown[0]!r} for strategy {strategy_name!r}. "
            f"Valid options: {', '.join(valid)}"
        )
    strategy_kwargs = {
        k: params[k].validate(v, source=source) for k, v in values.items() if k in params
    }
    step = TrainingOptions.from_mapping(
        {k: v for k, v in values.items() if k in STEP_OPTIONS}, source=source
    )
    return strategy_kwargs, step

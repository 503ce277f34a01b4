"""`tfdist.tune` and `tfdist tune`: the step options tried on the user's own model, and the best written as a preset.

A short coordinate search from the defaults, as Horovod's autotuner searches
its fusion threshold and cycle time, scored by samples per second: each
setting below runs the model for a bounded number of steps (after 2 warm-up
host calls, which trace), one option changed at a time; then, where two or
more options each beat the defaults, their best values together. Settings:

* `bucket_bytes` (gradient fusion buffer) in `bucket_mib` MiB;
* `sink_size` (steps per host call) in `sink_sizes`;
* `hierarchical=False`, for strategies that take it, with several devices per worker;
* `allreduce_dtype="bfloat16"` only when asked (`allreduce_dtype=True`):
  it changes the numerics (docs/multi_worker.md, "Compressed exchange").

`tune` runs its trials in this process (strategies of one process:
mirrored, central_storage, sharded_optimizer on one host). `tfdist tune --
python train.py` runs the user's script once per setting, each under its own
preset (`{preset}` in the command, or the environment variable
`TFDIST_PRESET`, which the script passes to `tfdist.from_config`), as a job of
`--workers` processes when given; each trial's script is ended once its steps
are timed (`tfdist.report.recorder`, `TFDIST_TUNE_TRIAL`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Optional, Sequence

DEFAULT_BUCKET_MIB = (1, 4, 16, 64)
DEFAULT_SINK_SIZES = (8, 32)
PRESET_ENV = "TFDIST_PRESET"
TRIAL_ENV = "TFDIST_TUNE_TRIAL"
TRIAL_STEPS_ENV = "TFDIST_TUNE_STEPS"
WARMUP_CALLS = 2


def settings(defaults: dict, bucket_mib: Sequence[float], sink_sizes: Sequence[int], hierarchical: bool,
             allreduce_dtype: bool) -> list[dict]:
    """The option sets tried one at a time from `defaults` (the defaults first, as `{}`)."""
    out: list[dict] = [{}]
    for mib in bucket_mib:
        value = int(mib * 2**20)
        if value != defaults.get("bucket_bytes"):
            out.append({"bucket_bytes": value})
    for k in sink_sizes:
        if k != defaults.get("sink_size"):
            out.append({"sink_size": int(k)})
    if hierarchical:
        out.append({"hierarchical": not defaults.get("hierarchical", True)})
    if allreduce_dtype and defaults.get("allreduce_dtype", "float32") != "bfloat16":
        out.append({"allreduce_dtype": "bfloat16"})
    return out


def _combined(rows: list[dict]) -> Optional[dict]:
    """The best value of each option that beat the defaults, where two or more did; else None."""
    base = rows[0]["samples_per_s"] or 0.0
    best: dict[str, tuple[float, Any]] = {}
    for row in rows[1:]:
        rate = row["samples_per_s"] or 0.0
        for key, value in row["changed"].items():
            if rate > base and rate > best.get(key, (0.0, None))[0]:
                best[key] = (rate, value)
    return {k: v for k, (_, v) in best.items()} if len(best) >= 2 else None


def _label(changed: dict) -> str:
    if not changed:
        return "defaults"
    parts = []
    for key, value in changed.items():
        if key == "bucket_bytes":
            parts.append(f"bucket_bytes={value / 2**20:g} MiB")
        else:
            parts.append(f"{key}={value!r}")
    return ", ".join(parts)


def format_table(result: dict) -> str:
    """The tuner's table: samples/s per setting, its ratio to the defaults, and the best."""
    rows = result["rows"]
    width = max(len(r["label"]) for r in rows) + 2
    lines = [f"{'setting':<{width}} {'samples/s':>12} {'vs defaults':>12}", "-" * (width + 26)]
    for r in rows:
        rate = f"{r['samples_per_s']:>12,.0f}" if r["samples_per_s"] else f"{'failed':>12}"
        ratio = f"{r['vs_defaults']:>12.2f}" if r.get("vs_defaults") else f"{'-':>12}"
        lines.append(f"{r['label']:<{width}} {rate} {ratio}")
    best = result["best"]
    lines.append(f"best: {best['label']} at {best['samples_per_s']:,.0f} samples/s, "
                 f"{100 * (result['gain'] - 1):+.1f}% over the defaults")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ValueError(f"A preset value must be a bool, number, string or list. Received: {value!r}")


def write_preset(path: str, strategy: str, options: dict, comment: str = "") -> str:
    """Writes a preset TOML for `tfdist.from_config`: `strategy = "..."` and one key per option."""
    lines = [f"# {line}" for line in comment.splitlines()] + [f"strategy = {_toml_value(strategy)}"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in options.items()]
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _finish(strategy: str, base: dict, rows: list[dict], apply: Optional[str], verbose: int) -> dict:
    default_rate = rows[0]["samples_per_s"]
    for r in rows:
        r["vs_defaults"] = r["samples_per_s"] / default_rate if r["samples_per_s"] and default_rate else None
    best = max((r for r in rows if r["samples_per_s"]), key=lambda r: r["samples_per_s"], default=rows[0])
    result = {"strategy": strategy, "base_options": base, "rows": rows, "best": best,
              "gain": best["vs_defaults"] or 1.0, "best_options": {**base, **best["changed"]}}
    if apply:
        comment = (f"Written by tfdist tune: {best['label']}, {best['samples_per_s'] or 0:,.0f} samples/s, "
                   f"{100 * (result['gain'] - 1):+.1f}% over the defaults.")
        result["preset"] = write_preset(apply, strategy, result["best_options"], comment)
    if verbose:
        print(format_table(result), flush=True)
        if apply:
            print(f"wrote {apply}: tfdist.from_config({apply!r})", flush=True)
    return result


def _check_search(bucket_mib, sink_sizes, steps) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Argument 'steps' must be an integer >= 1. Received: steps={steps!r}")
    for mib in bucket_mib:
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or mib < 0:
            raise ValueError(f"Argument 'bucket_mib' must hold numbers >= 0 (MiB). Received: bucket_mib={bucket_mib!r}")
    for k in sink_sizes:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Argument 'sink_sizes' must hold integers >= 1. Received: sink_sizes={sink_sizes!r}")


def tune(
    build_model: Callable[[], Any],
    data,
    strategy: str = "mirrored",
    steps: int = 20,
    bucket_mib: Sequence[float] = DEFAULT_BUCKET_MIB,
    sink_sizes: Sequence[int] = DEFAULT_SINK_SIZES,
    allreduce_dtype: bool = False,
    apply: Optional[str] = None,
    verbose: int = 1,
    **strategy_options: Any,
) -> dict:
    """Tries the step options on the user's model in this process and returns (and prints) samples/s per setting.

    Each setting builds the strategy (`registry.get_strategy(strategy,
    **strategy_options, **setting)`), calls `build_model()` in its scope, and
    trains `steps` steps after 2 warm-up host calls, timed by a `StepReport`
    without the profiler. See the module's doc for the settings.

    Args:
        build_model: callable returning a compiled Keras model; called inside
            each trial strategy's scope.
        data: a `tf.data.Dataset` of batches that repeats (or a callable
            returning one), as `fit` takes it.
        strategy: str, the strategy's registered name (default "mirrored").
            Strategies of one process only; for a job of several processes use
            `tfdist tune --workers N -- python train.py`.
        steps: int, steps timed per setting (default 20).
        bucket_mib: `bucket_bytes` values to try, in MiB (default 1, 4, 16, 64).
        sink_sizes: `sink_size` values to try (default 8, 32).
        allreduce_dtype: bool, also try `allreduce_dtype="bfloat16"` (changes
            the numerics; default False).
        apply: Optional path: write the best setting as a preset TOML there,
            for `tfdist.from_config`.
        verbose: int, 1 prints the table (default).
        **strategy_options: options every setting starts from (e.g. `devices=`).

    Returns:
        `{"rows": [{"label", "changed", "samples_per_s", "vs_defaults"}],
        "best": row, "gain": best / defaults, "best_options": {...},
        "preset": path}`.

    Example:

    ```python
    result = tfdist.tune(build_model, dataset.repeat(), strategy="mirrored", steps=20, apply="tuned.toml")
    strategy = tfdist.from_config("tuned.toml")
    ```
    """
    from tfdist import registry
    from tfdist.callbacks import StepReport

    _check_search(bucket_mib, sink_sizes, steps)
    cls = registry.strategy_class(strategy) if strategy in registry.strategy_names() else None
    if cls is None:
        raise ValueError(f"Unknown strategy name {strategy!r}. Valid names: {registry.strategy_names()}.")
    probe = registry.get_strategy(strategy, **strategy_options)
    defaults = {**probe.options.as_dict(), **strategy_options}
    if defaults.get("sink_size") is None:
        defaults["sink_size"] = 1
    multi_device_workers = "hierarchical" in cls.PARAMS and len(probe.extended.worker_devices) > 1
    trials = settings(defaults, bucket_mib, sink_sizes, multi_device_workers, allreduce_dtype)
    rows: list[dict] = []

    def run(changed: dict) -> None:
        options = {**strategy_options, **changed}
        trial_strategy = registry.get_strategy(strategy, **options)
        with trial_strategy.scope():
            model = build_model()
        sink = changed.get("sink_size", defaults.get("sink_size") or 1)
        calls = WARMUP_CALLS + math.ceil(steps / sink)
        report = StepReport(profile_steps=0, warmup_steps=WARMUP_CALLS, verbose=0)
        dataset = data() if callable(data) else data
        try:
            model.fit(dataset, epochs=1, steps_per_epoch=calls * sink, verbose=0, callbacks=[report])
            rate = report.result["samples_per_s"]
            error = None
        except Exception as e:  # a setting the model cannot run: reported, the search goes on
            rate, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append({"label": _label(changed), "changed": changed, "samples_per_s": rate, "error": error})
        if verbose:
            shown = f"{rate:,.0f} samples/s" if rate else error
            print(f"  {_label(changed)}: {shown}", flush=True)

    for changed in trials:
        run(changed)
    combined = _combined(rows)
    if combined is not None:
        run(combined)
    return _finish(strategy, strategy_options, rows, apply, verbose)


# ---------------------------------------------------------------------------
# `tfdist tune -- python train.py`: one run of the user's script per setting.
# ---------------------------------------------------------------------------


def add_arguments(p) -> None:
    """The flags of `tfdist tune`."""
    p.add_argument("--preset", default=None, metavar="FILE",
                   help="the preset every setting starts from (default: strategy = --strategy)")
    p.add_argument("--strategy", default="multi_worker", help="strategy without --preset (default multi_worker)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="run each setting as a job of N processes (tfdist launch); default: one process")
    p.add_argument("--devices-per-worker", type=int, default=None, metavar="K",
                   help="as tfdist launch --devices-per-worker (then hierarchical=False is tried too)")
    p.add_argument("--steps", type=int, default=20, help="steps timed per setting (default 20)")
    p.add_argument("--bucket-mib", type=float, nargs="*", default=list(DEFAULT_BUCKET_MIB), metavar="MIB",
                   help="bucket_bytes to try, in MiB (default 1 4 16 64)")
    p.add_argument("--sink-sizes", type=int, nargs="*", default=list(DEFAULT_SINK_SIZES), metavar="K",
                   help="sink_size values to try (default 8 32)")
    p.add_argument("--allreduce-dtype", action="store_true",
                   help="also try allreduce_dtype='bfloat16' (changes the numerics)")
    p.add_argument("--apply", default=None, metavar="FILE", help="write the best setting as a preset TOML")
    p.add_argument("--timeout", type=float, default=600, help="seconds per setting (default 600)")
    p.usage = ("tfdist tune [--preset FILE | --strategy NAME] [--workers N] [--steps N] [--bucket-mib MIB ...] "
               "[--sink-sizes K ...] [--allreduce-dtype] [--apply FILE] -- python train.py {preset} ARGS")
    p.epilog = ("The script builds its strategy with tfdist.from_config(path), path being the argument that "
                "replaces {preset} or the environment variable TFDIST_PRESET. docs/performance.md")


def _run_trial(command: list[str], preset: str, args, env: dict) -> dict:
    """Runs the script once under `preset`; returns the chief's measurement or `{"error": ...}`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trial.json")
        argv = [a.replace("{preset}", preset) for a in command]
        trial_env = {**env, PRESET_ENV: preset, TRIAL_ENV: out, TRIAL_STEPS_ENV: str(args.steps)}
        if args.workers:
            from tfdist.launch import devices_per_worker_environment, run_job

            if args.devices_per_worker:
                trial_env.update(devices_per_worker_environment(args.devices_per_worker))
            status = run_job(argv, workers=args.workers, env=trial_env, timeout=args.timeout)
        else:
            try:
                status = subprocess.run(argv, env={**os.environ, **trial_env}, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                status = 124
        if not os.path.exists(out):
            return {"error": f"the script exited with status {status} before {args.steps} steps were timed "
                             "(does it train with Keras fit under a tfdist strategy, long enough?)"}
        with open(out) as f:
            return json.load(f)


def main(args) -> int:
    """Runs `tfdist tune` from parsed arguments (`args.rest` holds the command)."""
    from tfdist.registry import PresetError, load_preset

    command = list(args.rest or [])
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        print("tfdist tune: no command given. Usage: tfdist tune --workers 2 -- python train.py {preset}",
              file=sys.stderr)
        return 2
    try:
        _check_search(args.bucket_mib, args.sink_sizes, args.steps)
        if args.preset:
            strategy, base, _ = load_preset(args.preset)
        else:
            strategy, base = args.strategy, {}
    except (ValueError, PresetError) as e:
        print(f"tfdist tune: {e}", file=sys.stderr)
        return 2
    defaults = {"bucket_bytes": 25 * 2**20, "sink_size": 1, "allreduce_dtype": "float32", "hierarchical": True, **base}
    trials = settings(defaults, args.bucket_mib, args.sink_sizes, bool(args.devices_per_worker
                                                                         and args.devices_per_worker > 1),
                      args.allreduce_dtype)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        def run(changed: dict) -> None:
            preset = write_preset(os.path.join(tmp, f"trial{len(rows)}.toml"), strategy, {**base, **changed})
            measured = _run_trial(command, preset, args, {})
            ran = measured.get("options") or {}
            ignored = {k: v for k, v in changed.items() if k in ran and ran[k] != v}
            if ignored:
                measured = {"error": f"the script's strategy ran with { {k: ran[k] for k in ignored} }, "
                                     f"not the trial's {ignored}: build it with tfdist.from_config(path), path "
                                     f"being {{preset}} in the command or os.environ['{PRESET_ENV}']"}
            rate = measured.get("samples_per_s")
            rows.append({"label": _label(changed), "changed": changed, "samples_per_s": rate,
                         "error": measured.get("error")})
            shown = f"{rate:,.0f} samples/s" if rate else measured.get("error") or "no samples counted"
            print(f"tfdist tune: {_label(changed)}: {shown}", flush=True)

        for changed in trials:
            run(changed)
        if not rows[0]["samples_per_s"]:
            print(f"tfdist tune: the defaults did not run: {rows[0]['error']}", file=sys.stderr)
            return 1
        combined = _combined(rows)
        if combined is not None:
            run(combined)
    _finish(strategy, base, rows, args.apply, verbose=1)
    return 0


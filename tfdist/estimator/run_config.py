"""Where and how an `Estimator` runs: `RunConfig`."""

from __future__ import annotations

import os
from typing import Any, Callable, Union

import tensorflow as tf

StrategyLike = Union[tf.distribute.Strategy, str, Callable[[], tf.distribute.Strategy], None]

# TF1's default when neither save_checkpoints_steps nor save_checkpoints_secs is given.
DEFAULT_SAVE_CHECKPOINTS_SECS = 600


def _check_count(name: str, value: Any, minimum: int = 1) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"RunConfig argument '{name}' must be an integer >= {minimum} or None. "
                         f"Received: {name}={value!r}")
    return value


def _check_strategy(name: str, value: Any) -> StrategyLike:
    if value is None or isinstance(value, (tf.distribute.Strategy, str)) or callable(value):
        return value
    raise TypeError(
        f"RunConfig argument '{name}' must be a tf.distribute.Strategy (e.g. "
        "tfdist.get_strategy('mirrored')), a tfdist strategy name, a callable returning a "
        f"strategy, or None. Received: {name} of type {type(value).__name__}"
    )


def task_from_tf_config() -> tuple[str | None, int, dict]:
    """`(task type, task index, cluster dict)` from the TF_CONFIG environment variable.

    `(None, 0, {})` when TF_CONFIG is unset: a local run. A TF_CONFIG that is
    set is validated by `tfdist.cluster.parse_tf_config` (which raises
    `ClusterConfigError` naming the bad field).
    """
    if not os.environ.get("TF_CONFIG", "").strip():
        return None, 0, {}
    from tfdist.cluster import parse_tf_config

    config = parse_tf_config()
    return config.task_type, config.task_id, {job: list(addrs) for job, addrs in config.cluster.items()}


class RunConfig:
    """Where an `Estimator` keeps its files, which strategies it uses, and how often it reports.

    Args:
        model_dir: Optional str. Directory for checkpoints, TensorBoard
            summaries and exports. Default `None` (then `Estimator`'s own
            `model_dir` must be given).
        train_distribute: Optional strategy for training: a
            `tf.distribute.Strategy` (e.g. `tfdist.get_strategy("mirrored")`),
            a tfdist strategy name (created when training starts, so an
            evaluator process never joins the training cluster), or a callable
            returning a strategy. Default `None`: one device.
        eval_distribute: Optional strategy for `evaluate` and `predict`, same
            forms. Default `None`: one device.
        save_checkpoints_steps: Optional int. Save a checkpoint every this many
            global steps. Default `None`.
        save_checkpoints_secs: Optional int. Save a checkpoint when this many
            seconds have passed since the last one. Default `None`; when both
            are `None`, 600 seconds (TF1's default). A checkpoint is always
            saved when `train` ends.
        save_summary_steps: int. Write TensorBoard summaries (`loss`,
            `global_step/sec`) every this many steps; `None` writes none.
            Default 100.
        keep_checkpoint_max: int. Checkpoints kept in `model_dir`; older ones
            are deleted. Default 5.
        log_step_count_steps: int. Log the step, loss and steps per second
            every this many steps (logger `tfdist.estimator`, INFO, shown on
            stderr when logging is not configured); `None` logs no progress.
            Default 100.
        tf_random_seed: Optional int. Seeds Python, NumPy, TensorFlow and
            Keras (`keras.utils.set_random_seed`) before the variables are
            created. Default `None`.

    Attributes:
        task_type, task_id: this process's role from TF_CONFIG (`None`, 0 in a
            local run).
        is_chief: whether this process writes checkpoints and summaries.

    Example:

    ```python
    config = RunConfig(model_dir="/tmp/digits", train_distribute=tfdist.get_strategy("mirrored"),
                       save_checkpoints_steps=100, tf_random_seed=0)
    estimator = Estimator(model_fn, config=config, params={"hidden": 32})
    ```
    """

    def __init__(
        self,
        model_dir: str | None = None,
        train_distribute: StrategyLike = None,
        eval_distribute: StrategyLike = None,
        save_checkpoints_steps: int | None = None,
        save_checkpoints_secs: int | None = None,
        save_summary_steps: int | None = 100,
        keep_checkpoint_max: int = 5,
        log_step_count_steps: int | None = 100,
        tf_random_seed: int | None = None,
    ):
        if model_dir is not None and not isinstance(model_dir, (str, os.PathLike)):
            raise TypeError(f"RunConfig argument 'model_dir' must be a path. Received: model_dir={model_dir!r}")
        self.model_dir = os.fspath(model_dir) if model_dir is not None else None
        self.train_distribute = _check_strategy("train_distribute", train_distribute)
        self.eval_distribute = _check_strategy("eval_distribute", eval_distribute)
        self.save_checkpoints_steps = _check_count("save_checkpoints_steps", save_checkpoints_steps)
        self.save_checkpoints_secs = _check_count("save_checkpoints_secs", save_checkpoints_secs)
        if save_checkpoints_steps is not None and save_checkpoints_secs is not None:
            raise ValueError(
                "RunConfig takes save_checkpoints_steps or save_checkpoints_secs, not both. "
                f"Received: save_checkpoints_steps={save_checkpoints_steps}, "
                f"save_checkpoints_secs={save_checkpoints_secs}"
            )
        if save_checkpoints_steps is None and save_checkpoints_secs is None:
            self.save_checkpoints_secs = DEFAULT_SAVE_CHECKPOINTS_SECS
        self.save_summary_steps = _check_count("save_summary_steps", save_summary_steps)
        self.keep_checkpoint_max = _check_count("keep_checkpoint_max", keep_checkpoint_max)
        self.log_step_count_steps = _check_count("log_step_count_steps", log_step_count_steps)
        self.tf_random_seed = _check_count("tf_random_seed", tf_random_seed, minimum=0)
        self.task_type, self.task_id, self.cluster = task_from_tf_config()

    @property
    def is_chief(self) -> bool:
        if self.task_type is None:
            return True
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_id == 0

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with the given arguments changed (TF1's `RunConfig.replace`)."""
        names = ("model_dir", "train_distribute", "eval_distribute", "save_checkpoints_steps",
                 "save_checkpoints_secs", "save_summary_steps", "keep_checkpoint_max",
                 "log_step_count_steps", "tf_random_seed")
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"RunConfig.replace got an unknown argument {unknown[0]!r}. Valid: {', '.join(names)}")
        values = {n: getattr(self, n) for n in names}
        if "save_checkpoints_steps" in changes:
            values["save_checkpoints_secs"] = None
        if "save_checkpoints_secs" in changes:
            values["save_checkpoints_steps"] = None
        values.update(changes)
        return RunConfig(**values)

    def __repr__(self) -> str:
        return (
            f"RunConfig(model_dir={self.model_dir!r}, train_distribute={self.train_distribute!r}, "
            f"eval_distribute={self.eval_distribute!r}, save_checkpoints_steps={self.save_checkpoints_steps}, "
            f"save_checkpoints_secs={self.save_checkpoints_secs}, save_summary_steps={self.save_summary_steps}, "
            f"keep_checkpoint_max={self.keep_checkpoint_max}, log_step_count_steps={self.log_step_count_steps}, "
            f"tf_random_seed={self.tf_random_seed})"
        )


def resolve_strategy(value: StrategyLike) -> tf.distribute.Strategy:
    """The strategy a `RunConfig` field stands for; the default strategy for `None`."""
    if value is None:
        return tf.distribute.get_strategy()
    if isinstance(value, tf.distribute.Strategy):
        return value
    if isinstance(value, str):
        from tfdist import registry

        return registry.get_strategy(value)
    strategy = value()
    if not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(f"The strategy callable in RunConfig returned {type(strategy).__name__}, "
                        "not a tf.distribute.Strategy.")
    return strategy

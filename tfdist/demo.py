"""`tfdist demo`: the same model trained under every registered strategy, then a table."""

from __future__ import annotations

from typing import Optional


def _build_model(keras, seed: int):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="digits_mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def demo_strategies() -> list[tuple[str, dict]]:
    """(name, kwargs) of every registered strategy that runs on the embedded default."""
    from tfdist import registry

    entries = []
    for name in registry.strategy_names():
        cls = registry.strategy_class(name)
        kwargs = getattr(cls, "demo_kwargs", lambda: {})()
        if kwargs is not None:
            entries.append((name, kwargs))
    return entries


def run_demo(
    epochs: int = 3, batch_size: int = 64, verbose: int = 1, only: Optional[list[str]] = None
) -> list[dict]:
    """Trains one model per strategy on the bundled digits; returns the table rows.

    Args:
        epochs: int. Epochs per strategy.
        batch_size: int. Global batch size.
        verbose: int. Keras verbosity (1 shows progress bars).
        only: Optional list of strategy names to run; default all.

    Returns:
        A list of dicts with keys strategy, replicas, loss, accuracy,
        samples_per_s (measured over the epochs after the first, which
        includes tracing).
    """
    import keras
    import numpy as np

    from tfdist import datasets, registry
    from tfdist.timing import EpochTimer

    x, y = datasets.load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    split = int(len(x) * 0.8)
    train, test = (x[:split], y[:split]), (x[split:], y[split:])
    rows = []
    runs = [("single device", None, None)] if not only else []
    runs += [(name, name, kwargs) for name, kwargs in demo_strategies() if not only or name in only]
    for label, name, kwargs in runs:
        if name is None:
            import tensorflow as tf

            strategy = tf.distribute.get_strategy()
            print(f"\n== {label}: the baseline, no strategy")
        else:
            strategy = registry.get_strategy(name, **kwargs)
            print(f"\n== {name}: {strategy!r}")
        with strategy.scope():
            model = _build_model(keras, seed=0)
        timer = EpochTimer()
        model.fit(
            *train,
            batch_size=batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=[timer],
            shuffle=False,
        )
        loss, accuracy = model.evaluate(*test, batch_size=batch_size, verbose=0)
        rows.append(
            {
                "strategy": label,
                "replicas": strategy.num_replicas_in_sync,
                "loss": float(loss),
                "accuracy": float(accuracy),
                "samples_per_s": timer.samples_per_second(len(train[0])),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    header = f"{'strategy':<18} {'replicas':>8} {'test loss':>10} {'accuracy':>9} {'samples/s':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['strategy']:<18} {r['replicas']:>8} {r['loss']:>10.4f} "
            f"{r['accuracy']:>9.4f} {r['samples_per_s']:>10.0f}"
        )
    return "\n".join(lines)

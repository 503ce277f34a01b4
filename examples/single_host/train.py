"""Single-host data-parallel training with Keras 3 and tfdist on the bundled digits.

The same ordinary Keras script under any single-host strategy, picked by name
or preset file:

    python examples/single_host/train.py --strategy mirrored --devices 2
    python examples/single_host/train.py --strategy central_storage --devices 4
    python examples/single_host/train.py --preset strategies/zero2.toml --devices 4

`--devices N` splits the host CPU into N logical devices (on a GPU host, leave
it out: every GPU is a replica). Step options go on the command line too:
`--option bucket_bytes=0 --option precision=mixed_bfloat16`.
"""

from __future__ import annotations

import argparse
import ast
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_option(text: str) -> tuple[str, object]:
    name, _, raw = text.partition("=")
    if not name or not _:
        raise argparse.ArgumentTypeError(f"--option takes NAME=VALUE. Received: {text!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word such as mixed_bfloat16
    return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--strategy", default="mirrored", help="strategy name (default mirrored)")
    group.add_argument("--preset", help="TOML preset file instead of a name")
    parser.add_argument("--devices", type=int, default=None, help="logical CPU devices to split the host into")
    parser.add_argument("--option", action="append", type=parse_option, default=[], help="NAME=VALUE step option")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--save", default=None, help="write the trained model to this .keras file")
    parser.add_argument("--seed", type=int, default=0, help="random seed (weights, shuffling)")
    args = parser.parse_args()

    import tfdist

    if args.devices:
        tfdist.configure_local_devices(args.devices)
    import keras
    import numpy as np

    if args.preset:
        strategy = tfdist.from_config(args.preset)
    else:
        strategy = tfdist.get_strategy(args.strategy, **dict(args.option))
    print(f"Training under {strategy!r}")

    x, y = tfdist.datasets.load_digits()
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))

    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(
        x[:split], y[:split], batch_size=args.batch_size, epochs=args.epochs,
        validation_data=(x[split:], y[split:]),
    )
    loss, accuracy = model.evaluate(x[split:], y[split:], batch_size=args.batch_size, verbose=0)
    print(f"test loss {loss:.4f}, test accuracy {accuracy:.4f}")
    if args.save:
        model.save(args.save)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()

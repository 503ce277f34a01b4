"""Host-to-device input staging: `TransferManager`."""

from __future__ import annotations

import tensorflow as tf


class TransferManager:
    """Stages input batches onto each replica's device ahead of compute.

    While a step runs, the next `prefetch_depth` batches are already being
    copied to every replica's device, so the step never waits for a
    host-to-device copy (with the default depth of 2, double buffering: one
    batch in use, one arriving). The copies are TensorFlow's own: the
    per-replica prefetch buffers of a distributed iterator
    (`tf.distribute.InputOptions(experimental_fetch_to_device=True,
    experimental_per_replica_buffer_size=prefetch_depth)`, which drive the
    device's StreamExecutor transfer manager on accelerators) and, for one
    device outside a strategy, `tf.data.experimental.prefetch_to_device`.

    Every tfdist strategy uses one by default when a dataset is distributed
    (including the datasets `model.fit` distributes), configured by the step
    options `transfer` and `prefetch_depth`; `transfer=False` turns it off.
    Options passed explicitly to `experimental_distribute_dataset` win.

    Args:
        prefetch_depth: int >= 1. Batches kept staged on each replica's
            device. Default 2.
        enabled: bool. `False` leaves batches on the host until a step needs
            them (no device-side buffer). Default `True`.

    Example:

    ```python
    strategy = tfdist.get_strategy("mirrored", prefetch_depth=3)   # or transfer=False
    dist = strategy.experimental_distribute_dataset(dataset)       # staged 3 deep

    manager = tfdist.data.TransferManager(prefetch_depth=2)
    for batch in manager.stage(dataset, "/gpu:0"):                 # one device, no strategy
        ...
    ```
    """

    def __init__(self, prefetch_depth: int = 2, enabled: bool = True):
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ValueError(
                "Argument 'prefetch_depth' must be an integer >= 1 (batches staged ahead on "
                f"each replica's device). Received: prefetch_depth={prefetch_depth!r}"
            )
        if not isinstance(enabled, bool):
            raise ValueError(f"Argument 'enabled' must be True or False. Received: enabled={enabled!r}")
        self.prefetch_depth = prefetch_depth
        self.enabled = enabled

    @classmethod
    def from_options(cls, options) -> TransferManager:
        """The manager a strategy's step options (`transfer`, `prefetch_depth`) describe."""
        return cls(prefetch_depth=options.prefetch_depth, enabled=options.transfer)

    def input_options(
        self, options: tf.distribute.InputOptions | None = None
    ) -> tf.distribute.InputOptions:
        """The `tf.distribute.InputOptions` to distribute a dataset with.

        Args:
            options: Optional options the caller passed; returned unchanged
                (the caller's choice wins).
        """
        if options is not None:
            return options
        if not self.enabled:
            return tf.distribute.InputOptions(
                experimental_fetch_to_device=False, experimental_per_replica_buffer_size=0
            )
        return tf.distribute.InputOptions(
            experimental_fetch_to_device=True,
            experimental_per_replica_buffer_size=self.prefetch_depth,
        )

    def stage(self, dataset: tf.data.Dataset, device: str) -> tf.data.Dataset:
        """Returns `dataset` with its batches staged on `device` (one device, no strategy).

        Must be the last transformation of the pipeline (a requirement of
        `prefetch_to_device`). With the manager off, `dataset` is returned as is.
        """
        if not self.enabled:
            return dataset
        return dataset.apply(
            tf.data.experimental.prefetch_to_device(device, buffer_size=self.prefetch_depth)
        )

    def __repr__(self) -> str:
        return f"TransferManager(prefetch_depth={self.prefetch_depth}, enabled={self.enabled})"

"""Input for tfdist strategies: host-to-device staging, dataset functions, length buckets.

* `TransferManager` stages batches onto each replica's device ahead of compute
  (used by default by every tfdist strategy; step options `transfer`,
  `prefetch_depth`).
* `DatasetFn` is a dataset function taking a `tf.distribute.InputContext`,
  for strategies that build input per worker.
* `bucket_by_length` batches variable-length examples into length buckets
  with one static shape each.

Data sinking (k steps per host call, step option `sink_size`) is the host
loop in `tfdist.engine.loop`; `tfdist.data.sinking` hands it a call's batches
as one window per replica, staged on the replica's device while the previous
call runs, where one input pipeline in this process feeds every replica.
"""

from __future__ import annotations

from tfdist.data.bucketing import bucket_by_length, min_padding_boundaries, quantile_boundaries
from tfdist.data.dataset_fn import DatasetFn
from tfdist.data.transfer import TransferManager

__all__ = [
    "DatasetFn",
    "TransferManager",
    "bucket_by_length",
    "min_padding_boundaries",
    "quantile_boundaries",
]

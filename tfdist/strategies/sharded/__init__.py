"""The sharded-optimizer strategy (ZeRO stages 1, 2 and 3), one module per part.

* `strategy`: the strategies (`ShardedOptimizerStrategy`, its multi-worker
  variant), their options and what they refuse;
* `optimizer`: the user's optimizer as a same-named subclass, and which
  optimizers may update a slice of a variable (`updates_elementwise`);
* `state`, `slices`, `owned`: the sharded state — flat slices for element-wise
  optimizers, whole variables on an owning replica for any other;
* `checkpoint`: the single-device layout checkpoints hold;
* `step`: the gradient paths of stages 1 and 2; `stage3`: stage 3's.
"""

from tfdist.strategies.sharded.optimizer import ELEMENTWISE, sharded_state, updates_elementwise
from tfdist.strategies.sharded.owned import OwnedState, balanced_owners
from tfdist.strategies.sharded.slices import LAYOUT_BUCKET_BYTES, SlicedState, write_in_place
from tfdist.strategies.sharded.state import ShardedState
from tfdist.strategies.sharded.strategy import (
    SHARD_BUCKET_BYTES,
    STAGE,
    MultiWorkerShardedOptimizerStrategy,
    ShardedOptimizerStrategy,
)

__all__ = [
    "ELEMENTWISE",
    "LAYOUT_BUCKET_BYTES",
    "MultiWorkerShardedOptimizerStrategy",
    "OwnedState",
    "SHARD_BUCKET_BYTES",
    "STAGE",
    "ShardedOptimizerStrategy",
    "ShardedState",
    "SlicedState",
    "balanced_owners",
    "sharded_state",
    "updates_elementwise",
    "write_in_place",
]

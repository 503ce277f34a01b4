"""The sharded-optimizer strategy's public names, where they were first published.

The strategy lives in the package `tfdist.strategies.sharded` (one module per
part); scripts and presets that import it from here keep working.

Example:

```python
from tfdist.strategies.sharded_optimizer import ShardedOptimizerStrategy

strategy = ShardedOptimizerStrategy(stage=2)
```
"""

from tfdist.strategies.sharded import (  # noqa: F401 (re-exported)
    ELEMENTWISE,
    LAYOUT_BUCKET_BYTES,
    SHARD_BUCKET_BYTES,
    STAGE,
    MultiWorkerShardedOptimizerStrategy,
    ShardedOptimizerStrategy,
    ShardedState,
    sharded_state,
    updates_elementwise,
    write_in_place,
)
from tfdist.strategies.sharded.strategy import _runs_across_workers  # noqa: F401 (tests)

__all__ = [
    "ELEMENTWISE",
    "LAYOUT_BUCKET_BYTES",
    "MultiWorkerShardedOptimizerStrategy",
    "SHARD_BUCKET_BYTES",
    "STAGE",
    "ShardedOptimizerStrategy",
    "ShardedState",
    "sharded_state",
    "updates_elementwise",
    "write_in_place",
]

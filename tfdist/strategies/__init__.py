"""tfdist's strategies, one module each; `tfdist.get_strategy` finds them by name."""

from tfdist.strategies.base import TfdistStrategy, is_tfdist_strategy
from tfdist.strategies.central_storage import CentralStorageStrategy
from tfdist.strategies.mirrored import MirroredStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.parameter_server import ParameterServerStrategy
from tfdist.strategies.sharded import ShardedOptimizerStrategy

__all__ = [
    "CentralStorageStrategy",
    "MirroredStrategy",
    "ShardedOptimizerStrategy",
    "ParameterServerStrategy",
    "MultiWorkerMirroredStrategy",
    "TfdistStrategy",
    "is_tfdist_strategy",
]

from parallel.dist import DistInfo, get_rank, get_world_size, init_distributed, setup_logging
from parallel.ema import ShardedEMA
from parallel.flat import FlatLayout, ParamSlot, Range, build_layouts
from parallel.scaler import DynamicLossScaler
from parallel.zero import Zero2Optimizer

__all__ = [
    "Zero2Optimizer",
    "ShardedEMA",
    "DynamicLossScaler",
    "FlatLayout",
    "ParamSlot",
    "Range",
    "build_layouts",
    "DistInfo",
    "init_distributed",
    "setup_logging",
    "get_rank",
    "get_world_size",
]

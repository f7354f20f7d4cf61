from shardface.parallel.dist import DistInfo, get_rank, get_world_size, init_distributed, setup_logging
from shardface.parallel.ema import ShardedEMA
from shardface.parallel.flat import FlatLayout, ParamSlot, Range, build_layouts
from shardface.parallel.scaler import DynamicLossScaler
from shardface.parallel.zero import Zero2Optimizer

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

from shardface.heads.optimizer import SampledRowsOptimizer
from shardface.heads.partial_fc import PartialFC, SampledRows
from shardface.heads.sharded_ce import HeadPlan
from shardface.heads.sharding import class_shard

__all__ = ["PartialFC", "SampledRows", "SampledRowsOptimizer", "HeadPlan", "class_shard"]

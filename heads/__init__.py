from heads.optimizer import SampledRowsOptimizer
from heads.partial_fc import PartialFC, SampledRows
from heads.sharded_ce import HeadPlan
from heads.sharding import class_shard

__all__ = ["PartialFC", "SampledRows", "SampledRowsOptimizer", "HeadPlan", "class_shard"]

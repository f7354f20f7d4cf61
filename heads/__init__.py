from heads.optimizer import SampledRowsOptimizer
from heads.partial_fc import PartialFC
from heads.sharding import ClassShard, all_class_shards, class_shard

__all__ = ["PartialFC", "SampledRowsOptimizer", "ClassShard", "class_shard", "all_class_shards"]

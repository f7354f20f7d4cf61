"""The class-sharded margin-softmax head. The names below load on first use."""

from shardface.lazy import lazy_exports

_PUBLIC = {
    "PartialFC": "shardface.heads.partial_fc",
    "SampledRows": "shardface.heads.partial_fc",
    "SampledRowsOptimizer": "shardface.heads.optimizer",
    "HeadPlan": "shardface.heads.sharded_ce",
    "class_shard": "shardface.heads.sharding",
}
__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)

"""Every default of a ShardFace run (configs/schema.py defines each key once: its default, type,
range and help). Job configs override these; `--key value` overrides both."""

from easydict import EasyDict as edict

from shardface.configs.schema import defaults

config = edict(defaults())

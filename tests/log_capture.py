"""What code logs through the "shardface" logger, for tests that assert on its lines."""

from __future__ import annotations

import logging


def shardface_messages(call) -> list[str]:
    """What `call()` logs through the "shardface" logger, message by message (any level)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("shardface")
    level = logger.level
    logger.setLevel(logging.DEBUG)  # info lines too, whether or not a run set the logger up before
    logger.addHandler(handler)
    try:
        call()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [r.getMessage() for r in records]

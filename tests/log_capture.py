"""What code logs through the "shardface" logger, for tests that assert on its lines."""
from __future__ import annotations

import logging


def shardface_messages(call) -> list[str]:
    """What `call()` logs through the "shardface" logger, message by message (any level)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("shardface")
    logger.addHandler(handler)
    try:
        call()
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records]

"""The event loop tahnode's processes run on: uvloop where it is installed (faster sockets and
timers), else asyncio's own."""

from __future__ import annotations

import asyncio

__all__ = ["use_fast_event_loop"]


def use_fast_event_loop() -> None:
    """Make asyncio.run use uvloop's loop, if uvloop is available on this platform."""
    try:
        import uvloop
    except ImportError:  # not on every platform; asyncio's loop works too
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

"""SIGTERM and SIGHUP as Ctrl-C for the commands that start a swarm of their own (the demo, the benches of
swarms): `kill`, `timeout` or a closed terminal unwinds them, so that their `finally` takes the swarm down."""

from __future__ import annotations

import functools
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["STOP_SIGNALS", "stops_as_interrupt", "interruptible"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextmanager
def stops_as_interrupt() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does (the main thread only: elsewhere
    Python takes no signal handler, and nothing changes); the handlers before are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _raise_interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def interruptible(name: str) -> Callable:
    """A command's main, run within stops_as_interrupt: stopped by any of the three, it says so and
    returns 130 (128 + SIGINT, as a shell reports Ctrl-C) once its `finally` blocks ran."""
    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                with stops_as_interrupt():
                    return main(*args, **kwargs)
            except KeyboardInterrupt:
                print(f"{name}: interrupted; what it started is stopped", file=sys.stderr)
                return 130
        return run
    return wrap

"""The benches' helper processes: spawned (a bench has gRPC and torch threads, so never forked), and
ended with the bench that started them however it ends (Ctrl-C, SIGTERM, kill -9), never left training."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.managers import SyncManager
from typing import Callable

__all__ = ["die_with_parent", "worker_manager", "worker_pool"]

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM when `parent` (the process that started it) ends;
    if it has ended already, end now. Linux only; elsewhere nothing (the orphan finishes its work)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def _start_worker(parent: int, then: Callable[[], object] | None) -> None:
    die_with_parent(parent)
    if then is not None:
        then()


def worker_pool(workers: int, initializer: Callable[[], object] | None = None) -> ProcessPoolExecutor:
    """`workers` spawned processes that run `initializer` (a module-level function) first."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(os.getpid(), initializer))


def worker_manager() -> SyncManager:
    """A started manager (queues the workers report through), spawned like the workers."""
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(_start_worker, (os.getpid(), None))
    return manager

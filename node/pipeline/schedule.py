"""The schedule of a step: how many micro-batches the pipeline cuts it into (`Split`, chosen per
step by stage 0's `SplitTuner`), which received envelope a stage handles next (`InboxOrder`), and
how many micro-batches stage 0 keeps in flight (`Window`).

Why the cut matters: a synchronous step leaves every link idle while its first micro-batch fills
the pipeline and its last one drains it, about 2S-3 micro-batch times for S stages (a stage
forwards a micro-batch only once all of it arrived), so the busiest link is busy at best
M / (M + 2S - 3) of a step of M micro-batches. But every micro-batch also costs a fixed overhead
on every stage, which only shows where compute is the limit. No rule fits both, so stage 0
measures: it starts from the cut that keeps equal slow links >= 90% busy, tries the next coarser
and finer cuts one step each, keeps the fastest, and tries its neighbours again now and then. The
step's samples and its mean loss are the same whatever the cut (losses weighted by micro-batch
size), so training is the same.

Why a growing window: stage 0 sees a micro-batch's gradient only after 2(S-1) link hops, so it
needs about 2S-1 in flight, more when the links are slow or far. The window starts there (the least
that keeps the pipeline moving, whatever the budget) and grows whenever stage 0 waits for it while
its own forward link has nothing to send (the window, not the link, held it back); it grows no
further than the step's micro-batches, nor than `memory_budget_mb` holds of their saved
activations (measured on the first micro-batch)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..net.transport import BACKWARD, FORWARD, MAX_IN_FLIGHT, ByteBudget, Direction, Inbound

log = logging.getLogger("tahnode.pipeline")

__all__ = ["Split", "SplitTuner", "Window", "SavedBytes", "InboxOrder", "TARGET_BUSY"]

TARGET_BUSY = 0.9  # the first cut keeps equal links at least this busy (where the samples allow)


@dataclass(frozen=True)
class Split:
    """A step cut into `micro_batches` micro-batches of `batch_size` samples each."""

    micro_batches: int
    batch_size: int

    @staticmethod
    def counts(train: TrainConfig) -> list[int]:
        """The cuts a step may take: never coarser than the user's `micro_batches`, never with
        micro-batches under `min_micro_batch_tokens` tokens, always equal micro-batches."""
        samples = train.micro_batches * train.batch_size
        if train.pipeline_micro_batches:  # validated to divide the samples
            return [train.pipeline_micro_batches]
        smallest = max(1, -(-train.min_micro_batch_tokens // train.seq_len))
        return ([m for m in range(train.micro_batches, samples // smallest + 1) if samples % m == 0]
                or [train.micro_batches])

    @classmethod
    def of(cls, train: TrainConfig, stages: int) -> "Split":
        """The first cut of a step: the coarsest that keeps equal links >= TARGET_BUSY busy
        (M / (M + 2S - 3)), or the finest allowed if none does."""
        counts = cls.counts(train)
        wanted = TARGET_BUSY * max(0, 2 * stages - 3) / (1 - TARGET_BUSY)
        count = next((m for m in counts if m >= wanted - 1e-9), counts[-1])
        return cls.with_count(train, count)

    @classmethod
    def with_count(cls, train: TrainConfig, count: int) -> "Split":
        return cls(count, train.micro_batches * train.batch_size // count)

    @property
    def samples(self) -> int:
        return self.micro_batches * self.batch_size


class SplitTuner:
    """Stage 0's choice of each step's cut, by measurement: after one warm-up step it times the
    first cut, then the next coarser one and, unless that was faster by `threshold`, the next
    finer one; it moves while that pays and settles on the fastest. Every `revisit` steps it tries
    the neighbours of the settled cut again (the links or the load may have changed)."""

    def __init__(self, counts: list[int], first: int, threshold: float = 0.03, revisit: int = 50):
        self.counts, self.threshold, self.revisit = counts, threshold, revisit
        self.best = self.current = counts.index(first)
        self.best_seconds: float | None = None
        self.tried: set[int] = set()
        self.warm = False
        self.settled_for = 0

    @property
    def count(self) -> int:
        return self.counts[self.current]

    def record(self, seconds: float) -> None:
        """The wall time of a step cut into `self.count` micro-batches (replayed steps are not told)."""
        if not self.warm:
            self.warm = True
            return
        if self.current == self.best and self.best_seconds is None:
            self.best_seconds = seconds
        elif self.current != self.best:
            if seconds < self.best_seconds * (1 - self.threshold):
                step = self.current - self.best
                self.best, self.best_seconds = self.current, seconds
                self.tried = {self.best - step}  # keep going the same way
            self.tried.add(self.current)
        else:  # settled: a step on the best cut, or the first after a revisit
            self.best_seconds = min(self.best_seconds, seconds) if self.settled_for else seconds
            self.settled_for += 1
            if self.settled_for >= self.revisit:
                self.settled_for, self.tried = 0, set()
        self.current = self._next()

    def _next(self) -> int:
        for neighbour in (self.best - 1, self.best + 1):  # coarser first: less overhead
            if 0 <= neighbour < len(self.counts) and neighbour not in self.tried:
                return neighbour
        return self.best


class InboxOrder:
    """Which received envelope a stage handles next: gradients before activations (1F1B's rule: a
    gradient's backward pass frees its saved activations and feeds the backward links, which drain
    last at the end of a step), each direction in the order it arrived. It takes from the inbox
    only what it may hold (the inbox's own bound), so a flooding peer still meets backpressure; an
    envelope's bytes go back to the transport's `budget` when the stage takes it up. `prefer`:
    the direction taken first (stage 0 of a ring prefers the final hidden states coming forward:
    its head starts every micro-batch's backward pass)."""

    def __init__(self, inbox: asyncio.Queue, budget: ByteBudget | None = None, prefer: Direction = BACKWARD):
        self.inbox, self.budget = inbox, budget
        self.order = (prefer, FORWARD if prefer is BACKWARD else BACKWARD)
        self.limit = max(1, inbox.maxsize)
        self.waiting = {FORWARD: deque(), BACKWARD: deque()}

    def _take_ready(self) -> None:
        while len(self.waiting[FORWARD]) + len(self.waiting[BACKWARD]) < self.limit and not self.inbox.empty():
            item = self.inbox.get_nowait()
            self.waiting[item.direction].append(item)

    async def next(self) -> Inbound:
        self._take_ready()
        if not (self.waiting[FORWARD] or self.waiting[BACKWARD]):
            item = await self.inbox.get()
            self.waiting[item.direction].append(item)
            self._take_ready()
        item = (self.waiting[self.order[0]] or self.waiting[self.order[1]]).popleft()
        if self.budget is not None:
            self.budget.release(item.nbytes)
        return item


class Window:
    """At most `size` micro-batches in flight: `admit()` waits for a free place, `release()`
    frees one when a micro-batch's backward is done; `grow()` adds a place."""

    def __init__(self, size: int, limit: int):
        self.size, self.limit = size, min(limit, MAX_IN_FLIGHT)
        self.slots = asyncio.Semaphore(size)

    @classmethod
    def initial(cls, stages: int, split: Split, schedule: str) -> "Window":
        """1F1B starts at 2S-1 and grows; GPipe keeps the whole step in flight."""
        if schedule == "gpipe":
            return cls(min(split.micro_batches, MAX_IN_FLIGHT), split.micro_batches)
        return cls(min(split.micro_batches, 2 * stages - 1), split.micro_batches)

    def cap(self, limit: int) -> None:
        """Never grow beyond `limit` places (e.g. what the memory budget holds)."""
        self.limit = max(self.size, min(self.limit, limit))

    def grow(self) -> bool:
        if self.size >= self.limit:
            return False
        self.size += 1
        self.slots.release()
        return True

    @property
    def full(self) -> bool:
        return self.slots.locked()

    async def admit(self, abort: asyncio.Event) -> bool:
        """Wait for a free place; False if `abort` is set first."""
        if abort.is_set():
            return False
        acquire = asyncio.ensure_future(self.slots.acquire())
        aborted = asyncio.ensure_future(abort.wait())
        done, _ = await asyncio.wait({acquire, aborted}, return_when=asyncio.FIRST_COMPLETED)
        aborted.cancel()
        if acquire not in done:
            acquire.cancel()
            return False
        return True

    def release(self) -> None:
        self.slots.release()


class SavedBytes:
    """Counts the bytes autograd saves for the backward pass inside the `with` block (activations;
    the module's parameters, saved by reference, are not counted)."""

    def __init__(self, module: torch.nn.Module):
        self.params = {p.data_ptr() for p in module.parameters()}
        self.bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in self.params:
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> "SavedBytes":
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

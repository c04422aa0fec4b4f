"""The replicas of a stage (one per pipeline) averaging their pseudo-gradients each outer step through
hivemind's DecentralizedAverager (checked and counted in averaging_parts): `StageAverager`, and its tallies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from .p2p_host import STARTUP_TIMEOUT_S, require_hivemind

log = logging.getLogger("tahnode.averaging")

__all__ = ["AveragingRound", "StageAverager", "AveragingError", "UnsupportedBits", "BadVector", "NoStateTemplate",
           "AveragerNotRunning", "BITS"]

BITS = (4, 8, 16, 32)        # 4/8: tahnode.codecs.blockwise; 16: float16; 32: float32 as is
MIN_MATCHMAKING_S = 0.5      # the least time a replica looks for its group
REQUEST_TIMEOUT_S = 0.3      # how long a would-be leader may take to answer (below MIN_MATCHMAKING_S: hivemind)
# a sender silent this long between two parts (of at most 512 KiB: 0.4 s at 10 Mbit/s) is dropped, a
# reducer after twice this: a replica that dies in an all-reduce costs the others 15 s at most, within
# the outer step's deadline (swarm.outer_timeout_s, 30 s); with 20 s it cost them 70 s
CHUNK_TIMEOUT_S = 5.0
GRACE_S = 1.5                # after the deadline, the time the leader's "begin" message may take to arrive
ALLREDUCE_TIMEOUT_S = 600.0  # the most an all-reduce may take once its group formed
CONTROL_TIMEOUT_S = 30.0     # the most the averager's process may take to answer a control message
STATE_KEY = "tahnode"        # served metadata is wrapped: hivemind takes an empty dict for "no state"

State = Callable[[], "tuple[dict, list[torch.Tensor]]"]


class AveragingError(ValueError):
    """A StageAverager used wrongly."""


class UnsupportedBits(AveragingError):
    """Pseudo-gradients travel at 4, 8, 16 or 32 bits."""


class BadVector(AveragingError):
    """The vector to average is not flat float32 of the averager's size, or not finite."""


class NoStateTemplate(AveragingError):
    """load_state needs the replica's own `state` to check a peer's against."""


class AveragerNotRunning(AveragingError):
    """The averager's process was not started (StageAverager.start), or did not come up."""


@dataclass
class AveragingRound:
    """What one outer step's averaging came to, for this replica."""

    mean: torch.Tensor | None  # this replica's view of the group's mean (flat float32); None: no group formed
    group: int                 # replicas averaged with, this one included (0 when mean is None)
    refused: dict[str, int] = field(default_factory=dict)  # peer id -> its parts (or averages) this replica refused
    bytes_sent: int = 0        # serialized bytes this replica sent in the all-reduce (parts and returned deltas)
    bytes_received: int = 0
    seconds: float = 0.0       # wall time of the call


class StageAverager:
    """This replica's side of its stage's averaging. One group per round: only replicas at the same round
    meet (the round is the group key); a group forms as soon as the expected replicas are in, else at the
    deadline with those that came (two at least). Parts travel blockwise-quantized (4/8 bits), float16 or
    raw, and what comes back is checked as group_mean.butterfly_mean checks it. hivemind is imported only
    when one is made; `average` and `load_state` never block the event loop (its blocking calls run in
    threads)."""

    averager_class = None  # hivemind's averager kind; None: averaging_parts.CheckedAverager (tests swap in liars)

    def __init__(self, dht, prefix: str, size: int, bits: int, norm_ratio: float, state: State | None = None):
        if bits not in BITS:
            raise UnsupportedBits(f"pseudo-gradients travel at {', '.join(map(str, BITS))} bits, not {bits}")
        if "." in prefix:
            raise AveragingError(f"an averaging prefix has no '.': {prefix!r}")
        require_hivemind()
        from . import averaging_parts as parts

        # hivemind shares tensors through files and torch's shm manager ("file_system"), whose manager
        # process did not answer in time on a loaded machine (a node's averager failed to start so); the
        # averaged vector is shared with hivemind's process by fork, and what comes back by descriptor
        torch.multiprocessing.set_sharing_strategy("file_descriptor")

        self.prefix, self.size, self._state, self._started = prefix, size, state, False
        kind = self.averager_class or parts.CheckedAverager
        self._averager = kind(torch.zeros(size, dtype=torch.float32), dht, prefix=prefix,
                              compression=parts.compression_for(bits), ratio=norm_ratio, state=state)

    @property
    def peer_id(self) -> str:
        return str(self._averager.peer_id)

    def start(self) -> None:
        """Start hivemind's averager process (from the main thread: hivemind sets a signal handler)."""
        self._averager.run_in_background(await_ready=False)
        self._started = True

    async def _ready(self) -> None:
        if not self._started or not self._averager.is_alive():
            raise AveragerNotRunning(f"the averager of {self.prefix} was not started, or its process ended")
        try:
            await asyncio.to_thread(self._averager.wait_until_ready, STARTUP_TIMEOUT_S)
        except Exception as exc:  # hivemind passes on whatever stopped its process (or a TimeoutError)
            raise AveragerNotRunning(f"the averager of {self.prefix} did not start: {exc!r}") from None

    async def average(self, vector: torch.Tensor, round: int, expected: int, timeout: float) -> AveragingRound:
        """Average `vector` with the replicas at round `round` of this prefix: at once when `expected`
        replicas (this one included) are in, else after `timeout` s with those that came (two at least)."""
        started = time.monotonic()
        vector = vector.detach().reshape(-1)
        if vector.dtype != torch.float32 or vector.numel() != self.size or not bool(torch.isfinite(vector).all()):
            raise BadVector(f"{self.prefix}: a finite float32 vector of {self.size} values is averaged, "
                            f"not {vector.dtype} x {vector.numel()}")
        await self._ready()
        if expected < 2:
            return AveragingRound(None, 0, seconds=time.monotonic() - started)
        group = await asyncio.to_thread(self._averager.run_round, vector.cpu(), format(round % 256, "08b"),
                                        expected, timeout)
        refused, sent, received, partial = await asyncio.to_thread(self._averager.ask, "_take_ledger")
        mean = None
        if group is not None and partial:  # its values of some parts are its own: not the group's mean
            log.warning("averaging %s round %d: a part's average never came back; the round counts as missed",
                        self.prefix, round)
            group = None
        if group is not None:
            mean = await asyncio.to_thread(self._result)
        if refused:
            log.info("averaging %s round %d: refused %s", self.prefix, round,
                     ", ".join(f"{count} from {peer}" for peer, count in sorted(refused.items())))
        return AveragingRound(mean, len(group) if group is not None else 0, refused, sent, received,
                              time.monotonic() - started)

    def _result(self) -> torch.Tensor:
        with self._averager.get_tensors() as (tensor,):
            return tensor.clone()

    async def load_state(self, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """A peer's state (metadata, tensors), if one answered within `timeout` s with tensors of the
        count and shapes of this replica's own `state()`, all finite; else None."""
        if self._state is None:
            raise NoStateTemplate(f"the averager of {self.prefix} has no state to check a peer's against")
        await self._ready()
        loaded = await asyncio.to_thread(self._averager.fetch_state, timeout)
        if loaded is None:
            return None
        checked = checked_state(loaded, self._state()[1])
        if checked is None:
            log.info("averaging %s: refused a peer's state (not a dict, other tensors, or not finite)", self.prefix)
        return checked

    def set_members(self, peer_ids: list[str]) -> None:
        """Allow only these peers in this prefix's groups (empty: anyone); takes effect in the averager's
        process, before any later round."""
        self._averager.tell("_set_members", list(peer_ids))

    def set_target(self, expected: int) -> None:
        """The group a round (under way, or later) waits for: `expected` replicas, two at least (the
        coordinator's count of pipelines changed: a round begun before would form without the new one)."""
        self._averager.tell("_set_target", max(2, expected))

    def shutdown(self) -> None:
        if self._averager.is_alive():
            self._averager.shutdown()


def checked_state(loaded: tuple, template: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]] | None:
    """`loaded` (metadata, tensors) if its metadata is a dict and its tensors match `template` in count
    and shapes, every value finite; else None."""
    metadata, tensors = loaded
    if not isinstance(metadata, dict) or len(tensors) != len(template):
        return None
    for tensor, own in zip(tensors, template):
        if not torch.is_tensor(tensor) or tensor.shape != own.shape:
            return None
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return None
    return metadata, [tensor.clone() for tensor in tensors]


def usable(part: torch.Tensor | None, shape) -> torch.Tensor | None:
    """`part` as float32 if it is a floating tensor of `shape` with every value finite, else None."""
    if not torch.is_tensor(part) or tuple(part.shape) != tuple(shape) or not part.is_floating_point():
        return None
    part = part.detach().to(torch.float32)
    return part if bool(torch.isfinite(part).all()) else None


class Ledger:
    """What the averager's process tallies until the parent takes it after a round: parts refused per
    peer, the serialized bytes it sent and received; and the peers allowed in its groups (none: all)."""

    def __init__(self):
        self.members: frozenset[str] = frozenset()
        self.refused: Counter = Counter()
        self.sent = self.received = 0
        self.partial = False  # a part's average never came back in the last round

    def admits(self, peer) -> bool:
        return not self.members or str(peer) in self.members

    def refuse(self, peer) -> None:
        self.refused[str(peer)] += 1

    def mark_partial(self) -> None:
        self.partial = True

    def take(self) -> tuple[dict[str, int], int, int, bool]:
        tally = (dict(self.refused), self.sent, self.received, self.partial)
        self.refused, self.sent, self.received, self.partial = Counter(), 0, 0, False
        return tally

    async def counting_received(self, stream: AsyncIterator) -> AsyncIterator:
        async for message in stream:
            self.received += message.ByteSize()
            yield message

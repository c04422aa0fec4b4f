"""The replicas of a stage (one per pipeline) averaging their pseudo-gradients each outer step through
hivemind's DecentralizedAverager (checked and counted in averaging_parts, by the clip rule of
tahnode.train.clip_rule), members only, and a state fetched from one named member: `StageAverager`. Its
process starts clean (tahnode.net.clean_start), and a new one takes the place of one that ended (`restart`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..train.clip_rule import SenderView
from .averaging_rules import allreduce_timeout_s
from .p2p.host import STARTUP_TIMEOUT_S, require_hivemind

log = logging.getLogger("tahnode.averaging")

__all__ = ["AveragingRound", "StageAverager", "AveragingError", "UnsupportedBits", "BadVector", "NoStateTemplate",
           "AveragerNotRunning", "AveragerNotAnswering", "BITS"]

BITS = (2, 4, 8, 16, 32)     # 2/4/8: tahnode.codecs.blockwise; 16: float16; 32: float32 as is

State = Callable[[], "tuple[dict, list[torch.Tensor]]"]


class AveragingError(ValueError):
    """A StageAverager used wrongly."""


class UnsupportedBits(AveragingError):
    """Pseudo-gradients travel at 4, 8, 16 or 32 bits."""


class BadVector(AveragingError):
    """The vector to average is not flat float32 of the averager's size, or not finite."""


class NoStateTemplate(AveragingError):
    """load_state needs the replica's own `state` to check a peer's against."""


STATE_SLACK_BYTES = 1 << 20  # what a served state may carry beyond its tensors' own bytes (framing, metadata)


class AveragerNotRunning(AveragingError):
    """The averager's process was not started (StageAverager.start), or did not come up."""


class AveragerNotAnswering(AveragingError):
    """The averager's process did not answer a control message in time, or its pipe broke: it ended
    (a crash in its own process), or the machine is too loaded for it to answer."""


@dataclass
class AveragingRound:
    """What one outer step's averaging came to, for this replica."""

    mean: torch.Tensor | None  # this replica's view of the group's mean (flat float32); None: no group formed
    group: int                 # replicas averaged with, this one included (0 when mean is None)
    refused: dict[str, int] = field(default_factory=dict)  # peer id -> its parts (or averages) this replica refused
    bytes_sent: int = 0        # serialized bytes this replica sent in the all-reduce (parts and returned deltas)
    bytes_received: int = 0
    seconds: float = 0.0       # wall time of the call
    dropped: int = 0           # replicas of the group that some part of the mean lacks: dropped as silent senders
    counted: torch.Tensor | None = None  # with error feedback: what the mean counted of its vector (GroupMean's)
    views: dict[str, SenderView] = field(default_factory=dict)  # peer id -> what this replica saw of its parts
    stalled: set[str] = field(default_factory=set)  # reducers whose averages never came back in time
    silent: set[str] = field(default_factory=set)   # senders whose parts never came in time
    peers: list[str] = field(default_factory=list)  # the group, when one formed


class StageAverager:
    """This replica's side of its stage's averaging. One group per round: only replicas at the same round
    meet (the round is the group key); a group forms as soon as the expected replicas are in, else at the
    deadline with those that came (two at least). Parts travel blockwise-quantized (2/4/8 bits), float16 or
    raw, and what comes back is checked as group_mean.butterfly_mean checks it (the clip rule: `clip`). Only
    the members named with set_members join its groups or download its state. hivemind is imported only
    when one is made; `average` and `load_state` never block the event loop (its blocking calls run in
    threads)."""

    averager_class = None  # hivemind's averager kind; None: averaging_parts.CheckedAverager (tests swap in liars)

    def __init__(self, dht, prefix: str, size: int, bits: int, clip: float, state: State | None = None,
                 feedback: bool = False):
        if bits not in BITS:
            raise UnsupportedBits(f"pseudo-gradients travel at {', '.join(map(str, BITS))} bits, not {bits}")
        if "." in prefix:
            raise AveragingError(f"an averaging prefix has no '.': {prefix!r}")
        require_hivemind()
        from . import averaging_parts as parts  # its process starts clean (tahnode.net.clean_start)

        self.prefix, self.size, self._state, self._started = prefix, size, state, False
        self._told: dict[str, tuple] = {}  # each setting it last told its process (told a new one again)
        self.restarts = 0  # processes that took the place of an ended one
        kind = self.averager_class or parts.CheckedAverager
        self._made = lambda replaces: kind(  # a new averager's process (of a new vector, shared with it)
            torch.zeros(size, dtype=torch.float32), dht, prefix=prefix, compression=parts.compression_for(bits),
            bits=bits, clip=clip, state=state, allreduce_timeout=allreduce_timeout_s(size, bits), feedback=feedback,
            replaces=replaces)
        self._averager = self._made("")

    @property
    def peer_id(self) -> str:
        return str(self._averager.peer_id)

    def start(self) -> None:
        """Start hivemind's averager process: a child of multiprocessing's forkserver, never of this process
        (clean_start). Blocking: the first start in a process waits for the forkserver to import torch and
        hivemind (seconds); any thread may call it."""
        self._averager.start()
        self._started = True

    @property
    def ended(self) -> bool:
        """Its process was started and has ended (a crash, a kill): `restart` starts a new one."""
        return self._started and not self._averager.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._averager.exitcode

    def restart(self) -> None:
        """(Blocking.) A new process in place of the ended one: the same prefix and peer id (this process's p2p
        daemon), the ended one's handlers removed from that daemon, told each setting the ended one was told last
        (members, suspended, target); the next round (or state download) goes to it, and the members reach it as
        before."""
        ended, new = self._averager, self._made(self._averager.handlers_at)
        try:
            new.start()
        except BaseException:
            new.release()
            raise
        self._averager = new
        ended.release()
        self.restarts += 1
        for method, args in list(self._told.items()):
            self._tell(method, *args)

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
        averager = self._averager  # the round's process, whichever a restart puts in its place meanwhile
        group = await self._in_averager(averager.run_round, vector.cpu(), format(round % 256, "08b"), expected,
                                        timeout)
        tally = await self._in_averager(averager.ask, "_take_ledger")
        mean = None
        if group is not None and tally.partial:  # its values of some parts are its own: not the group's mean
            log.warning("averaging %s round %d: a part's average never came back; the round counts as missed",
                        self.prefix, round)
            group = None
        counted = None
        if group is not None:
            mean, counted = await self._in_averager(self._result, averager)
        if tally.refused:
            log.info("averaging %s round %d: refused %s", self.prefix, round,
                     ", ".join(f"{count} from {peer}" for peer, count in sorted(tally.refused.items())))
        # a reducer's word: never more than the others of the group
        dropped = min(tally.dropped, len(group) - 1) if mean is not None else 0
        if dropped:
            log.warning("averaging %s round %d: a part of the mean lacks %d of the group's %d replicas (silent "
                        "senders, dropped)", self.prefix, round, dropped, len(group))
        return AveragingRound(mean, len(group) if group is not None else 0, tally.refused, tally.sent, tally.received,
                              time.monotonic() - started, dropped, counted, tally.views, tally.stalled, tally.silent,
                              list(group or tally.group))

    async def _in_averager(self, call: Callable, *args):
        """`call(*args)` (a message to the averager's process and its answer) in a thread; a process
        that does not answer is this replica's averaging failing, never the daemon's end."""
        try:
            return await asyncio.to_thread(call, *args)
        except (OSError, EOFError) as exc:  # TimeoutError (no answer in CONTROL_TIMEOUT_S) and BrokenPipeError
            raise AveragerNotAnswering(f"the averager of {self.prefix} did not answer: {exc!r}") from None

    @staticmethod
    def _result(averager) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mean, and with error feedback what it counted of this replica's vector."""
        counted = getattr(averager, "counted", None)
        with averager.get_tensors() as (tensor,):
            return tensor.clone(), (counted.clone() if counted is not None else None)

    async def load_state(self, peer_id: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """The state (metadata, tensors) member `peer_id` serves, if it answered within `timeout` s with
        tensors of the count and shapes of this replica's own `state()`, all finite, in no more bytes than
        those take; else None. (Whether they are the state the coordinator names is the caller's check.)"""
        if self._state is None:
            raise NoStateTemplate(f"the averager of {self.prefix} has no state to check a peer's against")
        await self._ready()
        template = self._state()[1]
        most = sum(t.numel() * 4 for t in template) + STATE_SLACK_BYTES
        loaded = await self._in_averager(self._averager.fetch_state, peer_id, timeout, most)
        if loaded is None:
            return None
        checked = checked_state(loaded, template)
        if checked is None:
            log.info("averaging %s: refused %s's state (not a dict, other tensors, or not finite)", self.prefix,
                     peer_id)
        return checked

    def set_members(self, peer_ids: list[str]) -> None:
        """Allow only these peers in this prefix's groups and state downloads (none until named); takes
        effect in the averager's process, before any later round."""
        self._tell("_set_members", list(peer_ids))

    def set_suspended(self, peer_ids: list[str]) -> None:
        """Members that sit out the rounds from now on (they stalled one) but may still serve or load a state."""
        self._tell("_set_suspended", list(peer_ids))

    def set_target(self, expected: int) -> None:
        """The group a round (under way, or later) waits for: `expected` replicas, two at least (the
        coordinator's count of pipelines changed: a round begun before would form without the new one)."""
        self._tell("_set_target", max(2, expected))

    def end_round(self) -> bool:
        """End the round under way if it still looks for a group (no other replica is coming: the coordinator counts
        one pipeline now, the others lost a stage): its `average` returns without a mean at once. False if none was
        looking."""
        return self._started and self._averager.end_search()

    def _tell(self, method: str, *args) -> None:
        self._told[method] = args
        try:
            self._averager.tell(method, *args)
        except OSError as exc:  # its process ended: the next round finds it not running
            log.warning("averaging %s: its averager's process did not take %s: %r", self.prefix, method, exc)

    def shutdown(self) -> None:
        if self._averager.is_alive():
            self._averager.shutdown()
        else:
            self._averager.release()


def checked_state(loaded: tuple, template: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]] | None:
    """`loaded` (metadata, tensors) if its metadata is a dict and its tensors match `template` in count
    and shapes, every value finite; else None."""
    metadata, tensors = loaded
    if not isinstance(metadata, dict) or len(tensors) != len(template):
        return None
    for tensor, own in zip(tensors, template):
        if not torch.is_tensor(tensor) or tensor.shape != own.shape:
            return None
        if tensor.dtype != own.dtype or not bool(torch.isfinite(tensor).all()):
            return None
    return metadata, [tensor.clone() for tensor in tensors]

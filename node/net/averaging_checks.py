"""The parts of hivemind's butterfly all-reduce that tahnode checks, in the averager's own process: the
reducer that averages a part by the clip rule (tahnode.train.clip_rule: centred on its own part, every
sender counting 1, what it saw of each sender kept as evidence), and the container that takes a
reducer's average only where the rule allows and, with error feedback, keeps what the group's mean
counted of this replica's vector."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer

from ..train.clip_rule import SenderView, centred_clip, takes
from .averaging_rules import usable

__all__ = ["PartMean", "CheckedReducer", "CheckedContainer"]


@dataclass
class PartMean:
    """A reducer's result for one part."""

    mean: torch.Tensor | None  # the clipped average of the usable parts (None: its own part missing)
    dropped: int               # senders it left out as silent
    senders: int = 0           # usable parts in the average, its own included
    own_in: bool = False       # this replica's own part among them


class CheckedReducer(TensorPartReducer):
    """hivemind's reducer, but it keeps every sender's part k (None: wrong shape or not finite) and
    averages part k once all are in by the clip rule, centred on its own part (`own`: its sender index),
    each sender counting 1 whatever weight it claims. `observe(k, view)` receives what it saw of
    sender k's part (tahnode.train.clip_rule.SenderView); `silent(k)` each sender a part lacks."""

    def __init__(self, part_shapes, num_senders: int, *, own: int, clip: float,
                 observe: Callable[[int, SenderView], None], silent: Callable[[int], None]):
        self.own, self.clip, self.observe, self.silent, self.parts = own, clip, observe, silent, {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        self.parts, self.accumulator = {}, None  # parts are kept, not summed

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part, weight: float = 1.0
                              ) -> PartMean:
        """Part `part_index`'s average, once every sender's part is in or its sender dropped; `weight` is
        what the sender claims, and is ignored."""
        assert 0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        future = self.current_part_future
        self.parts[sender_index] = usable(tensor_part, self.part_shapes[part_index])
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            self.current_part_future.set_result(self._mean())
            self.reset_accumulators()

    def _mean(self) -> PartMean:
        senders = sorted(self.parts)
        for k in set(range(self.num_senders)) - set(senders):
            self.silent(k)
        dropped = self.num_senders - len(senders)
        if self.own not in senders or self.parts[self.own] is None:  # no part of its own to trust: no average
            return PartMean(None, dropped)
        result = centred_clip([self.parts[s] for s in senders], senders.index(self.own), self.clip)
        for sender, view in zip(senders, result.views):
            if view is not None:
                self.observe(sender, view)
        usable_count = sum(self.parts[s] is not None for s in senders)
        return PartMean(result.mean, dropped, usable_count, True)


class CheckedContainer(TensorPartContainer):
    """hivemind's part container, but what comes back for a part is its group's average (the same bytes
    for every replica, so that they stay equal to the bit: it is taken as it is, never added as a
    difference), and an average that the clip rule does not let this replica take (not finite, of another
    shape, or too far from its own part: clip_rule.takes) is refused: the part stays as it was.

    With `counted` (error feedback) it also keeps what the group's mean counted of this replica's vector
    (group_mean.GroupMean.counted): a part as its reducer decoded it, or for the part it reduced its own
    values less the mean's rounding times the senders; a part whose mean it did not take, its own values.
    (A part its reducer clipped counts as sent: the residual then misses what the clip took off.)"""

    def __init__(self, tensors, *args, group: int, bits: int, clip: float, refuse, on_partial,
                 counted: torch.Tensor | None = None, **kwargs):
        self.group, self.bits, self.clip = group, bits, clip
        self.refuse, self.on_partial, self.counted = refuse, on_partial, counted
        super().__init__(tensors, *args, **kwargs)
        self.base = tensors[0].detach().view(-1)
        if counted is not None:
            counted.copy_(self.base)

    def _counted_slot(self, peer_index: int, part_index: int) -> torch.Tensor:
        """The slice of `counted` where part `part_index` of the parts reduced by `peer_index` lies (the
        parts are views of the replica's flat vector)."""
        own = self._input_parts_by_peer[peer_index][part_index][0]
        start = own.storage_offset() - self.base.storage_offset()
        return self.counted[start:start + own.numel()]

    def count(self, peer_index: int, part_index: int, value: torch.Tensor) -> None:
        """What the mean will count of this part if its reducer's average is taken."""
        if self.counted is not None:
            self._counted_slot(peer_index, part_index).copy_(value.reshape(-1))

    def _uncount(self, peer_index: int, part_index: int) -> None:
        if self.counted is not None:
            self._counted_slot(peer_index, part_index).copy_(self._input_parts_by_peer[peer_index][part_index][0])

    def register_failed_reducer(self, peer_index: int):
        """As hivemind's (this replica's own values for the parts that reducer never averaged), and
        told (`on_partial`, with the reducer): the round's result is not the group's, and the replicas
        would drift apart."""
        self.on_partial(peer_index)
        for part_index in range(self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]):
            own = self._input_parts_by_peer[peer_index][part_index][0]
            self._uncount(peer_index, part_index)
            TensorPartContainer.register_processed_part(self, peer_index, part_index, own.clone())
            self.failed_size += own.numel()

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        own = self._input_parts_by_peer[peer_index][part_index][0]
        mean = usable(part, own.shape)
        if not takes(own, mean, self.group, self.bits, self.clip):
            self.refuse(peer_index)
            self._uncount(peer_index, part_index)
            mean = own.clone()
        super().register_processed_part(peer_index, part_index, mean)

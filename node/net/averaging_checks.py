"""The parts of hivemind's butterfly all-reduce that tahnode checks, in the averager's own process: the
reducer that averages only the parts group_mean.admitted() lets in (each sender counting 1), and the
container that refuses an average failing group_mean.accepted() and, with error feedback, keeps what
the group's mean counted of this replica's vector."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer

from ..train.group_mean import accepted, admitted
from .averaging_rules import usable

__all__ = ["PartMean", "CheckedReducer", "CheckedContainer"]


@dataclass
class PartMean:
    """A reducer's result for one part."""

    mean: torch.Tensor | None  # the average of the admitted parts (None: none admitted)
    dropped: int               # senders it left out as silent
    senders: int = 0           # parts in the average
    own_in: bool = False       # this replica's own part among them


class CheckedReducer(TensorPartReducer):
    """hivemind's reducer, but it keeps every sender's part k (None: wrong shape or not finite) and
    averages part k once all are in, over those admitted() lets in, each counting 1 (PartMean)."""

    def __init__(self, part_shapes, num_senders: int, *, own: int, ratio: float, refuse):
        self.own, self.ratio, self.refuse, self.parts = own, ratio, refuse, {}
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
        dropped = self.num_senders - len(senders)
        parts = [self.parts[s] for s in senders]
        norms = [float(p.double().norm()) if p is not None else float("nan") for p in parts]
        ok = admitted(norms, self.ratio)
        for sender, keep in zip(senders, ok):
            if not keep and sender != self.own:  # its own part left out is no peer's offence
                self.refuse(sender)
        kept = [p for p, keep in zip(parts, ok) if keep and p is not None]
        own_in = any(keep and sender == self.own for sender, keep in zip(senders, ok))
        return PartMean(torch.stack(kept).mean(dim=0) if kept else None, dropped, len(kept), own_in)


class CheckedContainer(TensorPartContainer):
    """hivemind's part container, but what comes back for a part is its group's average (the same bytes
    for every replica, so that they stay equal), and an average that is non-finite, of another shape,
    or too large (accepted()) is refused: the part stays as it was.

    With `counted` (error feedback) it also keeps what the group's mean counted of this replica's vector
    (group_mean.GroupMean.counted): a part as its reducer decoded it, or for the part it reduced its own
    values less the mean's rounding times the senders; a part whose mean it did not take, its own values."""

    def __init__(self, tensors, *args, ratio: float, refuse, on_partial, counted: torch.Tensor | None = None,
                 **kwargs):
        self.ratio, self.refuse, self.on_partial, self.counted = ratio, refuse, on_partial, counted
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
        told (`on_partial`): the round's result is not the group's, and the replicas would drift apart."""
        self.on_partial()
        for part_index in range(self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]):
            own = self._input_parts_by_peer[peer_index][part_index][0]
            self._uncount(peer_index, part_index)
            TensorPartContainer.register_processed_part(self, peer_index, part_index, torch.zeros_like(own))
            self.failed_size += own.numel()

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        own = self._input_parts_by_peer[peer_index][part_index][0]
        mean = usable(part, own.shape)
        if mean is None or not accepted(own, mean, self.ratio):
            self.refuse(peer_index)
            self._uncount(peer_index, part_index)
            mean = own
        super().register_processed_part(peer_index, part_index, mean - own)

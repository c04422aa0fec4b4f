"""hivemind's DecentralizedAverager as tahnode runs it (tahnode.net.averaging): pseudo-gradients travel
blockwise-quantized, the reducer and the part container are the checked ones (tahnode.net.averaging_checks:
the clip rule, every sender counting 1, refused averages, what the mean counted for error feedback), only
members join a group, download a state or are asked for one, and what each peer did is tallied per round.

Everything here but the parent-side calls (run_round, fetch_state, get_current_state, ask, tell) runs in the
averager's own process, started clean (tahnode.net.clean_start)."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from typing import AsyncIterator

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, BannedException
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, amap_in_executor, as_aiter, azip, enter_asynchronously
from hivemind.utils.timed_storage import get_dht_time

from ..train.group_mean import reducer_counted
from .averaging_checks import CheckedContainer, CheckedReducer
from .averaging_rules import (CHUNK_TIMEOUT_S, CONTROL_TIMEOUT_S, GRACE_S, MIN_MATCHMAKING_S,
                              REQUEST_TIMEOUT_S, STATE_KEY, Ledger)
from .averaging_codec import compression_for, decoded  # noqa: F401  (compression_for: StageAverager's)
from .clean_start import CleanAverager, ProcessEnded
from .averaging_state import fetch_state, serve_state

log = logging.getLogger("tahnode.averaging")


class _CountingStub:
    """A peer's averager stub whose answers (the averages of this replica's parts) are counted; `outside()` when
    the peer answers that it is in no such group."""

    def __init__(self, stub, ledger: Ledger, outside):
        self.stub, self.ledger, self.outside = stub, ledger, outside

    async def rpc_aggregate_part(self, requests: AsyncIterator) -> AsyncIterator:
        return self._watched(self.ledger.counting_averages(await self.stub.rpc_aggregate_part(requests)))

    async def _watched(self, answers: AsyncIterator) -> AsyncIterator:
        async for message in answers:
            if message.code == averaging_pb2.BAD_GROUP_ID:
                self.outside()
            yield message


class CheckedRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce with the checked container and reducer, members only, bytes counted."""

    def __init__(self, *, ledger: Ledger, clip: float, bits: int, tensors, peer_fractions, compression,
                 part_size_bytes: int, tensor_infos=None, counted: torch.Tensor | None = None, **kwargs):
        container = dict(compression=compression, part_size_bytes=part_size_bytes, tensor_infos=tensor_infos)
        super().__init__(tensors=tensors, peer_fractions=peer_fractions, **container, **kwargs)
        self.ledger = ledger
        ledger.tally.group = [str(peer) for peer in self.ordered_peer_ids]
        # hivemind built its own container and reducer above: the checked kinds take their place (the
        # discarded reducer is marked finished, so that it does not warn of the parts it never got). Averages
        # come back as they are (no differences): the replicas take the same bytes and stay equal to the bit
        self.tensor_part_reducer.finished.set()
        self.tensor_part_container = CheckedContainer(
            tensors, peer_fractions, return_deltas=False, group=len(self.ordered_peer_ids), bits=bits, clip=clip,
            refuse=lambda k: self._refuse(self.ordered_peer_ids[k]),
            on_partial=lambda k: ledger.mark_partial(self.ordered_peer_ids[k]), counted=counted, **container)
        index = self.ordered_peer_ids.index(self.peer_id)
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(index)
        own = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else -1
        self.tensor_part_reducer = CheckedReducer(
            tuple(p.shape for p in self.parts_for_local_averaging), len(self.sender_peer_ids), own=own, clip=clip,
            observe=lambda k, view: ledger.observe(self.sender_peer_ids[k], view),
            silent=lambda k: ledger.mark_silent(self.sender_peer_ids[k]))
        reduces = self.tensor_part_container.num_parts_by_peer[index] > 0
        self.streams_left = len(self.sender_peer_ids) - (own >= 0) if reduces else 0
        self.served = asyncio.Event()  # every other sender's stream to this reducer ended
        if self.streams_left <= 0:
            self.served.set()
        self.means: dict[int, runtime_pb2.Tensor] = {}  # part index -> its average as every replica receives it

    def _refuse(self, peer) -> None:
        if peer != self.peer_id:
            self.ledger.refuse(peer)

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self.ledger, lambda: self._outside(peer))

    def _outside(self, peer) -> None:
        """`peer` is in no such group (it gave up on the leader before the leader began: see
        CheckedAverager.rpc_aggregate_part): its parts will not come either, and are not waited for."""
        if peer in self.sender_peer_ids:
            asyncio.ensure_future(self._ban_sender(peer))

    async def _communicate_with_peer(self, peer_id):
        """As hivemind's, but the parts this replica reduces itself come back as the others get them:
        the average, through the codec."""
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        for part_index, part in enumerate(self.parts_for_local_averaging):
            result = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight=self.weight)
            self.ledger.mark_dropped(result.dropped)
            coded = decoded(self._mean_message(part_index, result.mean)) if result.mean is not None else None
            if coded is not None and result.own_in:
                self.tensor_part_container.count(peer_index, part_index, reducer_counted(
                    part, result.mean, coded.reshape(part.shape), result.senders))
            self.tensor_part_container.register_processed_part(peer_index, part_index, coded)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        container, part_index = self.tensor_part_container, 0
        async for message in super()._generate_input_for_peer(peer_index):
            self.ledger.tally.sent += message.ByteSize()
            if container.counted is not None and message.HasField("tensor_part"):  # as its reducer decodes it
                sent = await asyncio.get_running_loop().run_in_executor(None, decoded, message.tensor_part)
                if sent is not None:
                    container.count(peer_index, part_index, sent)
                part_index += 1
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not self.ledger.groups_with(context.remote_id):
            self._refuse(context.remote_id)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        try:
            async for message in super().rpc_aggregate_part(self.ledger.counting_received(stream), context):
                yield message
        finally:
            if context.remote_id in self.sender_peer_ids:
                self.streams_left -= 1
                if self.streams_left <= 0:
                    self.served.set()

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        """A sender's parts, each answered with the average in this replica's codec (encoded once: the
        same bytes for every sender) and, as its `weight`, how many of the group's replicas the average
        left out; without an average (its own part missing), an error (the sender keeps its own part)."""
        loop, part_index = asyncio.get_running_loop(), 0
        prefetch = self.tensor_part_container.prefetch
        try:
            async for part in amap_in_executor(lambda msg: decoded(msg.tensor_part), stream, max_prefetch=prefetch):
                try:
                    result = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part)
                except BannedException:
                    break
                mean, dropped = result.mean, result.dropped
                if mean is None:
                    yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
                    break
                serialized = await loop.run_in_executor(None, self._mean_message, part_index, mean)
                part_index += 1
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized,
                                                      weight=dropped)
                self.ledger.mark_dropped(dropped)
                self.ledger.tally.sent += message.ByteSize()
                yield message
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _mean_message(self, part_index: int, mean: torch.Tensor) -> runtime_pb2.Tensor:
        """Part `part_index`'s average in this replica's codec, made once (usable parts are finite, and so
        is their clipped average)."""
        if part_index not in self.means:
            self.means[part_index] = self.tensor_part_container.compression.compress(
                mean, CompressionInfo.from_tensor(mean))
        return self.means[part_index]


class MemberMatchmaking(Matchmaking):
    """hivemind's matchmaking, but a replica never follows a leader that is not a member."""

    def __init__(self, *args, ledger: Ledger, **kwargs):
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    async def _request_join_group(self, leader):
        if not self.ledger.groups_with(leader):
            self.ledger.refuse(leader)
            return None
        return await super()._request_join_group(leader)


class CheckedAverager(CleanAverager, DecentralizedAverager):
    """The averager of one flat float32 tensor, with the checks above; `runner_class` runs its all-reduce. Its
    process starts clean (clean_start.CleanAverager): `replaces`, where an ended one had its handlers."""

    runner_class = CheckedRunner
    # what its process never uses: the replica's state, the control pipe's lock, the parent's round under way
    parent_only = ("state", "control_lock", "round")

    def __init__(self, tensor: torch.Tensor, dht, *, prefix: str, compression: CompressionBase, bits: int,
                 clip: float, state, allreduce_timeout: float, feedback: bool = False, replaces: str = ""):
        # state is served to members who ask (serve_state), never declared in the DHT for anyone to download
        super().__init__([tensor], dht, start=False, prefix=prefix, target_group_size=2, min_group_size=2,
                         min_matchmaking_time=MIN_MATCHMAKING_S, request_timeout=REQUEST_TIMEOUT_S,
                         compression=compression, next_chunk_timeout=CHUNK_TIMEOUT_S, sender_timeout=CHUNK_TIMEOUT_S,
                         reducer_timeout=2 * CHUNK_TIMEOUT_S, allreduce_timeout=allreduce_timeout,
                         allow_state_sharing=False)
        self.ledger, self.bits, self.clip, self.state = Ledger(), bits, clip, state
        self.allreduce_timeout = allreduce_timeout
        # with error feedback: what the last round's mean counted of this replica's vector (shared with the
        # averager's process, as the averaged tensor is)
        self.counted = torch.zeros_like(tensor).share_memory_() if feedback else None
        self.control_lock = threading.Lock()  # the parent's threads share the control pipe
        self.round: StepControl | None = None  # (parent) the round under way
        self._start_cleanly(replaces)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names the protocol after the class: every kind of this averager speaks the same one
        name = f"{CheckedAverager.__name__}.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    # --- in the parent process -------------------------------------------------------------------

    def ask(self, method: str, **kwargs):
        """Run `method` in the averager's process and return what it sets its future to."""
        future = MPFuture()
        self.tell(method, **kwargs, future=future)
        return self.answer(future, CONTROL_TIMEOUT_S)

    def tell(self, method: str, *args, **kwargs) -> None:
        with self.control_lock:
            self._outer_pipe.send((method, list(args), kwargs))

    def run_round(self, vector: torch.Tensor, group_bits: str, target: int, timeout: float) -> list[str] | None:
        """(Blocking.) Average `vector` with the group of key `group_bits`; the group's peer ids, or None."""
        with self.get_tensors() as (tensor,):
            tensor.copy_(vector)
        self.ask("_begin_round", group_bits=group_bits, target=target)
        with self.control_lock:
            control = self.round = self.step(scheduled_time=get_dht_time() + timeout, timeout=timeout + GRACE_S,
                                             allow_retries=False, wait=False)
        try:
            return self.answer(control, timeout + GRACE_S + self.allreduce_timeout)
        except ProcessEnded:
            raise
        except Exception as exc:  # no group, or one that failed: hivemind raises several kinds; none is fatal here
            log.info("averaging %s (key %s) formed no group: %r", self.prefix, group_bits, exc)
            return None
        finally:
            self.round = None

    def end_search(self) -> bool:
        """(Parent, any thread.) End the round under way while it still looks for a group: run_round returns no
        group at once rather than at its deadline. One whose group formed runs on (its members count on it)."""
        control = self.round
        if control is None or control.done() or control.stage is not AveragingStage.LOOKING_FOR_GROUP:
            return False
        return control.cancel()

    def fetch_state(self, peer_id: str, timeout: float, max_bytes: int) -> tuple[object, list[torch.Tensor]] | None:
        """(Blocking.) The state member `peer_id` serves (averaging_state.fetch_state), metadata unwrapped;
        None if it did not answer in time, or sent too much or what does not parse."""
        future = MPFuture()
        self.tell("_fetch_state", peer_id=peer_id, timeout=timeout, max_bytes=max_bytes, future=future)
        try:
            return self.answer(future, timeout + CONTROL_TIMEOUT_S)
        except TimeoutError:
            return None

    def get_current_state(self):
        """(Parent, a background thread.) What this replica serves to a newcomer."""
        metadata, tensors = self.state()
        return {STATE_KEY: metadata}, tensors, None

    # --- in the averager's process ---------------------------------------------------------------

    @property
    def _matchmaking(self) -> Matchmaking:
        return self._member_matchmaking

    @_matchmaking.setter
    def _matchmaking(self, made: Matchmaking) -> None:
        # hivemind's _run builds a plain Matchmaking; one that follows members only, built from the same
        # arguments, takes its place (neither has started a task or a connection yet)
        self._member_matchmaking = MemberMatchmaking(self._p2p, self.schema_hash, self.dht, ledger=self.ledger,
                                                     client_mode=self.client_mode, **self.matchmaking_kwargs)

    async def _begin_round(self, group_bits: str, target: int, future: MPFuture) -> None:
        self._matchmaking.group_key_manager.group_bits = group_bits
        await self._set_target(target)
        future.set_result(None)

    async def _set_target(self, target: int) -> None:
        # read by hivemind's leader at each join: a round under way waits for a group of the new size
        self._matchmaking.target_group_size = self._matchmaking.group_key_manager.target_group_size = target

    async def _fetch_state(self, peer_id: str, timeout: float, max_bytes: int, future: MPFuture) -> None:
        future.set_result(await fetch_state(self, peer_id, timeout, max_bytes))

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in serve_state(self, context):
            yield message

    async def _take_ledger(self, future: MPFuture) -> None:
        future.set_result(self.ledger.take())

    async def _set_members(self, peer_ids: list[str]) -> None:
        self.ledger.members = frozenset(peer_ids)

    async def _set_suspended(self, peer_ids: list[str]) -> None:
        self.ledger.suspended = frozenset(peer_ids)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self.ledger.groups_with(context.remote_id):
            self.ledger.refuse(context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, but a part for a group this replica is not in is answered BAD_GROUP_ID after GRACE_S (the
        time a leader's "begin" may take to arrive), not once its own matchmaking ends. A follower that gave up on
        a leader slower than REQUEST_TIMEOUT_S looks for a group again while that leader, which accepted it, began
        their all-reduce: the leader waited for its parts and averages 15 s (the sender and reducer timeouts), its
        stage's round missed; seen in `tahnode bench chaos` while a restarted daemon loaded the CPU."""
        first = await anext(stream)
        until = asyncio.get_running_loop().time() + GRACE_S
        while first.group_id not in self._running_groups and asyncio.get_running_loop().time() < until:
            await asyncio.sleep(0.05)
        if first.group_id not in self._running_groups:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(first), stream), context):
            yield message

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> list[str]:
        """Run the all-reduce in `group_info`: every replica reduces an equal share (one claiming client
        mode none), whatever bandwidth it claims; returns the group's peer ids."""
        outsiders = [peer for peer in group_info.peer_ids if not self.ledger.groups_with(peer)]
        for peer in outsiders:
            self.ledger.refuse(peer)
        modes = tuple(self._claimed_mode(data) for data in group_info.gathered)
        fractions = tuple(0.0 if mode == AveragingMode.CLIENT else 1.0 for mode in modes)
        if outsiders or not any(fractions):
            raise AllreduceException(f"{self.prefix}: a group of {len(outsiders)} non-members or no reducer")
        tensor = self._averaged_tensors[0]
        per_value = tensor.element_size() * kwargs["compression"].estimate_compression_ratio(
            CompressionInfo.from_tensor(tensor))
        values = max(1, min(math.ceil(self.total_size / sum(fractions)), int(DEFAULT_PART_SIZE_BYTES / per_value)))
        kwargs["part_size_bytes"] = values * per_value  # hivemind's default puts a small vector on one reducer
        async with enter_asynchronously(self.get_tensors()) as local_tensors:
            await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=fractions, modes=modes,
                                               **kwargs)
        return [str(peer) for peer in group_info.peer_ids]

    def _claimed_mode(self, gathered: bytes) -> AveragingMode:
        try:
            _, mode, _ = self.serializer.loads(gathered)
        except Exception:  # a peer's own bytes: msgpack fails in many ways
            return AveragingMode.NODE
        return AveragingMode.CLIENT if mode == AveragingMode.CLIENT.value else AveragingMode.NODE

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id: bytes | None = None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = self.runner_class(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                   group_id=group_id, ordered_peer_ids=group_info.peer_ids, ledger=self.ledger,
                                   clip=self.clip, bits=self.bits, counted=self.counted, **kwargs)
        self._running_groups[group_id].set_result(runner)
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)  # the group's bytes as they are (never own + (mean - own): other bits)
        self._state_updated.set()
        try:  # the averages this replica sends back are counted in this round's bytes
            await asyncio.wait_for(runner.served.wait(), self.next_chunk_timeout)  # CHUNK_TIMEOUT_S when made
        except asyncio.TimeoutError:
            pass

"""A replica's outer state between the averagers of a stage, in the averager's own process: served to
members only, and fetched from one named peer at a time with every byte bounded (never from whoever
declared itself in the DHT: the parent names the peer, and checks what came against the digest the
coordinator names, tahnode.pipeline.outer_sync)."""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator

import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from .averaging_rules import STATE_KEY

__all__ = ["serve_state", "fetch_state", "StateTooLarge"]


class StateTooLarge(ValueError):
    """A peer's state stream is larger than the replica's own state (and its slack) allows."""


async def serve_state(averager, context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
    """The replica's state as hivemind streams it (metadata with the first part), to a member only; a
    stranger (or a replica with no state to serve) gets an empty stream."""
    if averager.state is None:
        return
    if not averager.ledger.admits(context.remote_id):
        averager.ledger.refuse(context.remote_id)
        return
    metadata, tensors, infos = await averager._get_current_state_from_host_process()
    infos = infos or [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
    for tensor, info in zip(tensors, infos):
        for part in split_for_streaming(averager.state_compression.compress(tensor, info, allow_inplace=False)):
            if metadata is not None:
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                metadata = None
            else:
                yield averaging_pb2.DownloadData(tensor_part=part)


async def _read(stream, timeout: float, max_bytes: int) -> tuple[bytes, list[list[runtime_pb2.Tensor]]]:
    """The metadata and the chunks of each tensor of a download stream; StateTooLarge past max_bytes."""
    metadata, tensors, total = b"", [], 0
    iterator = stream.__aiter__()
    while True:
        try:
            message = await asyncio.wait_for(iterator.__anext__(), timeout)
        except StopAsyncIteration:
            return metadata, tensors
        total += message.ByteSize()
        if total > max_bytes:
            raise StateTooLarge(f"a state stream of over {max_bytes} bytes")
        if message.metadata:
            metadata = message.metadata
        if message.tensor_part.dtype or not tensors:  # a dtype starts the next tensor
            tensors.append([])
        tensors[-1].append(message.tensor_part)


def _tensor(chunks: list[runtime_pb2.Tensor], max_values: int) -> torch.Tensor:
    serialized = combine_from_streaming(chunks)
    if math.prod(serialized.size) > max_values or any(dim < 0 for dim in serialized.size):
        raise StateTooLarge(f"a state tensor of shape {tuple(serialized.size)}")
    return deserialize_torch_tensor(serialized).detach().clone()


async def fetch_state(averager, peer_id: str, timeout: float, max_bytes: int) -> tuple[object, list] | None:
    """(metadata unwrapped, tensors) as `peer_id` serves them, or None if it is not a member, did not
    answer in `timeout` s (between two messages), sent more than `max_bytes`, or sent what does not parse."""
    if not averager.ledger.admits(peer_id):
        return None
    try:
        stub = averager.get_stub(averager._p2p, PeerID.from_base58(peer_id), namespace=averager.prefix)
        stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
        raw_metadata, parts = await _read(stream, timeout, max_bytes)
        metadata = averager.serializer.loads(raw_metadata) if raw_metadata else None
        tensors = [_tensor(chunks, max_bytes // 4) for chunks in parts]
    except Exception:  # a peer's bytes and a network's failures: each layer fails its own way
        return None
    if not isinstance(metadata, dict) or STATE_KEY not in metadata:
        return None
    return metadata[STATE_KEY], tensors

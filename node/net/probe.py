"""Link measurement over the data plane: throughput and RTT from this node to another (`measure`),
and the coordinator's requests that a node measure its link to a peer (`request_measure`) or its
own compute (`request_compute`)."""

from __future__ import annotations

import os
import time


from ..config.emulation import LinkEmulation
from ..proto import tahnode_pb2 as pb
from ..proto import tahnode_pb2_grpc as pb_grpc
from .auth import Sealer
from .emulation import pacer_for
from .grpc_transport import CHANNEL_OPTIONS
from .channels import ChannelPool, open_channel

__all__ = ["probe", "measure_link", "request_measure", "request_compute"]


async def probe(sealer: Sealer, address: str, peer: str, payload_bytes: int, chunk: int = 256 << 10,
                emulation: LinkEmulation = LinkEmulation(), pinned: bytes = b"") -> tuple[float, float]:
    """Measure the link to node `peer` at `address` (over TLS pinning `pinned`, if given):
    (throughput Mbit/s over payload_bytes, median RTT ms). Every ping and chunk is sealed for `peer`."""
    async with open_channel(address, pinned, CHANNEL_OPTIONS, emulation) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        rtts = []
        for _ in range(5):
            start = time.perf_counter()
            await stub.Ping(sealer.seal(pb.PingRequest(nonce=os.urandom(8)), peer), timeout=10)
            rtts.append((time.perf_counter() - start) * 1e3)
        data = os.urandom(chunk)
        pacer = pacer_for(emulation, peer)

        async def chunks():
            sent, queued = 0, time.monotonic()  # one stream: its delay counts once, its rate for every chunk
            while sent < payload_bytes:
                await pacer.wait(len(data), queued)
                yield sealer.seal(pb.ProbeChunk(data=data), peer)
                sent += len(data)

        start = time.perf_counter()
        reply = await stub.Probe(chunks(), timeout=120)
        elapsed = time.perf_counter() - start
        return reply.bytes * 8 / max(elapsed, 1e-9) / 1e6, sorted(rtts)[len(rtts) // 2]


async def measure_link(sealer: Sealer, target: str, peer: str, nbytes: int, emulation: LinkEmulation = LinkEmulation(),
                       pinned: bytes = b"") -> tuple[float, float]:
    """Throughput (Mbit/s) and RTT (ms) from here to `target` (node `peer`, TLS pinning `pinned`): a
    short probe sizes the real one to last about a second (1-64 MiB), so token-bucket bursts do not
    inflate the figure."""
    if nbytes:
        return await probe(sealer, target, peer, nbytes, emulation=emulation, pinned=pinned)
    rough, _ = await probe(sealer, target, peer, 512 << 10, emulation=emulation, pinned=pinned)
    size = int(min(64 << 20, max(1 << 20, rough * 1e6 / 8 * 1.0)))
    return await probe(sealer, target, peer, size, emulation=emulation, pinned=pinned)


async def request_measure(sealer: Sealer, node: pb.Peer, target: pb.Peer, pool: ChannelPool, payload_bytes: int = 0,
                          timeout: float = 60.0) -> tuple[float, float]:
    """Ask `node` (over a channel of `pool`, pinning its TLS certificate where it has one) to
    measure its link to `target` over its own data plane, with `payload_bytes` (0: its own
    sizing), within `timeout` s."""
    req = sealer.seal(pb.MeasureRequest(target_id=target.node_id, target_address=target.address,
                                        target_cert=target.tls_cert, payload_bytes=payload_bytes), node.node_id)
    reply = await pb_grpc.StageServiceStub(pool.get(node.address, node.tls_cert)).Measure(req, timeout=timeout)
    return reply.mbps, reply.rtt_ms


async def request_compute(sealer: Sealer, node: pb.Peer, pool: ChannelPool, timeout: float = 20.0) -> float:
    """Ask `node` to measure its compute again, as it did when it joined: one layer's forward and
    backward on one micro-batch, in ms (0: it measures none)."""
    req = sealer.seal(pb.MeasureRequest(compute=True), node.node_id)
    reply = await pb_grpc.StageServiceStub(pool.get(node.address, node.tls_cert)).Measure(req, timeout=timeout)
    return reply.layer_ms

"""The daemon's client of the coordinator: join (retrying while it cannot be reached), heartbeat,
leave, and checkpoint upload/download. Failures come back as typed errors (tahnode.net.errors)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from ..config.emulation import LinkEmulation
from ..net.auth import BadMac, Sealer
from ..net.errors import CoordinatorError, NotAuthenticated, NotFresh, Unreachable, from_rpc_error
from ..net.freshness import COORDINATOR, SealRefused
from ..net.grpc_transport import DIRECT
from ..net.channels import open_channel
from ..net.tls import CoordinatorTrust
from ..pipeline.checkpoint import ChunkWriter, read_chunks
from ..proto import tahnode_pb2 as pb
from ..proto import tahnode_pb2_grpc as pb_grpc

log = logging.getLogger("tahnode.daemon")

__all__ = ["CoordinatorClient"]


class CoordinatorClient:
    """Sealed and signed calls to the coordinator at `address`; `join` connects (over TLS pinning
    the certificate `trust` names, else plain gRPC) and tells the sealer the run."""

    def __init__(self, address: str, sealer: Sealer, emulation: LinkEmulation = LinkEmulation(),
                 trust: CoordinatorTrust | None = None):
        self.address, self.sealer, self.emulation, self.trust = address, sealer, emulation, trust
        self.coordinator_key = b""  # the coordinator's public key, from the join reply
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.CoordinatorStub | None = None

    async def connect(self) -> None:
        """Open the channel once: TLS if the coordinator speaks it (its certificate checked first)."""
        if self.channel is None:
            pinned = await self.trust.certificate(self.address) if self.trust else b""
            self.channel = open_channel(self.address, pinned, DIRECT, self.emulation)
            self.stub = pb_grpc.CoordinatorStub(self.channel)

    async def _call(self, method, request, what: str, timeout: float = 10.0):
        try:
            return await method(self.sealer.seal(request, COORDINATOR), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self.address, what) from None

    async def join(self, req: pb.JoinRequest, wait_s: float = 60.0) -> pb.JoinReply:
        """Join; while the coordinator cannot be reached, try again every second for `wait_s`."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                await self.connect()
                reply = await self._call(self.stub.Join, req, "join")
                self.sealer.run, self.coordinator_key = reply.run, reply.coordinator_key
                return reply
            except Unreachable:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        return await self._call(self.stub.Heartbeat, req, "heartbeat", timeout=5.0)

    async def leave(self, node_id: str) -> None:
        try:
            await self._call(self.stub.Leave, pb.LeaveRequest(node_id=node_id), "leave", timeout=3.0)
        except CoordinatorError as exc:
            log.info("leave: %s", exc)

    async def upload(self, node_id: str, path: str, stage: int, num_stages: int, step: int) -> None:
        """Send a saved stage checkpoint to the coordinator's store (for standbys)."""
        def chunks():
            for data, last in read_chunks(path):
                chunk = pb.CheckpointChunk(node_id=node_id, stage=stage, num_stages=num_stages, step=step, data=data,
                                           last=last)
                yield self.sealer.seal(chunk, COORDINATOR)

        try:
            await self.stub.UploadCheckpoint(chunks(), timeout=600)
        except grpc.aio.AioRpcError as exc:
            log.warning("checkpoint upload of step %d failed: %s", step, exc.details())

    async def download(self, node_id: str, stage: int, step: int, final: Path) -> None:
        """Fetch the store's checkpoint of (stage, step) into the file `final`."""
        request = self.sealer.seal(pb.DownloadRequest(node_id=node_id, stage=stage, step=step), COORDINATOR)
        try:
            with ChunkWriter(final, ".download") as writer:
                async for chunk in self.stub.DownloadCheckpoint(request, timeout=600):
                    try:
                        self.sealer.check(chunk, speaks_for=COORDINATOR, signed_by=self.coordinator_key)
                    except BadMac:
                        raise NotAuthenticated("a checkpoint chunk from the coordinator failed "
                                               "authentication") from None
                    except SealRefused as exc:
                        raise NotFresh(f"a checkpoint chunk from the coordinator was refused: {exc}") from None
                    writer.write(chunk.data)
                await asyncio.to_thread(writer.commit)  # raises CorruptCheckpoint (nothing kept) if it arrived damaged
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self.address,
                                 f"download of the checkpoint of stage {stage} at step {step}") from None

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

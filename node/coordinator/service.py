"""The Coordinator gRPC service: join, heartbeat and leave go to the registry (a refusal becomes
its gRPC status), and stage checkpoints stream into and out of the store."""

from __future__ import annotations

import asyncio
import logging

import grpc

from ..net.errors import Refused
from ..pipeline.checkpoint import ChunkWriter, CorruptCheckpoint, read_chunks
from ..proto import tahnode_pb2 as pb
from ..proto import tahnode_pb2_grpc as pb_grpc
from .registry import SwarmRegistry

log = logging.getLogger("tahnode.coordinator")

__all__ = ["CoordinatorServicer"]


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, registry: SwarmRegistry):
        self.r = registry

    async def _call(self, fn, request, context):
        try:
            return fn(request)
        except Refused as exc:
            log.warning("refused %s from %s: %s", type(request).__name__, context.peer(), exc)
            await context.abort(exc.code, str(exc))

    async def Join(self, request, context):
        return await self._call(self.r.join, request, context)

    async def Heartbeat(self, request, context):
        return await self._call(self.r.heartbeat, request, context)

    async def Leave(self, request, context):
        return await self._call(self.r.leave, request, context)

    async def UploadCheckpoint(self, request_iterator, context):
        """Receive a stage checkpoint into the store (written to a temp file, renamed when whole and
        its SHA-256 matches; a corrupt one is refused with DATA_LOSS and never stored)."""
        writer: ChunkWriter | None = None
        total = 0
        try:
            async for chunk in request_iterator:
                try:
                    self.r.check(chunk, chunk.node_id)
                    self.r.may_upload(chunk.node_id, chunk.stage)
                except Refused as exc:
                    log.warning("refused a checkpoint chunk from %s: %s", context.peer(), exc)
                    await context.abort(exc.code, str(exc))
                if chunk.num_stages != self.r.run.stages or chunk.stage >= chunk.num_stages:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"checkpoint of stage {chunk.stage}/{chunk.num_stages} does not fit this swarm")
                if writer is None:
                    writer = ChunkWriter(self.r.store.path(chunk.stage, chunk.num_stages, chunk.step), f".{chunk.node_id}.part")
                writer.write(chunk.data)
                total += len(chunk.data)
                if chunk.last:
                    try:
                        final = await asyncio.to_thread(writer.commit)
                    except CorruptCheckpoint as exc:
                        log.warning("refused a checkpoint upload from %s: %s", chunk.node_id, exc)
                        await context.abort(grpc.StatusCode.DATA_LOSS, f"checkpoint of stage {chunk.stage} at step {chunk.step} "
                                            "arrived corrupt (its SHA-256 does not match): not stored")
                    writer = None
                    self.r.store.prune(chunk.stage, chunk.num_stages)
                    log.info("stored %s (%d bytes) from %s", final.name, total, chunk.node_id)
        finally:
            if writer is not None:
                writer.close()
        return pb.UploadReply(bytes=total)

    async def DownloadCheckpoint(self, request, context):
        try:
            self.r.check(request, request.node_id)
            self.r.member(request.node_id)  # the weights go to the swarm's nodes only
        except Refused as exc:
            log.warning("refused a checkpoint download from %s: %s", context.peer(), exc)
            await context.abort(exc.code, str(exc))
        ckpt = self.r.store.find(request.stage, self.r.run.stages, request.step)
        if ckpt is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint of stage {request.stage} at step {request.step} in the store")
        for data, last in read_chunks(ckpt.path):
            chunk = pb.CheckpointChunk(stage=request.stage, num_stages=self.r.run.stages, step=request.step, data=data, last=last)
            yield self.r.sealer.seal(chunk, request.node_id)

"""The Coordinator gRPC service: join, heartbeat and leave go to the registry (a refusal becomes
its gRPC status), and stage checkpoints stream into and out of the store."""

from __future__ import annotations

import asyncio
import logging
import math

import grpc

from ..net.errors import Refused
from ..net.p2p.host import is_p2p_address
from ..net.tls import is_loopback
from ..pipeline.checkpoint import (EXTRA_LIMIT_PER_DIM, CheckpointTooLarge, ChunkWriter, check_fits, optimized,
                                   read_chunks)
from ..pipeline.checkpoint import has_outer, stage_shapes
from ..pipeline.checkpoint_errors import BadMetadata, CheckpointError, ForeignCheckpoint
from ..pipeline.checkpoint_meta import CheckpointMeta, MetaForm
from ..proto import tahnode_pb2 as pb
from ..proto import tahnode_pb2_grpc as pb_grpc
from .registry import SwarmRegistry

log = logging.getLogger("tahnode.coordinator")

__all__ = ["CoordinatorServicer"]


METADATA_BYTES = 8 << 20  # a checkpoint's header beyond its tensors: the run config, unreported steps
# an upload refused for what its metadata says answers INVALID_ARGUMENT; any other refusal of a
# whole file (its SHA-256, its tensors) DATA_LOSS
UPLOAD_CODES = {BadMetadata: grpc.StatusCode.INVALID_ARGUMENT, ForeignCheckpoint: grpc.StatusCode.INVALID_ARGUMENT}


class StageForm:
    """What a checkpoint of each stage of the run must look like: its tensors' shapes, and at most how
    many bytes it takes (every tensor in float32, the codec state, the metadata)."""

    def __init__(self, registry: SwarmRegistry):
        import torch

        from ..train.model import StageModel

        self.run = run = registry.run
        self.dim, self.shapes = run.model.dim, []
        with torch.device("meta"):  # shapes only, nothing allocated
            for stage in range(run.stages):
                self.shapes.append(stage_shapes(StageModel(run.model, stage, run.stages), outer=has_outer(run)))

    def limit(self, stage: int) -> int:
        elements = sum(math.prod(s) for s in self.shapes[stage].values()) + EXTRA_LIMIT_PER_DIM * self.dim
        return 4 * elements + METADATA_BYTES

    def validator(self, stage: int, step: int):
        """What a file uploaded as `stage` at `step` must be: metadata that parses into its record
        (BadMetadata, ForeignCheckpoint), tensors that fit the stage (CorruptCheckpoint)."""
        def validate(tensors, meta) -> None:
            CheckpointMeta.parse(meta, MetaForm(stage, self.run.stages, step, self.run), optimized(tensors))
            check_fits(tensors, self.shapes[stage], f"checkpoint of stage {stage}", EXTRA_LIMIT_PER_DIM * self.dim)

        return validate


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """`node_tls`: nodes that serve their data plane off loopback over gRPC must present a TLS
    certificate (their neighbours would dial them in clear otherwise); off only with --insecure."""

    def __init__(self, registry: SwarmRegistry, node_tls: bool = True):
        self.r, self.node_tls = registry, node_tls
        self.form = StageForm(registry)

    async def _call(self, fn, request, context):
        try:
            return fn(request)
        except Refused as exc:
            log.warning("refused %s from %s: %s", type(request).__name__, context.peer(), exc)
            await context.abort(exc.code, str(exc))

    async def Join(self, request, context):
        if (self.node_tls and not request.tls_cert and not is_loopback(request.address)
                and not is_p2p_address(request.address)):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.address} is off loopback and the node "
                                "offers no TLS certificate: its neighbours would send it the swarm's traffic in clear "
                                "(this swarm runs TLS; start the node without --insecure)")
        return await self._call(lambda req: self.r.join(req, context.peer()), request, context)

    async def Heartbeat(self, request, context):
        return await self._call(self.r.heartbeat, request, context)

    async def Leave(self, request, context):
        return await self._call(self.r.leave, request, context)

    async def UploadCheckpoint(self, request_iterator, context):
        """Receive a stage checkpoint into the store from the stage's current holder, for a step the
        ledger knows: streamed to an owner-only temp file, at most the size such a checkpoint has,
        renamed only when whole, its SHA-256 right, its metadata's record sound and its tensors the
        stage's; anything else is refused (and never stored: the store keeps what it had)."""
        writer: ChunkWriter | None = None
        total = 0
        try:
            async for chunk in request_iterator:
                try:
                    self.r.check(chunk, chunk.node_id)
                    self.r.may_upload(chunk.node_id, chunk.stage, chunk.step)
                except Refused as exc:
                    log.warning("refused a checkpoint chunk from %s: %s", context.peer(), exc)
                    await context.abort(exc.code, str(exc))
                if chunk.num_stages != self.r.run.stages or chunk.stage >= chunk.num_stages:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"checkpoint of stage {chunk.stage}/{chunk.num_stages} does not fit this swarm")
                if writer is None:
                    writer = ChunkWriter(self.r.store.path(chunk.stage, chunk.num_stages, chunk.step),
                                         f".{chunk.node_id}.part", limit=self.form.limit(chunk.stage),
                                         validate=self.form.validator(chunk.stage, chunk.step))
                try:
                    writer.write(chunk.data)
                except CheckpointTooLarge as exc:
                    writer = None
                    log.warning("refused a checkpoint upload from %s: %s", chunk.node_id, exc)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                total += len(chunk.data)
                if chunk.last:
                    try:
                        final = await asyncio.to_thread(writer.commit)
                    except CheckpointError as exc:
                        log.warning("refused a checkpoint upload from %s: %s", chunk.node_id, exc)
                        await context.abort(UPLOAD_CODES.get(type(exc), grpc.StatusCode.DATA_LOSS),
                                            f"checkpoint of stage {chunk.stage} at step {chunk.step} "
                                            f"refused, not stored: {exc}")
                    writer = None
                    self.r.store.prune(chunk.stage, chunk.num_stages, self.r.confirmed_step())
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
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no checkpoint of stage {request.stage} at step {request.step} in the store")
        for data, last in read_chunks(ckpt.path):
            chunk = pb.CheckpointChunk(stage=request.stage, num_stages=self.r.run.stages, step=request.step, data=data,
                                       last=last)
            yield self.r.sealer.seal(chunk, request.node_id)

"""Checkpoints between a node and the coordinator's store: every saved stage file is uploaded (so a
standby elsewhere can take the stage over), and a stage taken over is first fetched from the store."""

from __future__ import annotations

import asyncio
import logging

from ..net.errors import CoordinatorError
from ..pipeline.checkpoint import CheckpointStore, CorruptCheckpoint, read_verified
from ..proto import tahnode_pb2 as pb
from .membership import CoordinatorClient

log = logging.getLogger("tahnode.daemon")

__all__ = ["CheckpointSync"]


class CheckpointSync:
    """Uploads of node `node_id`'s saved files, and the download of the file it must resume from."""

    def __init__(self, coord: CoordinatorClient, node_id: str, store: CheckpointStore):
        self.coord, self.node_id, self.store = coord, node_id, store
        self.loop = asyncio.get_running_loop()
        self.uploads: list[asyncio.Task] = []

    def saved(self, path: str, step: int, stage: int, num_stages: int) -> None:
        """A stage file was written (called from the compute thread): upload it in the background."""
        def start() -> None:
            self.uploads.append(self.loop.create_task(self.coord.upload(self.node_id, path, stage, num_stages, step)))

        self.loop.call_soon_threadsafe(start)

    def needs_fetch(self, a: pb.Assignment) -> bool:
        """The assignment resumes from a step newer than any sound checkpoint of the stage here
        (corrupt ones met on the way are moved aside)."""
        if not a.resume_step:
            return False
        for ckpt in reversed(self.store.list(a.stage, a.num_stages)):
            if ckpt.step < a.resume_step:
                return True
            try:
                read_verified(ckpt.path)
                return False
            except CorruptCheckpoint as exc:
                log.error("%s; moved aside to %s", exc, self.store.quarantine(ckpt))
        return True

    async def fetch(self, a: pb.Assignment) -> bool:
        """Download the store's checkpoint the assignment resumes from; False (with a log line) if
        it arrived corrupt, and the stage resumes from its newest sound checkpoint here."""
        return await self.fetch_step(a.stage, a.num_stages, a.resume_step)

    async def fetch_step(self, stage: int, num_stages: int, step: int) -> bool:
        """Download the store's checkpoint of (stage, step) into this node's store; False (with a
        log line) if the store has none or it arrived corrupt."""
        try:
            await self.coord.download(self.node_id, stage, step, self.store.path(stage, num_stages, step))
        except CorruptCheckpoint as exc:
            log.error("the store's checkpoint of stage %d at step %d: %s", stage, step, exc)
            return False
        except CoordinatorError as exc:
            log.error("no checkpoint of stage %d at step %d from the coordinator: %s", stage, step, exc)
            return False
        log.info("fetched the checkpoint of stage %d at step %d from the coordinator", stage, step)
        return True

    async def wait(self, timeout: float) -> None:
        """Let the uploads still running finish (or give up after `timeout` seconds)."""
        if self.uploads:
            await asyncio.wait(self.uploads, timeout=timeout)

"""`tahnode join`: one volunteer's daemon. It joins the coordinator, waits for a stage, holds it
(serving the data plane, training until the run ends) and saves its stage when asked to stop.

`StageNode.create()` joins, `run()` trains, `shutdown()` leaves; its parts (membership client,
heartbeats, checkpoint sync, assignment follower) are objects of their own."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import torch

from ..codecs.base import receive_buffer
from ..config import AUTO_STAGE, NodeConfig, RunConfig, TlsMode, TransportKind
from ..net.auth import Sealer, SwarmKey
from ..net.discovery import SwarmDirectory, republish
from ..net.freshness import COORDINATOR
from ..net.grpc_transport import GrpcTransport
from ..net.identity import KEY_FILE, NodeKey
from ..net.memory import reuse_message_buffers
from ..net.p2p.host import P2PHost, close_process_host, use_swarm_key
from ..net.p2p.transport import P2PTransport
from ..net.probe import measure_link
from ..net.tls import PINNED_COORDINATOR_FILE, CoordinatorTrust, TlsCertificate, is_loopback, wants_tls
from ..net.transport import Transport
from ..pipeline.admission import envelope_cap
from ..pipeline.checkpoint import CheckpointStore
from ..pipeline.core import initial_model
from ..pipeline.outer_sync import CATCH_UP_S
from ..pipeline.state import PipelineError
from ..pipeline.worker import StageWorker
from ..proto import tahnode_pb2 as pb
from ..train.data import open_dataset
from ..train.model import StageModel
from .checkpoint_sync import CheckpointSync
from .device import device_label, device_memory, measure_layer_ms, resolve_device
from .folder import NodeFolder
from .follower import AssignmentFollower
from .heartbeats import Heartbeats
from .membership import CoordinatorClient
from .averaging import StageAveraging
from .p2p import averaging_host, find_coordinator, needs_p2p, node_entries, start_host
from .progress import Progress

log = logging.getLogger("tahnode.daemon")

__all__ = ["StageNode", "run_node"]

RUN_FINISHED_WAIT_S = 5.0  # after its last step, how long a node waits for the coordinator to see the run end


def state_dir(cfg: NodeConfig, node_id: str) -> Path:
    """Where the node keeps its stage checkpoints and its key."""
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path("tahnode-state") / node_id


def make_transport(cfg: NodeConfig, sealer: Sealer, tls: TlsCertificate | None, host: P2PHost | None) -> Transport:
    """The data plane the node's config asks for (gRPC served over TLS with `tls`, if given; p2p on `host`)."""
    emulation = cfg.emulation

    async def measurer(peer: str, target: str, nbytes: int, cert: bytes) -> tuple[float, float]:
        return await measure_link(sealer, target, peer, nbytes, emulation, pinned=cert)

    if cfg.transport is TransportKind.P2P:
        return P2PTransport(sealer, host, emulation=emulation, measurer=measurer)
    return GrpcTransport(sealer, cfg.listen, cfg.advertise, emulation=emulation, measurer=measurer, tls=tls)


def data_plane_tls(cfg: NodeConfig, folder: Path) -> TlsCertificate | None:
    """The certificate the gRPC data plane serves with, if TLS is wanted where peers reach this node
    (libp2p encrypts and authenticates p2p links itself)."""
    if cfg.transport is TransportKind.P2P:
        return None
    if wants_tls(cfg.tls, cfg.advertise or cfg.listen):
        return TlsCertificate.load_or_create(folder)
    if cfg.tls is TlsMode.OFF and not is_loopback(cfg.advertise or cfg.listen):
        log.warning("--insecure: this node's data plane is plain gRPC; activations and gradients travel in clear")
    return None


class StageNode:
    """A joined node: create with `await StageNode.create(cfg, stop)`, then `run()`, then `shutdown()`.
    Setting `stop` (SIGTERM, Ctrl-C) makes `run()` save the stage and return."""

    def __init__(self, cfg: NodeConfig, stop: asyncio.Event, node_id: str, device: str, transport: Transport,
                 coord: CoordinatorClient):
        self.cfg, self.stop, self.node_id, self.device = cfg, stop, node_id, device
        self.t, self.coord = transport, coord
        self.publishing: asyncio.Future | None = None  # the node's entry in the DHT, republished until `closing`
        self.closing = asyncio.Event()
        self.beats: Heartbeats | None = None
        self.sync: CheckpointSync | None = None
        self.worker: StageWorker | None = None
        self.assignment = pb.Assignment()
        self.run_cfg: RunConfig | None = None
        self.averaging: StageAveraging | None = None  # the stage's averager (pipelines in data parallel)
        self.warming: asyncio.Task | None = None  # a standby's DHT, joined while it waits (pipelines in data parallel)
        self.folder: NodeFolder | None = None  # its folder, locked while it runs

    @classmethod
    async def create(cls, cfg: NodeConfig, stop: asyncio.Event) -> StageNode:
        """Serve the data plane, join the coordinator, start heartbeats and measure this device."""
        key = SwarmKey(cfg.token)
        # the node's identity lives beside its checkpoints: the same folder, the same node (id and key) to the
        # coordinator; one daemon at a time (FolderInUse), its id the folder's (NodeIdMismatch)
        locked = NodeFolder.open(cfg.checkpoint_dir, cfg.node_id)
        node_id, folder = locked.node_id, locked.path
        use_swarm_key(key)  # for p2p relays, if it ever needs one
        try:
            host = await start_host(cfg, folder) if needs_p2p(cfg) else None  # first: its DHT forks a process
        except BaseException:
            locked.close()
            raise
        try:
            coordinator = await find_coordinator(cfg, host, key, folder / PINNED_COORDINATOR_FILE)
            device = resolve_device(cfg.device)
        except BaseException:
            locked.close()
            if host is not None:
                await host.close()
            raise
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        identity = NodeKey.load_or_create(folder / KEY_FILE)
        # one counter and one replay guard for all it sends and receives; the guard's counters outlive a restart
        sealer = Sealer(key, node_id, identity=identity, seen_file=folder / "seen-counters.json")
        tls = data_plane_tls(cfg, folder)
        transport = make_transport(cfg, sealer, tls, host)
        transport.receive_buffer = receive_buffer(device)  # on a GPU: page-locked, for the copy to the device
        trust = CoordinatorTrust(cfg.tls, cfg.coordinator_fingerprint or coordinator.fingerprint,
                                 folder / PINNED_COORDINATOR_FILE)
        node = cls(cfg, stop, node_id, device, transport,
                   CoordinatorClient(coordinator.address, sealer, cfg.emulation, trust))
        node.folder = locked
        try:
            address = await transport.start()
            join = pb.JoinRequest(node_id=node_id, address=address, stage=cfg.stage, device=device_label(device),
                                  memory_bytes=device_memory(device), tls_cert=tls.cert_pem if tls else b"",
                                  movable=cfg.stage == AUTO_STAGE)
            reply = await node.coord.join(join)
            if reply.notice:  # why it waits (a newcomer; a limit of replicas per host or operator)
                print(f"{node_id}: the coordinator says: {reply.notice}", flush=True)
            node.assignment = reply.assignment
            transport.peer_keys[COORDINATOR] = reply.coordinator_key  # measure requests must be signed by it
            node.run_cfg = RunConfig.from_json(node.assignment.run_config)
            if cfg.init_from:  # a checkpoint of another model is refused before anything trains
                from ..train.hf import check_hf_config

                check_hf_config(node.run_cfg.model, cfg.init_from)
            transport.set_envelope_cap(envelope_cap(node.run_cfg))
            node.beats = Heartbeats(node.coord, join, transport)
            node.beats.start()
            transport.compute_measurer = node.measure_compute  # the coordinator may ask again, before it judges a chain
            await node.measure_compute()
            if host is not None and host.dht is not None:
                node.publishing = asyncio.ensure_future(republish(SwarmDirectory(host.dht, key),
                                                                  node_entries(node_id, transport, cfg.transport),
                                                                  node.closing, volatile=("forward_mbps",)))
        except BaseException:
            await node._close()
            raise
        return node

    async def measure_compute(self) -> float:
        """One layer's forward and backward on one micro-batch here, in ms: as it joins, and when the coordinator
        asks again; its heartbeats report the latest."""
        layer_ms = await asyncio.to_thread(measure_layer_ms, self.run_cfg, self.device)
        self.beats.measured(layer_ms)
        return layer_ms

    async def _until_stop(self, awaitable, *also: asyncio.Event):
        """The awaitable's result, or None if `stop` (or the coordinator's ban, or an event of `also`)
        is set first (the awaitable is cancelled)."""
        waiter = asyncio.ensure_future(awaitable)
        stoppers = [asyncio.ensure_future(event.wait()) for event in (self.stop, self.beats.dismissed, *also)]
        done, _ = await asyncio.wait({waiter, *stoppers}, return_when=asyncio.FIRST_COMPLETED)
        for task in (waiter, *stoppers):
            if task not in done:
                task.cancel()
        return waiter.result() if waiter in done else None

    async def _wait_for_stage(self) -> bool:
        """Joining, then perhaps standby, until the coordinator gives us a stage (False: stopped,
        or the run finished while we stood by)."""
        a = self.assignment
        if a.stage < 0:
            print(f"{self.node_id}: joined {self.coord.address}, serving on {self.t.address}; waiting for a stage "
                  f"(one layer takes {self.beats.layer_ms:.1f} ms per micro-batch here)", flush=True)
        while a.stage < 0:
            self._warm(a)
            a = await self._until_stop(self.beats.next_assignment())
            if a is None:
                if not self.beats.dismissed.is_set():
                    print(f"{self.node_id}: stopping (held no stage)", flush=True)
                return False
            if a.stage < 0 and self.beats.run_finished:
                print(f"{self.node_id}: the run has finished; a standby is no longer needed, leaving", flush=True)
                return False
        self.assignment = a
        return True

    def _warm(self, a: pb.Assignment) -> None:
        """A standby while pipelines train in data parallel joins their DHT now (its forkserver, p2p daemon and DHT
        process started), so that a stage it takes over starts only its averager: seconds sooner on a busy host."""
        if self.warming is None and a.stage < 0 and a.pipelines > 1 and a.dht_peers:
            self.warming = asyncio.ensure_future(averaging_host(self.cfg, state_dir(self.cfg, self.node_id),
                                                                list(a.dht_peers)))
            self.warming.add_done_callback(_said_if_failed)

    async def _build_worker(self) -> StageWorker:
        a, run, cfg = self.assignment, self.run_cfg, self.cfg
        self.t.set_stage(a.stage)
        print(f"{self.node_id}: holds stage {a.stage} of {a.num_stages}"
              f"{f' in pipeline {a.pipeline}' if a.pipeline else ''} (coordinator {self.coord.address}), serving on "
              f"{self.t.address} ({device_label(self.device)})", flush=True)
        # three, as the coordinator's store: a rollback goes back to the newest step every stage has saved
        store = CheckpointStore(state_dir(cfg, self.node_id), keep=3)
        self.sync = CheckpointSync(self.coord, self.node_id, store)
        if self.sync.needs_fetch(a):
            print(f"{self.node_id}: fetching the checkpoint of stage {a.stage} at step {a.resume_step} from the "
                  "coordinator", flush=True)
            await self.sync.fetch(a)
        dataset = await asyncio.to_thread(open_dataset, run, cfg.data_dir) if a.stage == 0 else None
        # beside the event loop, which sends the heartbeats: a large stage takes longer to build, and a
        # first checkpoint longer to load, than the coordinator waits for a heartbeat (a stage of
        # llama-tiny under load once took 12 s from its fetched checkpoint to its loaded one)
        worker, resumed = await asyncio.to_thread(self._make_worker, store, dataset)
        # for rollbacks: the store's copy
        worker.saver.fetch = lambda step: self.sync.fetch_step(a.stage, a.num_stages, step)
        if resumed:
            print(f"{self.node_id}: resumed stage {a.stage} from its checkpoint at step {resumed}", flush=True)
        return worker

    def _make_worker(self, store: CheckpointStore, dataset) -> tuple[StageWorker, int]:
        """The stage's worker with its model built (or loaded from `init_from`) and its newest
        checkpoint loaded; and the step it resumed at (0: none)."""
        a = self.assignment
        worker = StageWorker(self.run_cfg, a.stage, self.t, self.device, store, dataset,
                             on_step=Progress(self.run_cfg.train.steps, self.cfg.progress), model=self._build_model(),
                             on_saved=lambda path, step: self.sync.saved(path, step, a.stage, a.num_stages),
                             pipeline=a.pipeline)
        return worker, worker.resume()

    def _build_model(self) -> StageModel:
        """The assigned stage's model, initialized as every holder of it initializes it, or loaded from
        `init_from`."""
        return initial_model(self.run_cfg, self.assignment.stage, self.cfg.init_from)

    async def run(self) -> int:
        """Hold a stage and train until the run ends (0) or `stop` is set (0, stage saved); 1 if the
        pipeline cannot go on. A node that loses its stage (declared failed while unreachable)
        saves it, stands by and may be given a stage again."""
        while await self._wait_for_stage():
            try:
                outcome = await self._hold_stage()
            except PipelineError as exc:
                print(f"{self.node_id}: error: {exc}", file=sys.stderr, flush=True)
                return 1
            if outcome is not None:
                return outcome
        return self._dismissed() if self.beats.dismissed.is_set() else 0

    def _dismissed(self) -> int:
        print(f"{self.node_id}: error: {self.beats.dismissal}", file=sys.stderr, flush=True)
        return 1

    async def _hold_stage(self) -> int | None:
        """Train the assigned stage: 0 when the run ended or `stop` was set, None if the stage was
        lost (the worker is stopped and saved, and the node stands by)."""
        self.worker = worker = await self._build_worker()
        self.averaging = StageAveraging(self.cfg, state_dir(self.cfg, self.node_id), self.coord.sealer.run, worker,
                                        self.beats, self.node_id, self.warming)
        follower = AssignmentFollower(self.t, worker.stage, self.beats, worker.pipeline, self.averaging.follow)
        follower.start(self.assignment)
        # other pipelines train: their outer weights are where it starts
        await self._until_stop(self.averaging.started())
        self.beats.attach(worker)
        run_task = asyncio.ensure_future(worker.run(self.run_cfg.train.steps))
        try:
            await self._until_stop(asyncio.shield(run_task), follower.lost)
        finally:
            follower.stop()
        if not run_task.done():
            lost = follower.lost.is_set() and not self.stop.is_set() and not self.beats.dismissed.is_set()
            what = "it lost the stage to another node" if lost else "stopping"
            print(f"{self.node_id}: {what}: saving stage {worker.stage} at step {worker.committed}", flush=True)
            await worker.stop()
            run_task.cancel()
            if not lost:
                return self._dismissed() if self.beats.dismissed.is_set() else 0
            await self._release_stage(follower.assignment)
            return None
        run_task.result()  # raises PipelineError
        await self.t.flush(10.0)
        await worker.compute(worker.save)
        print(f"{self.node_id}: run finished at step {worker.committed}", flush=True)
        return 0

    async def _release_stage(self, assignment: pb.Assignment) -> None:
        """After losing the stage: no links, no stage stats, the coordinator's latest word."""
        self.t.reset_links()  # the stop flushed and ended them
        self.t.set_stage(-1)
        self.beats.detach()
        self.worker.close()
        self.worker = None
        await self._stop_averaging()
        self.assignment = assignment
        print(f"{self.node_id}: standing by", flush=True)

    async def shutdown(self) -> None:
        """Finish uploads, report a last time, leave the swarm, close every connection."""
        if self.sync is not None:
            await self.sync.wait(timeout=30)
        if self.beats is not None:
            await self.beats.stop()
            if self.worker is not None and self.worker.stats.finished:
                # the last stage may report the end after this stage finished: until then, the
                # coordinator would give the stage this node leaves to a standby
                await self._until_stop(self.beats.until_run_finished(self._finish_wait_s()))  # SIGTERM ends the wait
        await self.coord.leave(self.node_id)
        await self._close()

    def _finish_wait_s(self) -> float:
        """How long a node whose pipeline finished waits for the run's end (every pipeline's). With
        replicas, as long as another pipeline's replica, late to the last outer step and alone at it,
        may look for this one's outer weights of it (outer_sync: the last boundary's catch-up):
        leaving sooner took its averager away, and that replica ended the run with a model of its own."""
        averaging = self.averaging is not None and self.averaging.averager is not None
        swarm = self.run_cfg.swarm
        # its round, then the catch-up
        return RUN_FINISHED_WAIT_S + (CATCH_UP_S + 3 * swarm.outer_timeout_s if averaging else 0.0)

    async def _stop_averaging(self) -> None:
        if self.averaging is not None:
            await self.averaging.stop()
            self.averaging = None

    async def _close(self) -> None:
        self.closing.set()
        await self._stop_averaging()
        if self.warming is not None and not self.warming.done():
            self.warming.cancel()
            await asyncio.gather(self.warming, return_exceptions=True)
        if self.publishing is not None:
            await self.publishing
        await self.coord.close()
        await self.t.close()
        await close_process_host()  # the node's own p2p daemon, or a dial-only one started to reach a p2p neighbour
        if self.worker is not None:
            self.worker.close()
        if self.folder is not None:
            self.folder.close()


def _said_if_failed(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("its DHT did not start while it stood by (%s); it starts again with a stage", task.exception())


async def run_node(cfg: NodeConfig) -> int:
    """The whole life of a daemon: join, hold a stage, leave; SIGTERM and Ctrl-C stop it cleanly."""
    reuse_message_buffers()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = await StageNode.create(cfg, stop)
    try:
        return await node.run()
    finally:
        await node.shutdown()

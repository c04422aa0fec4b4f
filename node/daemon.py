"""`tahnode join`: one volunteer's daemon. Joins the coordinator, holds the assigned stage,
serves the data plane, trains until the run ends, and saves its stage on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from .auth import DEFAULT_TOKEN, SwarmKey
from .checkpoint import CheckpointStore
from .config import RunConfig
from .grpc_transport import GrpcTransport
from .pipeline import PipelineError, StageWorker
from .proto import tahnode_pb2 as pb
from .proto import tahnode_pb2_grpc as pb_grpc
from .transport import BACKWARD, FORWARD

log = logging.getLogger("tahnode.daemon")


@dataclass
class NodeConfig:
    coordinator: str = "127.0.0.1:7000"
    stage: int = -1                 # -1 = auto
    listen: str = "0.0.0.0:0"
    advertise: str = ""
    device: str = "auto"
    token: str = DEFAULT_TOKEN
    node_id: str = ""
    checkpoint_dir: str = ""
    data_dir: str = ""              # where the built-in corpus is prepared (default: ~/.cache/tahnode)
    init_from: str = ""             # a local Hugging Face checkpoint directory
    window: int = 4                 # envelopes in flight per outgoing link
    progress: bool = True


class JoinError(RuntimeError):
    """The coordinator refused us, or cannot be reached."""


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise JoinError("--device cuda asked for, but no CUDA GPU is available")
    return name


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return "cpu"


class CoordinatorClient:
    def __init__(self, address: str, key: SwarmKey):
        self.address, self.key = address, key
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    async def _call(self, method, request, timeout: float = 10.0):
        try:
            return await method(self.key.sign(request), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise JoinError(f"coordinator {self.address} cannot be reached: {exc.details()}") from None
            raise JoinError(f"coordinator {self.address} refused the {type(request).__name__[:-7].lower()}: {exc.details()}") from None

    async def join(self, req: pb.JoinRequest, wait_s: float = 60.0) -> pb.JoinReply:
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                return await self._call(self.stub.Join, req)
            except JoinError as exc:
                if "cannot be reached" not in str(exc) or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        return await self._call(self.stub.Heartbeat, req, timeout=5.0)

    async def leave(self, node_id: str) -> None:
        try:
            await self._call(self.stub.Leave, pb.LeaveRequest(node_id=node_id), timeout=3.0)
        except JoinError as exc:
            log.info("leave: %s", exc)

    async def close(self) -> None:
        await self.channel.close()


def training_stats(worker: StageWorker) -> pb.TrainingStats:
    """This node's stats for a heartbeat; takes the unreported committed steps off the outbox
    (the caller puts them back if the heartbeat fails)."""
    s = worker.stats
    stats = pb.TrainingStats(
        step=worker.committed,
        tokens_per_s=s.tokens_per_s(),
        forward_bits_per_element=s.bits_per_element(FORWARD),
        backward_bits_per_element=s.bits_per_element(BACKWARD),
        wire_bytes=sum(s.wire_bytes.values()),
        uncompressed_bytes=s.uncompressed_bytes,
        finished=s.finished,
        replays=s.replays,
    )
    for ctx in (worker.send_ctx.get(FORWARD), worker.recv_ctx.get(FORWARD)):
        if ctx is not None:
            stats.aqsgd_cache_bytes += ctx[1].aqsgd_cache.nbytes
    if s.losses:
        stats.loss = s.losses[-1][1]
        stats.loss_first = s.losses[0][1]
    for step, loss, ids in s.outbox:
        stats.losses.add(step=step, loss=loss, sample_ids=ids)
    if worker.last and s.step_times:  # the last stage sees the whole pipeline's backward rate
        stats.backward_bits_per_element = s.bits_per_element(BACKWARD)
    return stats


def open_dataset(run: RunConfig, cfg: NodeConfig):
    from .data import TokenDataset, default_corpus, prepare

    if run.data:
        return TokenDataset(run.data, run.train.seq_len)
    cache = Path(cfg.data_dir or os.environ.get("TAHNODE_CACHE", Path.home() / ".cache" / "tahnode"))
    out = cache / f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}-{run.data_limit_mb:g}mb.bin"
    if not out.exists():
        print(f"preparing the built-in corpus (Python's stdlib sources, {run.data_limit_mb:g} MB) in {out}", flush=True)
        cache.mkdir(parents=True, exist_ok=True)
        prepare(default_corpus(limit_bytes=int(run.data_limit_mb * 2**20)), out, progress=False)
    return TokenDataset(out, run.train.seq_len)


class Progress:
    """One line per step on the last stage (rich when attached to a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        from rich.console import Console

        self.console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)

    def __call__(self, worker: StageWorker) -> None:
        if not (self.enabled and worker.last and worker.stats.losses):
            return
        s = worker.stats
        step, loss, _ = s.losses[-1]
        self.console.print(
            f"step {step + 1:>5}/{self.total}  loss {loss:.4f}  {s.tokens_per_s():8.0f} tok/s  "
            f"gradients {s.bits_per_element(BACKWARD):.2f} bits/element  sent {sum(s.wire_bytes.values()) / 2**20:.1f} MB"
        )


async def run_node(cfg: NodeConfig) -> int:
    key = SwarmKey(cfg.token)
    if key.is_default:
        log.warning("no --token given: using the public default swarm token")
    device = resolve_device(cfg.device)
    node_id = cfg.node_id or f"{socket.gethostname()}-{os.getpid()}"
    transport = GrpcTransport(node_id, key, cfg.listen, cfg.advertise, window=cfg.window)
    address = await transport.start()
    coord = CoordinatorClient(cfg.coordinator, key)
    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory if device.startswith("cuda") else 0
    reply = await coord.join(pb.JoinRequest(node_id=node_id, address=address, stage=cfg.stage, device=device_label(device), memory_bytes=memory))
    a = reply.assignment
    run = RunConfig.from_json(a.run_config)
    if a.stage < 0:
        await coord.leave(node_id)
        raise JoinError("every stage is taken and standbys come with the full coordinator: nothing to do")
    transport.stage = a.stage
    print(f"{node_id}: joined {cfg.coordinator} as stage {a.stage} of {a.num_stages}, serving on {address} ({device_label(device)})", flush=True)
    store = CheckpointStore(cfg.checkpoint_dir or Path("tahnode-state") / node_id)
    dataset = open_dataset(run, cfg) if a.stage == 0 else None
    model = None
    if cfg.init_from:
        from .model import build_stage, load_stage_from_hf

        model = load_stage_from_hf(build_stage(run.model, a.stage, run.stages, seed=run.train.seed), cfg.init_from)
    worker = StageWorker(run, a.stage, transport, device, store, dataset, on_step=Progress(run.train.steps, cfg.progress), model=model)
    resumed = worker.resume()
    if resumed:
        print(f"{node_id}: resumed stage {a.stage} from its checkpoint at step {resumed}", flush=True)

    def apply(assignment: pb.Assignment) -> None:
        if assignment.stage != worker.stage:
            raise JoinError(f"the coordinator moved this node from stage {worker.stage} to {assignment.stage}")
        transport.set_peer(FORWARD, assignment.next.node_id, assignment.next.address)
        transport.set_peer(BACKWARD, assignment.prev.node_id, assignment.prev.address)

    apply(a)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)

    async def report() -> pb.HeartbeatReply:
        sent = len(worker.stats.outbox)
        stats = training_stats(worker)
        links = [pb.LinkStats(dst=c.peer, bytes=c.bytes, seconds=c.seconds) for c in (transport.counters(FORWARD), transport.counters(BACKWARD)) if c.peer]
        hb = await coord.heartbeat(pb.HeartbeatRequest(node_id=node_id, stats=stats, links=links))
        del worker.stats.outbox[:sent]
        return hb

    async def heartbeats() -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                apply((await report()).assignment)
            except JoinError as exc:
                log.warning("heartbeat: %s", exc)

    hb_task = asyncio.create_task(heartbeats())
    run_task = asyncio.create_task(worker.run(run.train.steps))
    stop_task = asyncio.create_task(stop_requested.wait())
    code = 0
    try:
        done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if stop_task in done:
            print(f"{node_id}: stopping: saving stage {worker.stage} at step {worker.committed}", flush=True)
            await worker.stop()
            run_task.cancel()
            code = 0
        else:
            run_task.result()  # raises PipelineError
            await transport.flush(10.0)
            await worker.compute(worker.save)
            print(f"{node_id}: run finished at step {worker.committed}", flush=True)
    except PipelineError as exc:
        print(f"{node_id}: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        hb_task.cancel()
        try:  # a last report, so the coordinator sees the final step and the finished flag
            await report()
        except JoinError:
            pass
        stop_task.cancel()
        await coord.leave(node_id)
        await coord.close()
        await transport.close()
        worker.pool.shutdown(wait=False)
    return code

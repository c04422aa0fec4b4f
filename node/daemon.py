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
from .grpc_transport import GrpcTransport, probe
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


async def measure_link(key: SwarmKey, target: str, nbytes: int) -> tuple[float, float]:
    """Throughput (Mbit/s) and RTT (ms) from here to `target`: a short probe sizes the real one
    to last about a second (1-64 MiB), so token-bucket bursts do not inflate the figure."""
    if nbytes:
        return await probe(key, target, nbytes)
    rough, _ = await probe(key, target, 512 << 10)
    size = int(min(64 << 20, max(1 << 20, rough * 1e6 / 8 * 1.0)))
    return await probe(key, target, size)


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

    async def upload(self, node_id: str, path: str, stage: int, num_stages: int, step: int) -> None:
        """Send a saved stage checkpoint to the coordinator's store (for standbys)."""
        def chunks():
            with open(path, "rb") as fh:
                while True:
                    data = fh.read(1 << 20)
                    last = len(data) < (1 << 20)
                    yield self.key.sign(pb.CheckpointChunk(node_id=node_id, stage=stage, num_stages=num_stages, step=step, data=data, last=last))
                    if last:
                        return

        try:
            await self.stub.UploadCheckpoint(chunks(), timeout=600)
        except grpc.aio.AioRpcError as exc:
            log.warning("checkpoint upload of step %d failed: %s", step, exc.details())

    async def download(self, node_id: str, stage: int, step: int, store: CheckpointStore, num_stages: int) -> None:
        """Fetch the store's checkpoint of (stage, step) into the local checkpoint directory."""
        store.dir.mkdir(parents=True, exist_ok=True)
        final = store.dir / f"stage{stage}-of{num_stages}-step{step}.safetensors"
        tmp = final.with_suffix(".download")
        try:
            with open(tmp, "wb") as fh:
                async for chunk in self.stub.DownloadCheckpoint(self.key.sign(pb.DownloadRequest(node_id=node_id, stage=stage, step=step)), timeout=600):
                    if not self.key.verify(chunk):
                        raise JoinError("a checkpoint chunk from the coordinator failed authentication")
                    fh.write(chunk.data)
            tmp.replace(final)
        except grpc.aio.AioRpcError as exc:
            tmp.unlink(missing_ok=True)
            raise JoinError(f"cannot download the checkpoint of stage {stage} at step {step}: {exc.details()}") from None

    async def close(self) -> None:
        await self.channel.close()


def training_stats(worker: StageWorker) -> pb.TrainingStats:
    """This node's stats for a heartbeat, with the committed steps not yet reported (the caller
    takes them off the outbox once the heartbeat went through)."""
    s = worker.stats
    stats = pb.TrainingStats(
        step=worker.committed,
        tokens_per_s=s.tokens_per_s(),
        forward_bits_per_element=s.bits_per_element(FORWARD),
        backward_bits_per_element=s.bits_per_element(BACKWARD),
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
    return stats


def measure_layer_ms(run: RunConfig, device: str) -> float:
    """Median forward+backward time of one decoder layer on one micro-batch on this device."""
    import time

    from .model import DecoderLayer, rope_cos_sin

    cfg, t = run.model, run.train
    dtype = torch.float32 if t.dtype == "float32" else torch.bfloat16
    layer = DecoderLayer(cfg).to(device=device, dtype=dtype)
    x = torch.randn(t.batch_size, t.seq_len, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(t.seq_len, cfg.head_dim, cfg.rope_theta, x.device, dtype)
    times = []
    for _ in range(4):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer(x, cos, sin).sum().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[1]


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
            f"gradients {s.bits_per_element(BACKWARD):.2f} bits/element  encoded {sum(s.encoded_bytes.values()) / 2**20:.1f} MB"
        )


class Heartbeats:
    """Heartbeats every second from the join on: stats of the worker once there is one, and the
    latest assignment for whoever waits on it."""

    def __init__(self, coord: CoordinatorClient, node_id: str, transport: GrpcTransport, join: pb.JoinRequest):
        self.coord, self.node_id, self.t, self.join = coord, node_id, transport, join
        self.layer_ms = 0.0
        self.worker: StageWorker | None = None
        self.assignment: pb.Assignment | None = None
        self.changed = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def report(self) -> pb.HeartbeatReply:
        req = pb.HeartbeatRequest(node_id=self.node_id, layer_ms=self.layer_ms)
        sent = 0
        if self.worker is not None:
            sent = len(self.worker.stats.outbox)
            req.stats.CopyFrom(training_stats(self.worker))
            counters = (self.t.counters(FORWARD), self.t.counters(BACKWARD))
            req.stats.wire_bytes = sum(c.bytes for c in counters)  # whole envelopes: labels and ids too
            for c in counters:
                if c.peer:
                    req.links.add(dst=c.peer, bytes=c.bytes, seconds=c.seconds)
        hb = await self.coord.heartbeat(req)
        if self.worker is not None:
            del self.worker.stats.outbox[:sent]
        self.assignment = hb.assignment
        self.changed.set()
        return hb

    async def _loop(self) -> None:
        while True:
            try:
                await self.report()
            except JoinError as exc:
                log.warning("heartbeat: %s", exc)
                if "unknown node" in str(exc):  # declared failed while we were busy: join again
                    self.join.stage = self.worker.stage if self.worker is not None else -1
                    try:
                        await self.coord.join(self.join, wait_s=0)
                        log.info("rejoined the coordinator")
                    except JoinError as again:
                        log.warning("rejoin: %s", again)
            await asyncio.sleep(1.0)

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def next_assignment(self) -> pb.Assignment:
        self.changed.clear()
        await self.changed.wait()
        return self.assignment

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
        try:  # a last report, so the coordinator sees the final step and the finished flag
            await self.report()
        except JoinError:
            pass


async def run_node(cfg: NodeConfig) -> int:
    key = SwarmKey(cfg.token)
    if key.is_default:
        log.warning("no --token given: using the public default swarm token")
    device = resolve_device(cfg.device)
    node_id = cfg.node_id or f"{socket.gethostname()}-{os.getpid()}"
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    transport = GrpcTransport(node_id, key, cfg.listen, cfg.advertise, window=cfg.window)
    address = await transport.start()
    transport.measure_handler = lambda target, nbytes: measure_link(key, target, nbytes)
    coord = CoordinatorClient(cfg.coordinator, key)
    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory if device.startswith("cuda") else 0
    join = pb.JoinRequest(node_id=node_id, address=address, stage=cfg.stage, device=device_label(device), memory_bytes=memory)
    a = (await coord.join(join)).assignment
    run = RunConfig.from_json(a.run_config)
    beats = Heartbeats(coord, node_id, transport, join)
    beats.start()
    beats.layer_ms = await asyncio.to_thread(measure_layer_ms, run, device)
    worker: StageWorker | None = None
    uploads: list[asyncio.Task] = []
    code = 0
    try:
        if a.stage < 0:
            print(f"{node_id}: joined {cfg.coordinator}, serving on {address}; waiting for a stage "
                  f"(one layer takes {beats.layer_ms:.1f} ms per micro-batch here)", flush=True)
        while a.stage < 0:  # joining, then perhaps standby, until the coordinator gives us a stage
            waiter = asyncio.ensure_future(beats.next_assignment())
            stopper = asyncio.ensure_future(stop_requested.wait())
            done, _ = await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                waiter.cancel()
                print(f"{node_id}: stopping (held no stage)", flush=True)
                return 0
            stopper.cancel()
            a = waiter.result()
        transport.stage = a.stage
        print(f"{node_id}: holds stage {a.stage} of {a.num_stages} (coordinator {cfg.coordinator}), serving on {address} ({device_label(device)})", flush=True)
        store = CheckpointStore(cfg.checkpoint_dir or Path("tahnode-state") / node_id)
        latest = store.latest(a.stage, a.num_stages)
        if a.resume_step and (latest is None or latest.step < a.resume_step):
            print(f"{node_id}: fetching the checkpoint of stage {a.stage} at step {a.resume_step} from the coordinator", flush=True)
            await coord.download(node_id, a.stage, a.resume_step, store, a.num_stages)
        dataset = await asyncio.to_thread(open_dataset, run, cfg) if a.stage == 0 else None
        model = None
        if cfg.init_from:
            from .model import build_stage, load_stage_from_hf

            model = load_stage_from_hf(build_stage(run.model, a.stage, run.stages, seed=run.train.seed), cfg.init_from)

        def saved(path: str, step: int) -> None:  # called on the compute thread
            loop.call_soon_threadsafe(lambda: uploads.append(loop.create_task(coord.upload(node_id, path, a.stage, a.num_stages, step))))

        worker = StageWorker(run, a.stage, transport, device, store, dataset, on_step=Progress(run.train.steps, cfg.progress), model=model, on_saved=saved)
        resumed = worker.resume()
        if resumed:
            print(f"{node_id}: resumed stage {a.stage} from its checkpoint at step {resumed}", flush=True)

        def apply(assignment: pb.Assignment) -> None:
            if assignment.stage != worker.stage:
                log.warning("the coordinator moved this node from stage %d to %d; it keeps stage %d until restarted", worker.stage, assignment.stage, worker.stage)
                return
            transport.set_peer(FORWARD, assignment.next.node_id, assignment.next.address)
            transport.set_peer(BACKWARD, assignment.prev.node_id, assignment.prev.address)

        apply(a)
        beats.worker = worker

        async def follow() -> None:
            while True:
                apply(await beats.next_assignment())

        follower = asyncio.create_task(follow())
        run_task = asyncio.create_task(worker.run(run.train.steps))
        stop_task = asyncio.create_task(stop_requested.wait())
        try:
            done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if stop_task in done:
                print(f"{node_id}: stopping: saving stage {worker.stage} at step {worker.committed}", flush=True)
                await worker.stop()
                run_task.cancel()
            else:
                run_task.result()  # raises PipelineError
                await transport.flush(10.0)
                await worker.compute(worker.save)
                print(f"{node_id}: run finished at step {worker.committed}", flush=True)
        finally:
            follower.cancel()
            stop_task.cancel()
    except PipelineError as exc:
        print(f"{node_id}: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if uploads:
            await asyncio.wait(uploads, timeout=30)
        await beats.stop()
        await coord.leave(node_id)
        await coord.close()
        await transport.close()
        if worker is not None:
            worker.pool.shutdown(wait=False)
    return code

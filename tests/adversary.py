"""A malicious volunteer for tests/test_adversary.py: the real `tahnode join` daemon holding a stage,
with the swarm token, whose outgoing envelopes are tampered with on a script (issue 26's data-plane
attacks), and which meanwhile attacks the coordinator with its own identity (the control plane).
First of all (issue 39) it uploads checkpoints of its stage whose metadata lies and sends its next
stage frames padded to 4 MiB; the envelope attacks wait for those.

Run as `python tests/adversary.py LOG STATE_URL -- JOIN FLAGS...` (STATE_URL: the coordinator's
/api/v1/state, for the run id); it appends one line per attack to LOG."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import torch
from safetensors.torch import save_file

from tahnode import cli
from tahnode.codecs import checksum
from tahnode.net import links
from tahnode.net.body import Body
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.channels import open_channel
from tahnode.net.freshness import COORDINATOR
from tahnode.net.grpc_transport import CHANNEL_OPTIONS, STAGE_SERVICE
from tahnode.net.identity import NodeKey
from tahnode.net.transport import BACKWARD, FORWARD
from tahnode.pipeline import worker
from tahnode.pipeline.checkpoint import DIGEST_KEY, CheckpointStore, digest, read_chunks, read_verified
from tahnode.proto import tahnode_pb2 as pb
from tahnode.proto import tahnode_pb2_grpc as pb_grpc
from tahnode.train.model import build_stage
from tahnode.tools.abuse_frames import PAD_TO, unknown_field

PADDED_FRAMES = 60           # frames of 1 byte of data, each padded to PAD_TO bytes on the wire
# checkpoints of the stage whose metadata lies, of steps it never saves (it saves every 4, and is
# banned long before the run's last): the standby that takes the stage resumes from the newest
POISONS = {"checkpoint metadata not JSON": (37, {"optim_steps": "{"}),
           "checkpoint metadata of wrong types": (38, {"run": "[]"}),
           "checkpoint unreported [[0, 9.9]]": (39, {"unreported": "[[0, 9.9]]"})}


class Script:
    """Which envelope to alter at which step, each attack once; `done` logs what was sent."""

    def __init__(self, log: Path):
        self.log, self.done = log, set()
        self.run_cfg = None                  # the run's configuration, once the daemon holds its stage
        self.holding = threading.Event()     # ... set then
        self.poisoned = threading.Event()    # the checkpoint attacks were made
        self.padded = threading.Event()      # the padded frames were sent

    def note(self, what: str) -> None:
        self.done.add(what)
        with self.log.open("a") as fh:
            fh.write(f"{time.time():.3f} {what}\n")

    def once(self, what: str) -> bool:
        return what not in self.done

    def alter(self, direction, env: pb.Envelope) -> list[pb.Envelope]:
        """The envelopes to send instead of `env` (itself, altered, or with another before it)."""
        body = env.WhichOneof("body")
        mb = env.micro_batch
        if not (self.poisoned.is_set() and self.padded.is_set()):  # issue 39's attacks first, while it holds the stage
            return [env]
        # Each attack is an offence its neighbour reports, and 3 from one neighbour (a refusal can
        # bring another, from what was in flight) ban this node, which then sends nothing more: so
        # the attacks come as close together as the run allows. The step-end lie first (the end of
        # step 2: nothing reported yet), then in step 3 the bad activation (its forward comes first)
        # and, in one send, the backward shutdown and the bad gradient norm.
        if body == "step_end" and env.step_end.step >= 2 and self.once("step end norm inf"):
            bad = pb.Envelope()
            bad.CopyFrom(env)
            bad.step_end.grad_sumsq = math.inf
            self.note("step end norm inf")
            return [bad]
        if (body == "micro_batch" and direction == FORWARD and mb.step >= 3 and mb.index == 0
                and self.once("activation 3e38")):
            bad = pb.Envelope()
            bad.CopyFrom(env)
            x = torch.frombuffer(bytearray(mb.tensor.payload), dtype=torch.float32).clone()
            x[3] = 3e38
            bad.micro_batch.tensor.payload = x.numpy().tobytes()
            bad.micro_batch.tensor.crc32 = checksum(bad.micro_batch.tensor)
            self.note("activation 3e38")
            return [bad]
        if (body == "micro_batch" and direction == BACKWARD and "grad_sumsq" in mb.extras and mb.step >= 3
                and self.once("gradient norm -1")):
            bad = pb.Envelope()
            bad.CopyFrom(env)
            bad.micro_batch.extras["grad_sumsq"] = -1.0
            self.note("shutdown backward")
            self.note("gradient norm -1")
            return [pb.Envelope(shutdown=pb.Shutdown(step=mb.step)), bad]
        return [env]


def tamper(script: Script) -> None:
    send = links.LinkedTransport.send
    init = worker.StageWorker.__init__

    def holding(self, run, *args, **kwargs):
        script.run_cfg = run
        script.holding.set()
        init(self, run, *args, **kwargs)

    async def altered_send(self, direction, envelope, generation):
        if direction == FORWARD and self.links[FORWARD].address and script.once("padded frames"):
            script.done.add("padded frames")
            asyncio.get_running_loop().create_task(padded_frames(script, self))
        ok = True
        whole = envelope.envelope() if isinstance(envelope, Body) else envelope  # a micro-batch travels as its body
        for env in script.alter(direction, whole):
            ok = await send(self, direction, env, generation) and ok
        return ok

    links.LinkedTransport.send = altered_send
    worker.StageWorker.__init__ = holding


async def padded_frames(script: Script, transport) -> None:
    """Frame 0 of a 2-frame envelope to the next stage, then frames that say 10^9, 1 byte of data
    each, padded to 4 MiB with an unknown field (before issue 39, each held its 4 MiB there and
    counted 1 byte, and the envelope never completed)."""
    link, sealer = transport.links[FORWARD], transport.sealer
    seq = sealer.counter.next()

    def frames():
        yield sealer.frame(link.peer_id, seq, 0, 2, b"x").SerializeToString()
        for index in range(1, PADDED_FRAMES):
            raw = sealer.frame(link.peer_id, seq, index, 10**9, b"x").SerializeToString()
            yield unknown_field(PAD_TO - len(raw)) + raw

    async with open_channel(link.address, transport.peer_certs.get(link.peer_id, b""), CHANNEL_OPTIONS) as channel:
        call = channel.stream_unary(f"/{STAGE_SERVICE.full_name}/Forward", request_serializer=lambda b: b,
                                    response_deserializer=pb.StreamAck.FromString)(timeout=60)
        try:
            for index, raw in enumerate(frames()):
                await call.write(raw)
                if index == 1:  # the first padded frame: a refusal may come before the next write (a write
                    # in flight when it comes ends the call here with INTERNAL, not with the refusal's status)
                    ended = asyncio.ensure_future(call.code())
                    await asyncio.wait({ended}, timeout=10)
                    if ended.done():
                        break
            else:
                await call.done_writing()
            await call
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        code = await call.code()
    outcome = "accepted" if code == grpc.StatusCode.OK else code.name
    script.note(f"padded frames: {outcome}")
    script.padded.set()


def poisoned_checkpoint(run, step: int, edit: dict, folder: Path) -> Path:
    """A checkpoint of stage 1 at `step` whose tensors are the stage's and whose SHA-256 is right,
    its metadata edited by `edit`."""
    model = build_stage(run.model, 1, run.stages, seed=0)
    path = CheckpointStore(folder).save(1, run.stages, step, model, torch.optim.AdamW(model.parameters()),
                                        run.to_json())
    tensors, meta = read_verified(path)
    meta.update(edit)
    meta[DIGEST_KEY] = digest(tensors, meta)
    save_file(tensors, str(path), metadata=meta)
    return path


def checkpoint_attacks(script: Script, stub, sealer: Sealer, node_id: str) -> None:
    """Upload each of POISONS while holding stage 1 (before, the store took them, and the standby
    that took the stage died in resume() on the newest)."""
    with tempfile.TemporaryDirectory() as folder:
        for what, (step, edit) in POISONS.items():
            path = poisoned_checkpoint(script.run_cfg, step, edit, Path(folder))
            chunks = [sealer.seal(pb.CheckpointChunk(node_id=node_id, stage=1, num_stages=script.run_cfg.stages,
                                                     step=step, data=data, last=last), COORDINATOR)
                      for data, last in read_chunks(path)]
            try:
                stub.UploadCheckpoint(iter(chunks))
                outcome = "accepted"
            except grpc.RpcError as exc:
                outcome = exc.code().name
            script.note(f"{what}: {outcome}")
    script.poisoned.set()


def control_plane_attacks(script: Script, coordinator: str, node_id: str, folder: Path, token: str,
                          status: str) -> None:
    """Once the daemon joined (its key exists): lie to the coordinator with its own identity."""
    key_file = folder / "node.key"
    script.holding.wait()  # joined, its key made, and given stage 1
    run = json.loads(
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(status, timeout=10).read())["run"]
    sealer = Sealer(SwarmKey(token), node_id, run, identity=NodeKey.load_or_create(key_file))
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coordinator))
    checkpoint_attacks(script, stub, sealer, node_id)
    time.sleep(3.0)  # training by now
    attempts = {
        "ledger wipe (LossPoint step 0)": lambda: stub.Heartbeat(sealer.seal(pb.HeartbeatRequest(
            node_id=node_id, stats=pb.TrainingStats(losses=[pb.LossPoint(step=0, loss=9.0, sample_ids=[1])])),
            COORDINATOR)),
        "60000 links": lambda: stub.Heartbeat(sealer.seal(pb.HeartbeatRequest(node_id=node_id, links=[
            pb.LinkStats(dst=f"ghost-{k}", bytes=k, seconds=1.0) for k in range(60_000)]), COORDINATOR)),
        "checkpoint of step 10^15": lambda: stub.UploadCheckpoint(iter([sealer.seal(pb.CheckpointChunk(
            node_id=node_id, stage=1, num_stages=3, step=10**15, data=b"x" * 100, last=True), COORDINATOR)])),
        "checkpoint of another stage": lambda: stub.UploadCheckpoint(iter([sealer.seal(pb.CheckpointChunk(
            node_id=node_id, stage=0, num_stages=3, step=5, data=b"x" * 100, last=True), COORDINATOR)])),
        "join as n0": lambda: stub.Join(Sealer(SwarmKey(token), "n0", run,
                                               identity=NodeKey.load_or_create(key_file)).seal(
            pb.JoinRequest(node_id="n0", address="127.0.0.1:1", stage=0), COORDINATOR)),
    }
    for what, call in attempts.items():
        try:
            call()
            outcome = "accepted"
        except grpc.RpcError as exc:
            outcome = exc.code().name
        script.note(f"{what}: {outcome}")


def main() -> int:
    log, status, args = Path(sys.argv[1]), sys.argv[2], sys.argv[sys.argv.index("--") + 1:]
    script = Script(log)
    tamper(script)
    flag = {args[k]: args[k + 1] for k in range(len(args) - 1) if args[k].startswith("--")}
    attacks = threading.Thread(target=control_plane_attacks, daemon=True, args=(
        script, flag["--coordinator"], flag["--node-id"], Path(flag["--checkpoint-dir"]), os.environ["TAHNODE_TOKEN"],
        status))
    attacks.start()
    code = cli.main(["join", *args])
    attacks.join(timeout=60)  # banned, the daemon stops at once: the lies it had yet to tell are still told
    return code


if __name__ == "__main__":
    sys.exit(main())

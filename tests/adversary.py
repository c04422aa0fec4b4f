"""A malicious volunteer for tests/test_adversary.py: the real `tahnode join` daemon holding a stage,
with the swarm token, whose outgoing envelopes are tampered with on a script (issue 26's data-plane
attacks), and which meanwhile attacks the coordinator with its own identity (the control plane).

Run as `python tests/adversary.py LOG STATE_URL -- JOIN FLAGS...` (STATE_URL: the coordinator's
/api/v1/state, for the run id); it appends one line per attack to LOG."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import torch

from tahnode import cli
from tahnode.codecs import checksum
from tahnode.net import links
from tahnode.net.body import Body
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.net.transport import BACKWARD, FORWARD
from tahnode.proto import tahnode_pb2 as pb
from tahnode.proto import tahnode_pb2_grpc as pb_grpc


class Script:
    """Which envelope to alter at which step, each attack once; `done` logs what was sent."""

    def __init__(self, log: Path):
        self.log, self.done = log, set()

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
        if body == "micro_batch" and direction == FORWARD and mb.step >= 3 and mb.index == 0 and self.once("activation 3e38"):
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

    async def altered_send(self, direction, envelope, generation):
        ok = True
        whole = envelope.envelope() if isinstance(envelope, Body) else envelope  # a micro-batch travels as its body
        for env in script.alter(direction, whole):
            ok = await send(self, direction, env, generation) and ok
        return ok

    links.LinkedTransport.send = altered_send


def control_plane_attacks(script: Script, coordinator: str, node_id: str, folder: Path, token: str, status: str) -> None:
    """Once the daemon joined (its key exists): lie to the coordinator with its own identity."""
    key_file = folder / "node.key"
    while not key_file.exists():
        time.sleep(0.2)
    time.sleep(3.0)  # joined and training by now
    run = json.loads(urllib.request.build_opener(urllib.request.ProxyHandler({})).open(status, timeout=10).read())["run"]
    sealer = Sealer(SwarmKey(token), node_id, run, identity=NodeKey.load_or_create(key_file))
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coordinator))
    attempts = {
        "ledger wipe (LossPoint step 0)": lambda: stub.Heartbeat(sealer.seal(pb.HeartbeatRequest(
            node_id=node_id, stats=pb.TrainingStats(losses=[pb.LossPoint(step=0, loss=9.0, sample_ids=[1])])), COORDINATOR)),
        "60000 links": lambda: stub.Heartbeat(sealer.seal(pb.HeartbeatRequest(node_id=node_id, links=[
            pb.LinkStats(dst=f"ghost-{k}", bytes=k, seconds=1.0) for k in range(60_000)]), COORDINATOR)),
        "checkpoint of step 10^15": lambda: stub.UploadCheckpoint(iter([sealer.seal(pb.CheckpointChunk(
            node_id=node_id, stage=1, num_stages=3, step=10**15, data=b"x" * 100, last=True), COORDINATOR)])),
        "checkpoint of another stage": lambda: stub.UploadCheckpoint(iter([sealer.seal(pb.CheckpointChunk(
            node_id=node_id, stage=0, num_stages=3, step=5, data=b"x" * 100, last=True), COORDINATOR)])),
        "join as n0": lambda: stub.Join(Sealer(SwarmKey(token), "n0", run, identity=NodeKey.load_or_create(key_file)).seal(
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
    threading.Thread(target=control_plane_attacks, daemon=True, args=(
        script, flag["--coordinator"], flag["--node-id"], Path(flag["--checkpoint-dir"]), os.environ["TAHNODE_TOKEN"],
        status)).start()
    return cli.main(["join", *args])


if __name__ == "__main__":
    sys.exit(main())

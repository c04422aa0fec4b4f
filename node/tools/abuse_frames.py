"""`tahnode bench abuse`'s data-plane part: a stage holder (issue 39, finding 2) sends its next stage
envelopes that never complete, as frames padded to 4 MiB and as frames that name 10^9 frames.

Each attempt is one Forward stream: frame 0 of a 2-frame envelope, then the attack frame; the
victim is a real `tahnode join` daemon on stage 1, its memory sampled by the bench."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..net.grpc_transport import STREAMS_PER_PEER
from .bench_coordinator import BenchError
from .bench_probes import fetch

__all__ = ["StageDaemon", "send_frames", "unknown_field", "PAD_TO", "ENDLESS_COUNT"]

PAD_TO = (4 << 20) - 1024  # a padded frame's bytes on the wire, within gRPC's 4 MiB message limit
ENDLESS_COUNT = 10**9      # the frame count the second kind of attack frame names


class StageDaemon:
    """`tahnode join --stage STAGE` as users start it, on loopback with plain gRPC, its output in a log."""

    def __init__(self, workdir: Path, coordinator: str, token_file: Path, stage: int, node_id: str = "victim",
                 command: list[str] | None = None):
        """`command`: the program given `join ...` (default `python -m tahnode.cli`; a liar's, say)."""
        self.workdir, self.node_id = workdir, node_id
        self.command = command or [sys.executable, "-m", "tahnode.cli"]
        self.log = workdir / f"{node_id}.log"
        self.args = ["join", "--coordinator", coordinator, "--stage", str(stage), "--listen", "127.0.0.1:0",
                     "--node-id", node_id, "--token-file", str(token_file), "--tls", "off", "--device", "cpu",
                     "--threads", "1", "--checkpoint-dir", str(workdir / "ck" / node_id)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*self.command, *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError("the stage daemon exited with status "
                             f"{self.proc.returncode}:\n{self.log.read_text()[-3000:]}")

    def wait_held(self, state_url: str, timeout: float = 120.0) -> str:
        """Its data-plane address, once the coordinator says it holds its stage."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive()
            got = fetch(state_url)
            if got is not None:
                node = next((n for n in json.loads(got[1]).get("nodes", []) if n.get("id") == self.node_id), None)
                if node and node.get("stage") is not None and node.get("stage") >= 0 and node.get("address"):
                    return node["address"]
            time.sleep(0.3)
        raise BenchError(f"{self.node_id} held no stage within {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def unknown_field(n: int) -> bytes:
    """A length-delimited field Frame does not have (number 15), `n` bytes in all."""
    from ..net.body import varint

    key = varint(15 << 3 | 2)
    body = n - len(key) - len(varint(n))
    return key + varint(body) + bytes(body)


async def _attempts(address: str, sealer, recipient: str, kind: str, streams: int, in_flight: int) -> dict[str, int]:
    import grpc

    from ..net.grpc_transport import CHANNEL_OPTIONS, STAGE_SERVICE
    from ..proto import tahnode_pb2 as pb

    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(in_flight)
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        forward = channel.stream_unary(f"/{STAGE_SERVICE.full_name}/Forward", request_serializer=lambda b: b,
                                       response_deserializer=pb.StreamAck.FromString)

        async def attempt():
            seq = sealer.counter.next()
            first = sealer.frame(recipient, seq, 0, 2, b"x").SerializeToString()
            if kind == "padded":
                raw = sealer.frame(recipient, seq, 1, 2, b"x").SerializeToString()
                attack = unknown_field(PAD_TO - len(raw)) + raw
            else:
                attack = sealer.frame(recipient, seq, 1, ENDLESS_COUNT, b"x").SerializeToString()
            async with gate:
                call = forward(timeout=30)
                try:
                    await call.write(first)
                    await call.write(attack)
                    await call.done_writing()
                    await call
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    pass
                code = (await call.code()).name
                outcomes[code] = outcomes.get(code, 0) + 1

        await asyncio.gather(*(attempt() for _ in range(streams)))
    return outcomes


async def _send(coordinator: str, token: str, key_file: Path, target: str, recipient: str, attacks: dict[str, int],
                in_flight: int) -> dict:
    import grpc

    from ..net.auth import Sealer, SwarmKey
    from ..net.freshness import COORDINATOR
    from ..net.identity import NodeKey
    from ..proto import tahnode_pb2 as pb
    from ..proto import tahnode_pb2_grpc as pb_grpc

    sealer = Sealer(SwarmKey(token), "neighbour", identity=NodeKey.load_or_create(key_file))
    async with grpc.aio.insecure_channel(coordinator) as channel:  # the victim's stage 0: its neighbour, bound by key
        reply = await pb_grpc.CoordinatorStub(channel).Join(
            sealer.seal(pb.JoinRequest(node_id="neighbour", address="127.0.0.1:9", stage=0), COORDINATOR))
    sealer.guard.run = reply.run
    return {kind: await _attempts(target, sealer, recipient, kind, n, in_flight) for kind, n in attacks.items()}


def send_frames(coordinator: str, token: str, key_file: Path, target: str, recipient: str, attacks: dict[str, int],
                in_flight: int = STREAMS_PER_PEER) -> dict:
    """The neighbour, in a process of its own: joins stage 0 under the key in `key_file` (made if
    missing; the same key each call, as a restarted node rejoins), then per attack kind that many
    streams, `in_flight` at once (by default as many as a receiver lets one sender hold open, so
    that each reaches the frame parser); {kind: {gRPC status name: streams}}."""
    return asyncio.run(_send(coordinator, token, key_file, target, recipient, attacks, in_flight))

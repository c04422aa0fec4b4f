"""Fuzz every handler of both services (real gRPC servers in this process, tests/servers.py) with
hypothesis: random bytes, mutated signed messages, and well-signed messages with random fields.
Each call ends with a clear status (never UNKNOWN: no handler raised), the servers keep serving,
and the swarm's state (members, epoch, ledger, stored checkpoints) is what it was."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import NODE, TOKEN, Servers
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.framing import frames_of
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb

C, S = "/tahnode.v1.Coordinator/", "/tahnode.v1.StageService/"
UNARY = [C + "Join", C + "Heartbeat", C + "Leave", S + "Ping", S + "Measure"]
STREAMS = [C + "UploadCheckpoint", S + "Forward", S + "Backward", S + "Probe"]
SERVER_STREAMS = [C + "DownloadCheckpoint"]
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    s = Servers(tmp_path_factory.mktemp("fuzz"))
    yield s
    s.stop()


def snapshot(s: Servers) -> tuple:
    r = s.registry
    # the replay guard's own file
    kept = [p.name for p in r.store.dir.iterdir() if not p.name.startswith("seen-counters")]
    return (sorted((n.node_id, n.stage, n.status.value) for n in r.nodes.values()), r.epoch, sorted(r.ledger()),
            sorted(kept))


def call(s: Servers, path: str, wire: list[bytes]) -> grpc.StatusCode:
    address = s.coordinator if path.startswith(C) else s.node
    same = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    with grpc.insecure_channel(address) as ch:
        try:
            if path in UNARY:
                ch.unary_unary(path, **same)(wire[0], timeout=10)
            elif path in STREAMS:
                ch.stream_unary(path, **same)(iter(wire), timeout=10)
            else:
                list(ch.unary_stream(path, **same)(wire[0], timeout=10))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def still_serving(s: Servers) -> None:
    ping = Sealer(SwarmKey(TOKEN), "checker", s.run).seal(pb.PingRequest(nonce=b"alive"), NODE)
    assert call(s, S + "Ping", [ping.SerializeToString()]) == grpc.StatusCode.OK


@FUZZ
@given(path=st.sampled_from(UNARY + STREAMS + SERVER_STREAMS),
       chunks=st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_random_bytes_into_every_handler(servers, path, chunks):
    before = snapshot(servers)
    code = call(servers, path, chunks)
    assert code in CLEAR and code is not grpc.StatusCode.OK or path.endswith(("Forward", "Backward", "Probe")), code
    assert snapshot(servers) == before
    still_serving(servers)


def _signed(s: Servers, path: str, sender: str, fields: dict) -> list:
    sealer = Sealer(SwarmKey(TOKEN), sender, s.run, NodeKey.generate())
    to = COORDINATOR if path.startswith(C) else NODE
    name = path.rsplit("/", 1)[1]
    if name in ("Forward", "Backward"):
        return list(frames_of(sealer, to, fields["blob"]))
    make = {
        "Join": lambda: pb.JoinRequest(node_id=sender, address=fields["text"], stage=fields["int"],
                                       device=fields["text"], memory_bytes=fields["big"], compute_ms=fields["float"]),
        "Heartbeat": lambda: pb.HeartbeatRequest(node_id=sender, layer_ms=fields["float"], stats=pb.TrainingStats(
            step=fields["big"], loss=fields["float"], losses=[pb.LossPoint(step=fields["big"], loss=fields["float"])])),
        "Leave": lambda: pb.LeaveRequest(node_id=sender),
        "UploadCheckpoint": lambda: pb.CheckpointChunk(node_id=sender, stage=abs(fields["int"]),
                                                       num_stages=abs(fields["int"]), step=fields["big"],
                                                       data=fields["blob"], last=fields["flag"]),
        "DownloadCheckpoint": lambda: pb.DownloadRequest(node_id=sender, stage=abs(fields["int"]), step=fields["big"]),
        "Ping": lambda: pb.PingRequest(nonce=fields["blob"][:64]),
        "Measure": lambda: pb.MeasureRequest(target_id=fields["text"], target_address=fields["text"]),
        "Probe": lambda: pb.ProbeChunk(data=fields["blob"]),
    }[name]
    return [sealer.seal(make(), to)]


FIELDS = st.fixed_dictionaries({
    "text": st.text(max_size=40), "int": st.integers(-(2**31), 2**31 - 1), "big": st.integers(0, 2**64 - 1),
    "float": st.floats(allow_nan=True, allow_infinity=True), "blob": st.binary(max_size=2000), "flag": st.booleans()})


@FUZZ
@given(path=st.sampled_from(UNARY + STREAMS + SERVER_STREAMS), fields=FIELDS,
       sender=st.text(min_size=1, max_size=20).filter(lambda t: t not in (NODE, COORDINATOR)))
def test_well_signed_random_messages_from_a_stranger(servers, path, fields, sender):
    """A token holder who is not a member (or a fuzzer with the token): every message is
    authentic and fresh, its contents random. Only a join may change the membership."""
    before = snapshot(servers)
    code = call(servers, path, [m.SerializeToString() for m in _signed(servers, path, sender, fields)])
    assert code in CLEAR, code
    after = snapshot(servers)
    if path.endswith("Join") and code is grpc.StatusCode.OK:
        servers.registry.nodes.pop(sender)  # undo what a valid join rightly did
        servers.registry.epoch = before[1]
        after = snapshot(servers)
    assert after == before
    still_serving(servers)


@FUZZ
@given(path=st.sampled_from(UNARY + SERVER_STREAMS), position=st.integers(0, 10**6), value=st.integers(0, 255))
def test_a_signed_message_with_one_byte_changed_is_refused(servers, path, position, value):
    fields = {"text": "127.0.0.1:9", "int": 0, "big": 1, "float": 1.0, "blob": b"x" * 8, "flag": False}
    wire = bytearray(_signed(servers, path, "mutant", fields)[0].SerializeToString())
    position %= len(wire)
    if wire[position] == value:
        return
    wire[position] = value
    before = snapshot(servers)
    code = call(servers, path, [bytes(wire)])
    assert code in CLEAR and code is not grpc.StatusCode.OK, code
    assert snapshot(servers) == before
    still_serving(servers)

"""Every RPC of both services, on real gRPC servers (the coordinator's servicer and a node's
StageService in this process): a message recorded off the wire and sent again is refused, and so
are messages without a MAC, with the wrong token, sealed for another run or for another receiver.
One test per (RPC, case). The bytes sent are the serialized messages exactly as a recording proxy
would see them after gRPC's framing, replayed through a raw channel."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from servers import NODE, PEER, TOKEN, Servers
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.framing import frames_of
from tahnode.net.freshness import COORDINATOR, RefusalReason
from tahnode.net.identity import NodeKey
from tahnode.net.transport import BACKWARD
from tahnode.pipeline.checkpoint import read_chunks
from tahnode.proto import tahnode_pb2 as pb


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    s = Servers(tmp_path_factory.mktemp("replay"))
    yield s
    s.stop()


# -- what each RPC sends, as bytes on the wire --------------------------------------------------

@dataclass(frozen=True)
class Rpc:
    service: str       # "coordinator" or "node"
    path: str
    kind: str          # unary_unary | stream_unary | unary_stream
    make: Callable     # (servers, sealer, recipient) -> list of messages (one for unary requests)


def _join(s, sealer, to):
    return [sealer.seal(pb.JoinRequest(node_id=sealer.me, address="127.0.0.1:9", stage=-1), to)]


def _heartbeat(s, sealer, to):
    return [sealer.seal(pb.HeartbeatRequest(node_id=NODE), to)]


def _leave(s, sealer, to):
    return [sealer.seal(pb.LeaveRequest(node_id="standby-x"), to)]


def _upload(s, sealer, to):
    n = s.run_cfg.stages
    return [sealer.seal(pb.CheckpointChunk(node_id=NODE, stage=0, num_stages=n, step=7, data=d, last=last), to)
            for d, last in read_chunks(s.checkpoint)]


def _download(s, sealer, to):
    return [sealer.seal(pb.DownloadRequest(node_id=NODE, stage=0, step=7), to)]


def _frames(s, sealer, to):
    env = pb.Envelope(shutdown=pb.Shutdown(step=1)).SerializeToString()
    return list(frames_of(sealer, to, env))


def _ping(s, sealer, to):
    return [sealer.seal(pb.PingRequest(nonce=b"12345678"), to)]


def _probe(s, sealer, to):
    return [sealer.seal(pb.ProbeChunk(data=bytes(1000)), to) for _ in range(3)]


def _measure(s, sealer, to):
    return [sealer.seal(pb.MeasureRequest(target_id=PEER, target_address="127.0.0.1:9"), to)]


C, S = "/tahnode.v1.Coordinator/", "/tahnode.v1.StageService/"
RPCS = {
    "Join": Rpc("coordinator", C + "Join", "unary_unary", _join),
    "Heartbeat": Rpc("coordinator", C + "Heartbeat", "unary_unary", _heartbeat),
    "Leave": Rpc("coordinator", C + "Leave", "unary_unary", _leave),
    "UploadCheckpoint": Rpc("coordinator", C + "UploadCheckpoint", "stream_unary", _upload),
    "DownloadCheckpoint": Rpc("coordinator", C + "DownloadCheckpoint", "unary_stream", _download),
    "Forward": Rpc("node", S + "Forward", "stream_unary", _frames),
    "Backward": Rpc("node", S + "Backward", "stream_unary", _frames),
    "Ping": Rpc("node", S + "Ping", "unary_unary", _ping),
    "Probe": Rpc("node", S + "Probe", "stream_unary", _probe),
    "Measure": Rpc("node", S + "Measure", "unary_unary", _measure),
}


def sender_of(rpc: Rpc) -> str:
    """Who legitimately sends this RPC's messages."""
    if rpc.path.endswith("Join"):
        return "joiner"
    if rpc.path.endswith(("Heartbeat", "UploadCheckpoint", "DownloadCheckpoint")):
        return NODE
    if rpc.path.endswith("Leave"):
        return "standby-x"
    return COORDINATOR if rpc.path.endswith("Measure") else PEER


def send(servers: Servers, rpc: Rpc, wire: list[bytes]) -> None:
    """Send recorded bytes as one call; raises grpc.RpcError if refused."""
    address = servers.coordinator if rpc.service == "coordinator" else servers.node
    same = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    with grpc.insecure_channel(address) as ch:
        if rpc.kind == "unary_unary":
            ch.unary_unary(rpc.path, **same)(wire[0], timeout=10)
        elif rpc.kind == "stream_unary":
            ch.stream_unary(rpc.path, **same)(iter(wire), timeout=10)
        else:
            list(ch.unary_stream(rpc.path, **same)(wire[0], timeout=10))


def record(servers: Servers, name: str, sealer: Sealer | None = None, recipient: str | None = None,
           strip_mac: bool = False) -> list[bytes]:
    rpc = RPCS[name]
    if name == "Leave":  # a member that may leave (each test its own: a leave is one-off)
        servers.registry.join(servers.sealer("standby-x").seal(
            pb.JoinRequest(node_id="standby-x", address="127.0.0.1:8", stage=-1), COORDINATOR))
    sealer = sealer or servers.sealer(sender_of(rpc))
    to = recipient or (COORDINATOR if rpc.service == "coordinator" else NODE)
    messages = rpc.make(servers, sealer, to)
    if strip_mac:
        for m in messages:
            m.mac = b""
    return [m.SerializeToString() for m in messages]


def refused_with(servers: Servers, name: str, wire: list[bytes]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        send(servers, RPCS[name], wire)
    return err.value.code()


def guard_of(servers: Servers, name: str):
    return (servers.registry.sealer if RPCS[name].service == "coordinator" else servers.node_sealer).guard


@pytest.mark.parametrize("name", RPCS)
def test_a_recorded_message_sent_again_is_refused(servers, name):
    wire = record(servers, name)
    send(servers, RPCS[name], wire)  # the original call goes through
    before = guard_of(servers, name).refused[RefusalReason.REPLAYED]
    assert refused_with(servers, name, wire) == grpc.StatusCode.PERMISSION_DENIED
    assert guard_of(servers, name).refused[RefusalReason.REPLAYED] == before + 1


@pytest.mark.parametrize("name", RPCS)
def test_a_message_without_a_mac_is_refused(servers, name):
    assert refused_with(servers, name, record(servers, name, strip_mac=True)) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("name", RPCS)
def test_a_message_signed_with_the_wrong_token_is_refused(servers, name):
    wrong = servers.sealer(sender_of(RPCS[name]), token="a-guess")
    assert refused_with(servers, name, record(servers, name, sealer=wrong)) == grpc.StatusCode.UNAUTHENTICATED


BOUND = [name for name in RPCS if name not in ("Ping", "Probe")]  # pings and probes come from any prober: no node key


@pytest.mark.parametrize("name", BOUND)
def test_a_message_signed_by_another_nodes_key_is_refused(servers, name):
    """A token holder that seals as another node (its id, its token) but cannot sign with that
    node's key. Who is bound: the joiner by its first join, members by theirs, the coordinator by
    the key the nodes got in their join reply, a neighbour by the key its assignment names."""
    sender = sender_of(RPCS[name])
    if name == "Join":
        send(servers, RPCS["Join"], record(servers, "Join"))  # the joiner binds its own key first
    impostor = Sealer(SwarmKey(TOKEN), sender, servers.run, NodeKey.generate())
    before = guard_of(servers, name).refused[RefusalReason.WRONG_KEY]
    assert refused_with(servers, name, record(servers, name, sealer=impostor)) == grpc.StatusCode.PERMISSION_DENIED
    assert guard_of(servers, name).refused[RefusalReason.WRONG_KEY] == before + 1


def test_frames_from_a_node_that_is_no_neighbour_are_refused(servers):
    stranger = servers.sealer("n7")  # its own, valid key, but NODE's assignment names no n7
    wire = [f.SerializeToString() for f in _frames(servers, stranger, NODE)]
    assert refused_with(servers, "Forward", wire) == grpc.StatusCode.PERMISSION_DENIED
    assert servers.node_sealer.guard.refused[RefusalReason.STRANGER] >= 1


@pytest.mark.parametrize("name", RPCS)
def test_a_message_sealed_for_another_run_is_refused(servers, name):
    earlier = servers.sealer(sender_of(RPCS[name]), run="an-earlier-run")
    assert refused_with(servers, name, record(servers, name, sealer=earlier)) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("name", RPCS)
def test_a_message_sealed_for_another_receiver_is_refused(servers, name):
    assert (refused_with(servers, name, record(servers, name, recipient="somebody-else"))
            == grpc.StatusCode.PERMISSION_DENIED)


def test_a_replayed_heartbeat_changes_nothing(servers):
    """The attack that truncated the ledger: a recorded heartbeat carrying an old loss point."""
    reg, last = servers.registry, "n-last"  # the holder of the stage that computes the loss: it reports the losses
    reg.join(servers.sealer(last, run="").seal(pb.JoinRequest(node_id=last, address="127.0.0.1:5",
                                                              stage=reg.run.loss_stage),
                                               COORDINATOR))
    point = pb.LossPoint(step=0, loss=5.0, sample_ids=[1, 2])
    old = servers.sealer(last).seal(pb.HeartbeatRequest(node_id=last, stats=pb.TrainingStats(losses=[point])),
                                    COORDINATOR).SerializeToString()
    send(servers, RPCS["Heartbeat"], [old])
    later = [pb.LossPoint(step=k, loss=4.0, sample_ids=[k]) for k in range(1, 5)]
    send(servers, RPCS["Heartbeat"], [servers.sealer(last).seal(
        pb.HeartbeatRequest(node_id=last, stats=pb.TrainingStats(losses=later)), COORDINATOR).SerializeToString()])
    assert sorted(reg.ledger()) == [0, 1, 2, 3, 4]
    assert refused_with(servers, "Heartbeat", [old]) == grpc.StatusCode.PERMISSION_DENIED
    assert sorted(reg.ledger()) == [0, 1, 2, 3, 4]


def test_an_envelope_larger_than_the_run_sends_is_refused_before_it_is_held(servers):
    """The data plane's cap comes from the model (tahnode.pipeline.admission.envelope_cap): a
    stream that announces or sends more is refused with RESOURCE_EXHAUSTED; the node serves on."""
    from tahnode.net.framing import CHUNK_BYTES
    from tahnode.pipeline.admission import envelope_cap

    run = servers.run_cfg
    t = run.train
    largest = pb.Envelope(micro_batch=pb.MicroBatch(
        sample_ids=range(t.micro_batches * t.batch_size), labels=bytes(4 * t.micro_batches * t.batch_size * t.seq_len),
        tensor=pb.EncodedTensor(payload=bytes(4 * t.micro_batches * t.batch_size * t.seq_len * run.model.dim)))
    ).ByteSize()
    assert largest < envelope_cap(run) < 2 * largest + (1 << 20)
    servers.transport.set_envelope_cap(2 * CHUNK_BYTES)
    try:
        sealer = servers.sealer(PEER)
        big = list(frames_of(sealer, NODE, bytes(3 * CHUNK_BYTES)))
        assert (refused_with(servers, "Forward", [f.SerializeToString() for f in big])
                == grpc.StatusCode.RESOURCE_EXHAUSTED)
        huge = sealer.frame(NODE, sealer.counter.next(), 0, 10**6, b"x")  # announces a terabyte
        assert refused_with(servers, "Forward", [huge.SerializeToString()]) == grpc.StatusCode.RESOURCE_EXHAUSTED
        fits = list(frames_of(sealer, NODE, pb.Envelope(shutdown=pb.Shutdown(step=1)).SerializeToString()))
        send(servers, RPCS["Forward"], [f.SerializeToString() for f in fits])
    finally:
        servers.transport.set_envelope_cap(1 << 31)


def test_checkpoints_go_to_members_only(servers):
    """A token holder that never joined (its own valid key and seal) gets no weights."""
    outsider = servers.sealer("never-joined")
    wire = [outsider.seal(pb.DownloadRequest(node_id="never-joined", stage=0, step=7), COORDINATOR).SerializeToString()]
    assert refused_with(servers, "DownloadCheckpoint", wire) == grpc.StatusCode.NOT_FOUND


def test_a_neighbour_heard_of_late_is_waited_for(servers):
    """A neighbour may learn of this node a heartbeat before this node learns of it: its first
    frames wait (up to the transport's peer_wait_s) for the assignment that names it."""
    import threading

    late = servers.sealer("late-neighbour")
    wire = [f.SerializeToString() for f in _frames(servers, late, NODE)]
    servers.transport.peer_wait_s = 5.0
    try:
        name_it = threading.Timer(0.5, lambda: servers.loop.call_soon_threadsafe(
            servers.transport.set_peer, BACKWARD, "late-neighbour", "", servers.key("late-neighbour").public))
        name_it.start()
        send(servers, RPCS["Forward"], wire)  # accepted once the assignment named it
        name_it.join()
    finally:
        servers.transport.peer_wait_s = 0.1


def test_a_neighbour_holds_only_a_few_streams_open_at_once(servers):
    """Each stream may hold a partly received envelope in memory: one sender gets STREAMS_PER_PEER
    open streams per direction, the next is refused with RESOURCE_EXHAUSTED, and the slots come
    back when its streams end."""
    import threading
    import time

    from tahnode.net.framing import CHUNK_BYTES
    from tahnode.net.grpc_transport import STREAMS_PER_PEER

    sealer, release = servers.sealer(PEER), threading.Event()

    def held():  # the first frame of a two-frame envelope, then nothing until released
        yield list(frames_of(sealer, NODE, bytes(CHUNK_BYTES + 1)))[0].SerializeToString()
        release.wait(30)

    def first_frame() -> list[bytes]:
        return [list(frames_of(sealer, NODE, bytes(CHUNK_BYTES + 1)))[0].SerializeToString()]

    with grpc.insecure_channel(servers.node) as ch:
        forward = ch.stream_unary(RPCS["Forward"].path, request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        calls = [forward.future(held(), timeout=30) for _ in range(STREAMS_PER_PEER)]
        time.sleep(1.0)  # every one of them past its first frame
        try:
            assert refused_with(servers, "Forward", first_frame()) == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            release.set()
        for call in calls:
            call.result()
    send(servers, RPCS["Forward"], first_frame())  # the slots are free again


def test_memory_held_by_a_refused_stream_goes_back_to_the_system(servers, monkeypatch):
    """A neighbour sends 96 MiB of an envelope and then a frame out of order: the stream is
    refused, the daemon hands its free heap back to the system at once, and nothing of the stream
    stays referenced (before, the handler's traceback kept the frames, and glibc kept the heap). The
    test's own client shares the process: its buffers are freed after the refusal, so the resident
    memory is read after a trim of the test's own, with the daemon's trim counted apart (whether
    glibc kept the client's buffers in its heap depends on what ran before in the process)."""
    import gc

    from tahnode.net import grpc_transport
    from tahnode.net.framing import CHUNK_BYTES
    from tahnode.net.memory import return_freed_memory

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    trims = []
    monkeypatch.setattr(grpc_transport, "return_freed_memory", lambda: trims.append(1) or return_freed_memory())
    sealer = servers.sealer(PEER)
    gc.collect()
    return_freed_memory()
    before = rss_mb()
    for _ in range(2):
        frames = list(frames_of(sealer, NODE, bytes(128 * CHUNK_BYTES)))
        wire = [f.SerializeToString() for f in frames[:96]] + [frames[0].SerializeToString()]
        del frames
        assert refused_with(servers, "Forward", wire) == grpc.StatusCode.PERMISSION_DENIED  # the repeat is refused
        del wire
    assert len(trims) == 2  # the daemon's own, once per refused stream
    deadline = time.monotonic() + 10  # the handler may still be letting go of the stream as the refusal arrives
    while True:
        gc.collect()
        return_freed_memory()
        if rss_mb() - before < 48 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert rss_mb() - before < 48  # each stream held ~96 MiB in the daemon (and as much again here, to send it)

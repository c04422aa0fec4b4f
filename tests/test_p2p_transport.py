"""The libp2p carrier (tahnode.net.p2p.rpc over hivemind's p2p daemons, on loopback): the data plane
between two P2PTransports loses nothing and keeps order, status codes cross as codes, oversized and
unparsable requests are refused without harming the server, the DHT directory drops entries
forged without the token, and starting a daemon wrongly (in-process, or `tahnode join` and
`tahnode coordinator` themselves) fails fast with a clear error."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest

pytest.importorskip("hivemind", reason="the p2p transport needs hivemind (pip install 'tahnode[p2p]')")

from tahnode.config.node import P2PSettings  # noqa: E402
from tahnode.net.auth import Sealer, SwarmKey  # noqa: E402
from tahnode.net.channels import open_channel, transport_of  # noqa: E402
from tahnode.net.discovery import COORDINATOR_KIND, NODE_KIND, SwarmDirectory  # noqa: E402
from tahnode.net.errors import P2PStartFailed, PeerUnreachable  # noqa: E402
from tahnode.net.identity import NodeKey  # noqa: E402
from tahnode.net.p2p.host import P2PAddress, P2PHost  # noqa: E402
from tahnode.net.p2p.records import MAX_RECORD_BYTES, RecordKind, protocol_name, read_record, write_record  # noqa: E402
from tahnode.net.p2p.transport import P2PTransport  # noqa: E402
from tahnode.net.tls import TlsCertificate  # noqa: E402
from tahnode.net.transport import BACKWARD, FORWARD  # noqa: E402
from tahnode.proto import tahnode_pb2 as pb  # noqa: E402
from tahnode.proto import tahnode_pb2_grpc as pb_grpc  # noqa: E402


def payload_of(item) -> bytes:
    """A received micro-batch's tensor payload: a view of the received bytes where it travelled
    apart (tahnode.net.body), else the envelope's own field."""
    return bytes(item.payload) if item.payload is not None else item.envelope.micro_batch.tensor.payload


LOOPBACK = P2PSettings(listen=["/ip4/127.0.0.1/tcp/0"])
KEY = SwarmKey("test-token")


async def pair():
    """Two transports on their own p2p daemons: "a" (the dialling side's host is the process's last one) and "b"."""
    ka, kb = NodeKey.generate(), NodeKey.generate()
    host_b = await P2PHost.start(LOOPBACK, dht=False)
    receiver = P2PTransport(Sealer(KEY, "b", identity=kb), host_b)
    host_a = await P2PHost.start(LOOPBACK, dht=False)  # the process's host: channels dial from it
    sender = P2PTransport(Sealer(KEY, "a", identity=ka), host_a)
    receiver.peer_keys["a"] = ka.public
    await receiver.start()
    await sender.start()
    return sender, receiver, (host_a, host_b)


async def close(*things) -> None:
    for thing in things:
        await thing.close()


def test_envelopes_cross_in_order_and_a_flush_waits_until_the_peer_read_them_all():
    count, size = 30, 300_000  # each envelope several 64 KiB frames

    async def scenario():
        sender, receiver, hosts = await pair()
        assert (transport_of(receiver.address) == "p2p"
                and P2PAddress.parse(receiver.address).peer_id == hosts[1].peer_id)
        sender.set_peer(FORWARD, "b", receiver.address)
        got = []

        async def reader():
            while True:
                item = await receiver.inbox.get()
                receiver.inbox_bytes.release(item.nbytes)
                if item.envelope is not None:
                    got.append((item.sender, item.envelope.micro_batch.index, len(payload_of(item))))
                await asyncio.sleep(0.002)

        task = asyncio.create_task(reader())
        for k in range(count):
            env = pb.Envelope(micro_batch=pb.MicroBatch(index=k, tensor=pb.EncodedTensor(payload=os.urandom(size))))
            assert await sender.send(FORWARD, env, sender.generation(FORWARD))
        await sender.flush(30.0)  # returns once the peer has every envelope (in its inbox, or taken up)
        while not receiver.inbox.empty():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        counters = sender.counters(FORWARD)
        await close(sender, receiver, *hosts)
        return got, counters

    got, counters = asyncio.run(scenario())
    assert got == [("a", k, 300_000) for k in range(30)]
    assert counters.envelopes == 30 and counters.bytes > 30 * 300_000 and counters.failures == 0


def test_status_codes_cross_as_codes_and_bad_requests_leave_the_server_serving():
    async def scenario():
        sender, receiver, hosts = await pair()
        stub = pb_grpc.StageServiceStub(open_channel(receiver.address, b"", []))
        out = {}
        ping = sender.sealer.seal(pb.PingRequest(nonce=b"12345678"), "b")
        reply = await stub.Ping(ping, timeout=10)
        out["ping"] = (reply.node_id, reply.nonce)
        forged = Sealer(SwarmKey("another-token"), "a",
                        identity=NodeKey.generate()).seal(pb.PingRequest(nonce=b"x"), "b")
        for name, call in (("forged", stub.Ping(forged, timeout=10)), ("replayed", stub.Ping(ping, timeout=10)),
                           ("measure",
                            stub.Measure(sender.sealer.seal(pb.MeasureRequest(target_id="c"), "b"), timeout=10))):
            try:
                await call
                out[name] = None
            except grpc.aio.AioRpcError as exc:
                out[name] = exc.code()
        # by hand: a request that does not parse, one record above the limit, a frame padded with an
        # unknown field (issue 39: its data's view would hold all of it)
        host_a, _ = hosts
        frame = sender.sealer.frame("b", sender.sealer.counter.next(), 0, 2, b"x").SerializeToString()
        for name, payload in (("garbage", b"\xff\xff\xff"), ("huge", None),
                              ("padded", frame + b"\x7a\x80\x80\x01" + bytes(1 << 14))):
            method = "Forward" if name == "padded" else "Ping"
            reader, writer = await host_a.open_stream(receiver.address,
                                                      protocol_name(f"/tahnode.StageService/{method}"))
            if payload is None:
                writer.write(bytes([RecordKind.MESSAGE]) + (MAX_RECORD_BYTES + 1).to_bytes(4, "big"))
            else:
                await write_record(writer, RecordKind.MESSAGE, payload)
            await writer.drain()
            kind, data = await asyncio.wait_for(read_record(reader), 10)
            out[name] = (kind, pb.RpcStatus.FromString(data).code)
            writer.close()
        reply = await stub.Ping(sender.sealer.seal(pb.PingRequest(nonce=b"again"), "b"), timeout=10)
        out["after"] = reply.nonce
        await close(sender, receiver, *hosts)
        return out

    out = asyncio.run(scenario())
    assert out["ping"] == ("b", b"12345678")
    assert out["forged"] is grpc.StatusCode.UNAUTHENTICATED
    assert out["replayed"] is grpc.StatusCode.PERMISSION_DENIED
    assert out["measure"] is grpc.StatusCode.UNAVAILABLE  # "b" has joined no coordinator
    assert out["garbage"] == (RecordKind.STATUS, grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert out["huge"] == (RecordKind.STATUS, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    assert out["padded"] == (RecordKind.STATUS, grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert out["after"] == b"again"


def test_idle_streams_of_one_peer_neither_block_others_nor_stay_open(monkeypatch):
    """Issue 26, finding 8: the call limit was counted before authentication, per libp2p peer id, with
    no read deadline; relayed calls all arrive under the relay's id, so 16 idle streams from one
    token holder blocked every relayed call to a node behind NAT. Now a stream waits for its first
    request at most FIRST_RECORD_S, and calls count against the authenticated sender."""
    from tahnode.net.p2p import rpc as p2p_rpc

    monkeypatch.setattr(p2p_rpc, "FIRST_RECORD_S", 1.0)

    async def scenario():
        sender, receiver, hosts = await pair()
        host_a, _ = hosts
        idle = [await host_a.open_stream(receiver.address, protocol_name("/tahnode.v1.StageService/Ping"))
                for _ in range(24)]
        stub = pb_grpc.StageServiceStub(open_channel(receiver.address, b"", []))
        # same libp2p peer
        reply = await stub.Ping(sender.sealer.seal(pb.PingRequest(nonce=b"through"), "b"), timeout=10)
        closed = 0
        for reader, writer in idle:
            kind, data = await asyncio.wait_for(read_record(reader), 10)  # each idle one is told, then closed
            closed += (kind is RecordKind.STATUS
                       and pb.RpcStatus.FromString(data).code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
            writer.close()
        await close(sender, receiver, *hosts)
        return reply.nonce, closed

    nonce, closed = asyncio.run(scenario())
    assert nonce == b"through" and closed == 24


def test_calls_that_name_a_neighbour_count_against_it_only_when_it_signed_them(monkeypatch):
    """Issue 39, finding 10: p2p call quotas were charged to whatever sender a token MAC names, and
    probes had no idle limit: a token holder held 16 probe calls open in its neighbour's name, and
    the neighbour's own forward stream got RESOURCE_EXHAUSTED. A call counts against a node only
    when that node's key signed it (else against the name and the libp2p peer together); a probe
    sends a chunk every PROBE_IDLE_S."""
    from tahnode.net import grpc_transport
    from tahnode.net.p2p import rpc as p2p_rpc

    monkeypatch.setattr(grpc_transport, "PROBE_IDLE_S", 2.0)

    async def scenario():
        sender, receiver, hosts = await pair()
        host_a, _ = hosts
        forger = Sealer(KEY, "a", identity=NodeKey.generate())  # the token, another key, the neighbour's name
        held = []
        for _ in range(p2p_rpc.CALLS_PER_PEER):
            reader, writer = await host_a.open_stream(receiver.address, protocol_name("/tahnode.v1.StageService/Probe"))
            chunk = forger.seal(pb.ProbeChunk(data=b"x" * 1024), "b")
            await write_record(writer, RecordKind.MESSAGE, chunk.SerializeToString())
            held.append((reader, writer))
        await asyncio.sleep(0.5)
        sender.set_peer(FORWARD, "b", receiver.address)
        env = pb.Envelope(micro_batch=pb.MicroBatch(index=7, tensor=pb.EncodedTensor(payload=b"y" * 1000)))
        sent = await sender.send(FORWARD, env, sender.generation(FORWARD))
        item = await asyncio.wait_for(receiver.inbox.get(), 10)
        while item.envelope is None:  # a stream's opening, before its envelopes
            item = await asyncio.wait_for(receiver.inbox.get(), 10)
        told = []
        for reader, writer in held:  # each idle probe is ended with DEADLINE_EXCEEDED
            kind, data = await asyncio.wait_for(read_record(reader), 10)
            told.append(kind is RecordKind.STATUS and pb.RpcStatus.FromString(data).code)
            writer.close()
        await close(sender, receiver, *hosts)
        return sent, item.sender, item.envelope.micro_batch.index, told

    sent, who, index, told = asyncio.run(scenario())
    assert sent and (who, index) == ("a", 7)
    assert told == [grpc.StatusCode.DEADLINE_EXCEEDED.value[0]] * p2p_rpc.CALLS_PER_PEER


def test_a_link_to_a_peer_that_went_away_fails_and_moves_its_generation_on():
    async def scenario():
        sender, receiver, hosts = await pair()
        downs = []
        sender.on_link_down(lambda direction, reason: downs.append(direction))
        sender.set_peer(BACKWARD, "b", receiver.address)
        await sender.send(BACKWARD, pb.Envelope(step_end=pb.StepEnd(step=1)), sender.generation(BACKWARD))
        item = await asyncio.wait_for(receiver.inbox.get(), 10)
        while item.envelope is None:
            item = await asyncio.wait_for(receiver.inbox.get(), 10)
        await close(receiver, hosts[1])
        deadline = time.monotonic() + 20
        while not downs and time.monotonic() < deadline:
            await sender.send(BACKWARD, pb.Envelope(step_end=pb.StepEnd(step=2)), sender.generation(BACKWARD))
            await asyncio.sleep(0.2)
        generation = sender.generation(BACKWARD)
        await close(sender, hosts[0])
        return item.envelope.step_end.step, downs, generation

    step, downs, generation = asyncio.run(scenario())
    assert step == 1 and downs and downs[0] is BACKWARD and generation >= 1


def test_the_directory_believes_only_entries_made_with_the_swarm_token():
    async def scenario():
        first = await P2PHost.start(LOOPBACK)
        address = (await first.maddrs())[0]
        second = await P2PHost.start(P2PSettings(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=[address]))
        ours, theirs = SwarmDirectory(first.dht, KEY), SwarmDirectory(second.dht, KEY)
        real = TlsCertificate.generate()
        await ours.publish(COORDINATOR_KIND, "",
                           {"grpc": "10.0.0.1:7000", "p2p": address, "fingerprint": real.fingerprint}, signer=real)
        await ours.publish(NODE_KIND, "n1", {"stage": 1, "address": address})
        # a forger without the token writes under our prefix: readers drop its entry
        forged = pb.DirectoryRecord(kind=NODE_KIND, name="n2", json="{}", expires=time.time() + 60, mac=b"\0" * 32)
        from hivemind.utils import get_dht_time

        await asyncio.to_thread(second.dht.store, f"{theirs.prefix}/{NODE_KIND}", forged.SerializeToString(),
                                get_dht_time() + 60, subkey="n2")
        found = await theirs.coordinator(timeout=10)
        nodes = await theirs.read(NODE_KIND)
        other = await SwarmDirectory(second.dht, SwarmKey("another-token")).read(NODE_KIND)
        await close(second, first)
        return found, nodes, other

    found, nodes, other = asyncio.run(scenario())
    assert found.grpc == "10.0.0.1:7000" and found.address_for(p2p=True).startswith("/ip4/127.0.0.1/")
    assert nodes == {"n1": {"stage": 1, "address": nodes["n1"]["address"]}}
    assert other == {}


def test_the_coordinator_cannot_be_impersonated_through_the_dht():
    """Issue 26, finding 4: a coordinator entry was authenticated by the token's MAC alone, so any
    volunteer published one with its own address and fingerprint and a far-future expiry, and
    joiners that found the coordinator through the DHT pinned the impostor. Now each entry is signed
    by its certificate and filed under its fingerprint: a pinned joiner finds the real one, an
    unpinned one refuses to choose, and unsigned or far-future entries are dropped."""
    from hivemind.utils import get_dht_time

    from tahnode.net.errors import UntrustedCoordinator

    async def scenario():
        first = await P2PHost.start(LOOPBACK)
        address = (await first.maddrs())[0]
        second = await P2PHost.start(P2PSettings(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=[address]))
        real, impostor, eternal = TlsCertificate.generate(), TlsCertificate.generate(), TlsCertificate.generate()
        coordinator, volunteer, joiner = (SwarmDirectory(first.dht, KEY), SwarmDirectory(second.dht, KEY),
                                          SwarmDirectory(second.dht, KEY))
        await coordinator.publish(COORDINATOR_KIND, "",
                                  {"grpc": "10.0.0.1:7000", "p2p": "", "fingerprint": real.fingerprint}, signer=real)
        alone = await joiner.coordinator(timeout=10)
        await volunteer.publish(COORDINATOR_KIND, "",
                                {"grpc": "10.6.6.6:7000", "p2p": "", "fingerprint": eternal.fingerprint},
                                ttl=10**6, signer=eternal)  # it would outlive the real one: dropped
        await volunteer.publish(COORDINATOR_KIND, "",
                                {"grpc": "10.6.6.7:7000", "p2p": "", "fingerprint": impostor.fingerprint},
                                signer=impostor)
        unsigned = KEY.sign(pb.DirectoryRecord(kind=COORDINATOR_KIND, json='{"grpc": "10.6.6.8:7000"}',
                                               expires=time.time() + 60))
        await asyncio.to_thread(second.dht.store, f"{joiner.prefix}/{COORDINATOR_KIND}", unsigned.SerializeToString(),
                                get_dht_time() + 60, subkey=COORDINATOR_KIND)
        pinned = await joiner.coordinator(timeout=10, pin=real.fingerprint)
        claims = await joiner.coordinators()
        try:
            await joiner.coordinator(timeout=1)
            unpinned = None
        except UntrustedCoordinator as exc:
            unpinned = str(exc)
        await close(second, first)
        return alone, pinned, claims, unpinned

    alone, pinned, claims, unpinned = asyncio.run(scenario())
    assert alone.grpc == pinned.grpc == "10.0.0.1:7000"
    # signed, live, each under its own name
    assert {r.grpc for r in claims.values()} == {"10.0.0.1:7000", "10.6.6.7:7000"}
    assert unpinned is not None and "--coordinator-fingerprint" in unpinned


def test_a_node_that_trusted_a_coordinator_never_takes_an_insiders_entry(tmp_path, monkeypatch):
    """Issue 39, finding 11: a joiner without --coordinator-fingerprint took an insider's signed
    coordinator entry whenever it was the only one in the DHT. A node trusts the only entry on first
    use and keeps its certificate (coordinator.crt, as for TLS); later it takes that one only."""
    from tahnode.config import NodeConfig
    from tahnode.daemon import p2p
    from tahnode.net.errors import CoordinatorNotFound

    monkeypatch.setattr(p2p, "FIND_WAIT_S", 2.0)
    remembered, cfg = tmp_path / "coordinator.crt", NodeConfig(token="test-token")

    async def scenario():
        first = await P2PHost.start(LOOPBACK)
        second = await P2PHost.start(P2PSettings(listen=["/ip4/127.0.0.1/tcp/0"],
                                                 initial_peers=[(await first.maddrs())[0]]))
        real, insider = TlsCertificate.generate(), TlsCertificate.generate()
        await SwarmDirectory(first.dht, KEY).publish(COORDINATOR_KIND, "", {"grpc": "10.0.0.1:7000", "p2p": "",
                                                                            "fingerprint": real.fingerprint}, ttl=3,
                                                     signer=real)
        trusted = await p2p.find_coordinator(cfg, second, KEY, remembered)  # the only one: trusted on first use
        await asyncio.sleep(4)  # the real coordinator's entry expired (it is down); an insider's is the only one
        await SwarmDirectory(first.dht, KEY).publish(COORDINATOR_KIND, "", {"grpc": "10.6.6.6:7000", "p2p": "",
                                                                            "fingerprint": insider.fingerprint},
                                                     signer=insider)
        try:
            await p2p.find_coordinator(cfg, second, KEY, remembered)
            refused = None
        except CoordinatorNotFound as exc:
            refused = str(exc)
        # a node that never joined before
        taken = await p2p.find_coordinator(cfg, second, KEY, tmp_path / "elsewhere.crt")
        await close(second, first)
        return trusted, refused, taken, real.fingerprint

    trusted, refused, taken, real = asyncio.run(scenario())
    assert trusted.address == "10.0.0.1:7000" and trusted.fingerprint == real
    assert refused is not None and str(remembered) in refused and real in refused
    assert taken.address == "10.6.6.6:7000"  # first use: what --coordinator-fingerprint is for


def test_a_daemon_that_cannot_start_says_why_within_seconds():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]

    async def attempt(settings: P2PSettings, dht: bool = True):
        start = time.monotonic()
        with pytest.raises(P2PStartFailed) as info:
            await P2PHost.start(settings, dht=dht)
        return str(info.value), time.monotonic() - start

    async def scenario():
        return [await attempt(P2PSettings(listen=[f"/ip4/127.0.0.1/tcp/{port}"])),
                await attempt(P2PSettings(listen=["/ip4/127.0.0.1/tcpx/1"])),
                await attempt(P2PSettings(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=[
                    "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRpKLBd3mw8EqcUMKgnqNYVcUyJjiwDCFFQmUh5JFGvHL"]))]

    results = asyncio.run(scenario())
    taken.close()
    assert "is taken by another process" in results[0][0]
    assert "is not a multiaddr" in results[1][0]
    assert "did not start" in results[2][0]
    assert all(seconds < 20 for _, seconds in results)


def test_an_unreachable_peer_is_an_unavailable_call():
    async def scenario():
        host = await P2PHost.start(LOOPBACK, dht=False)
        other = await P2PHost.start(LOOPBACK, dht=False)
        gone = await other.address()
        await other.close()
        P2PHost._current = host
        stub = pb_grpc.StageServiceStub(open_channel(gone, b"", []))
        try:
            await stub.Ping(pb.PingRequest(nonce=b"x"), timeout=30)
            code = None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        with pytest.raises(PeerUnreachable):
            await host.connect(gone)
        await host.close()
        return code

    assert asyncio.run(scenario()) is grpc.StatusCode.UNAVAILABLE


def run_cli(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tahnode.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TAHNODE_TOKEN": "test-token", **(env or {})})
    return done, time.monotonic() - start


def test_join_and_coordinator_end_within_seconds_with_one_line_when_p2p_cannot_start(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmTyedzTAa5UGo2wHDCZDpeNT2phPS6dPv6Jhp1P8H5neS"
    join = ["join", "--transport", "p2p", "--checkpoint-dir", str(tmp_path / "n"), "--device", "cpu"]
    cases = [
        (join + ["--p2p-listen", f"/ip4/127.0.0.1/tcp/{port}", "--initial-peers", nobody],
         "is taken by another process"),
        (join + ["--initial-peers", nobody], "the p2p daemon did not start"),
        (join + ["--initial-peers", "/ip4/127.0.0.1/tcpx/9"], "is not a multiaddr"),
        (join + ["--use-auto-relay", "--coordinator", "127.0.0.1:1"], "--use-auto-relay needs --initial-peers"),
        (["coordinator", "--transport", "p2p", "--store", str(tmp_path / "store"), "--http", "127.0.0.1:0",
          "--p2p-listen", f"/ip4/127.0.0.1/tcp/{port}"], "is taken by another process"),
    ]
    try:
        for args, reason in cases:
            done, seconds = run_cli(*args)
            last = done.stderr.strip().splitlines()[-1]
            assert (done.returncode != 0 and reason in last
                    and "Traceback" not in done.stderr), (args, done.stderr[-2000:])
            assert seconds < 30, (args, seconds)
    finally:
        taken.close()


def test_without_hivemind_the_p2p_transport_says_how_to_install_it(tmp_path):
    fake = tmp_path / "site" / "hivemind"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no hivemind in this environment')\n")
    done, _ = run_cli("join", "--transport", "p2p", "--initial-peers",
                      "/ip4/127.0.0.1/tcp/9/p2p/QmTyedzTAa5UGo2wHDCZDpeNT2phPS6dPv6Jhp1P8H5neS",
                      "--checkpoint-dir", str(tmp_path / "n"), env={"PYTHONPATH": str(tmp_path / "site")})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (done.stderr.strip().splitlines()[-1]
            == "tahnode join: the p2p transport needs hivemind: pip install 'tahnode[p2p]'")


def test_a_peer_behind_a_relay_gets_whole_envelopes_through_it_and_only_token_holders_may_use_it():
    """libp2p's own relays reset a connection after 128 KiB; tahnode's relay carries megabytes."""
    from tahnode.net.p2p.host import use_swarm_key
    from tahnode.tools.swarm import free_port

    count, size = 6, 1_500_000

    async def scenario():
        use_swarm_key(KEY)
        port = free_port()
        relay = await P2PHost.start(P2PSettings(listen=[f"/ip4/127.0.0.1/tcp/{port}"],
                                                announce=[f"/ip4/127.0.0.1/tcp/{port}"]),
                                    dht=False)
        relay_address = (await relay.maddrs())[0]
        ka, kb = NodeKey.generate(), NodeKey.generate()
        behind = await P2PHost.start(P2PSettings(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=[relay_address]),
                                     dht=False)
        receiver = P2PTransport(Sealer(KEY, "b", identity=kb), behind)
        receiver.peer_keys["a"] = ka.public
        await receiver.start()
        dialer = await P2PHost.start(LOOPBACK, dht=False)  # the process's host: channels dial from it
        sender = P2PTransport(Sealer(KEY, "a", identity=ka), dialer)
        await sender.start()
        only_through_relay = f"{relay_address}/p2p-circuit/p2p/{behind.peer_id}"
        sender.set_peer(FORWARD, "b", only_through_relay)
        for k in range(count):
            env = pb.Envelope(micro_batch=pb.MicroBatch(index=k, tensor=pb.EncodedTensor(payload=bytes([k]) * size)))
            assert await sender.send(FORWARD, env, sender.generation(FORWARD))
        got = []
        while len(got) < count:
            item = await asyncio.wait_for(receiver.inbox.get(), 60)
            receiver.inbox_bytes.release(item.nbytes)
            if item.envelope is not None:
                got.append((item.envelope.micro_batch.index,
                            payload_of(item) == bytes([item.envelope.micro_batch.index]) * size))
        await sender.flush(30)
        use_swarm_key(SwarmKey("another-token"))  # a caller without this swarm's token is refused by the relay
        with pytest.raises(PeerUnreachable, match="failed authentication"):
            await dialer.open_stream(only_through_relay, protocol_name("/tahnode.StageService/Ping"))
        use_swarm_key(KEY)
        relayed = relay.relayed_bytes
        await close(sender, receiver, dialer, behind, relay)
        return got, sender.counters(FORWARD).failures, relayed

    got, failures, relayed = asyncio.run(scenario())
    assert got == [(k, True) for k in range(count)] and failures == 0
    assert relayed > count * size  # every byte went through the relay

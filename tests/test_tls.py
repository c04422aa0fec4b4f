"""TLS: certificates kept and shown, the coordinator pinned by fingerprint or on first use, and a
real swarm whose recorded traffic reads in clear without TLS and not with it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import threading

import grpc
import pytest
from swarm import TAHNODE, Swarm
from tahnode.config import TlsMode
from tahnode.net.errors import CoordinatorTlsMismatch, UntrustedCoordinator
from tahnode.net.tls import (
    CERT_FILE,
    KEY_FILE,
    CoordinatorTrust,
    NotTls,
    TlsCertificate,
    add_port,
    fetch_certificate,
    fingerprint,
    is_loopback,
    open_grpc_channel,
    wants_tls,
)
from tahnode.proto import tahnode_pb2 as pb
from tahnode.proto import tahnode_pb2_grpc as pb_grpc

SMALL = ["--micro-batches", "2", "--batch-size", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("address,loopback", [("127.0.0.1:7000", True), ("127.8.9.1:1", True), ("[::1]:7000", True),
                                              ("localhost:80", True), ("10.0.0.2:7000", False), ("0.0.0.0:7000", False),
                                              ("[::]:7000", False), ("example.org:7000", False)])
def test_tls_is_wanted_off_loopback_unless_forced_or_refused(address, loopback):
    assert is_loopback(address) is loopback
    assert wants_tls(TlsMode.AUTO, address) is not loopback
    assert wants_tls(TlsMode.ON, address) and not wants_tls(TlsMode.OFF, address)


def test_a_certificate_is_made_once_kept_private_and_shown_by_tahnode_certs(tmp_path):
    made = TlsCertificate.load_or_create(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / KEY_FILE).st_mode) == 0o600
    again = TlsCertificate.load_or_create(tmp_path)
    assert again == made and again.fingerprint == fingerprint((tmp_path / CERT_FILE).read_bytes())
    assert made.fingerprint.startswith("sha256:") and len(made.fingerprint) == 7 + 64
    assert TlsCertificate.generate().fingerprint != made.fingerprint
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / KEY_FILE).write_bytes(b"left over")  # a key without its certificate, readable by all
    os.chmod(tmp_path / "half" / KEY_FILE, 0o644)
    TlsCertificate.load_or_create(tmp_path / "half")
    assert stat.S_IMODE(os.stat(tmp_path / "half" / KEY_FILE).st_mode) == 0o600  # made anew, never written into
    out = subprocess.run([*TAHNODE, "certs", "--dir", str(tmp_path), "--json"], capture_output=True, text=True,
                         check=True)
    shown = json.loads(out.stdout)
    assert shown["fingerprint"] == made.fingerprint and shown["made"] is False
    fresh = subprocess.run([*TAHNODE, "certs", "--dir", str(tmp_path / "new")], capture_output=True, text=True,
                           check=True)
    assert f"--coordinator-fingerprint {TlsCertificate.load_or_create(tmp_path / 'new').fingerprint}" in fresh.stdout


class EchoPing(pb_grpc.StageServiceServicer):
    async def Ping(self, request, context):
        return pb.PingReply(nonce=request.nonce, node_id="echo")


class Server:
    """A StageService answering Ping, over TLS with `cert` or plain, on its own loop thread."""

    def __init__(self, cert: TlsCertificate | None):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.address = self.call(self._start(cert))

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, cert):
        self.server = grpc.aio.server()
        pb_grpc.add_StageServiceServicer_to_server(EchoPing(), self.server)
        port = add_port(self.server, "127.0.0.1:0", cert)
        await self.server.start()
        return f"127.0.0.1:{port}"

    def ping(self, pinned: bytes) -> grpc.StatusCode:
        async def ping():
            async with open_grpc_channel(self.address, pinned, []) as channel:
                try:
                    await pb_grpc.StageServiceStub(channel).Ping(pb.PingRequest(nonce=b"n"), timeout=3)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

        return self.call(ping())

    def stop(self):
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def tls_server():
    cert = TlsCertificate.generate()
    server = Server(cert)
    yield server, cert
    server.stop()


@pytest.fixture
def plain_server():
    server = Server(None)
    yield server
    server.stop()


def test_a_channel_reaches_only_the_server_holding_the_pinned_certificate(tls_server, plain_server):
    server, cert = tls_server
    assert server.ping(cert.cert_pem) is grpc.StatusCode.OK
    # another key: handshake fails
    assert server.ping(TlsCertificate.generate().cert_pem) is grpc.StatusCode.UNAVAILABLE
    assert server.ping(b"") is grpc.StatusCode.UNAVAILABLE                                  # plain client, TLS server
    assert plain_server.ping(cert.cert_pem) is grpc.StatusCode.UNAVAILABLE                  # TLS client, plain server
    assert plain_server.ping(b"") is grpc.StatusCode.OK
    assert fingerprint(fetch_certificate(server.address)) == cert.fingerprint
    with pytest.raises(NotTls):
        fetch_certificate(plain_server.address)


def test_the_coordinator_is_trusted_on_first_use_then_only_that_certificate(tls_server, tmp_path):
    server, cert = tls_server
    remembered = tmp_path / "coordinator.crt"
    first = asyncio.run(CoordinatorTrust(TlsMode.AUTO, "", remembered).certificate(server.address))
    assert first == remembered.read_bytes() and fingerprint(first) == cert.fingerprint
    assert asyncio.run(CoordinatorTrust(TlsMode.AUTO, "", remembered).certificate(server.address)) == first
    remembered.write_bytes(TlsCertificate.generate().cert_pem)  # this node trusted another coordinator before
    with pytest.raises(UntrustedCoordinator):
        asyncio.run(CoordinatorTrust(TlsMode.AUTO, "", remembered).certificate(server.address))
    # an explicit pin wins over what was remembered, and is remembered from then on
    assert asyncio.run(CoordinatorTrust(TlsMode.ON, cert.fingerprint.upper().replace("SHA256", "sha256"),
                                        remembered).certificate(server.address)) == first
    assert remembered.read_bytes() == first
    with pytest.raises(UntrustedCoordinator):
        asyncio.run(CoordinatorTrust(TlsMode.ON, TlsCertificate.generate().fingerprint,
                                     tmp_path / "x").certificate(server.address))


def test_a_plain_coordinator_is_used_only_where_tls_is_not_wanted(plain_server, tmp_path):
    remembered = tmp_path / "coordinator.crt"
    # loopback
    assert asyncio.run(CoordinatorTrust(TlsMode.AUTO, "", remembered).certificate(plain_server.address)) == b""
    assert asyncio.run(CoordinatorTrust(TlsMode.OFF, "", remembered).certificate(plain_server.address)) == b""
    with pytest.raises(CoordinatorTlsMismatch):
        asyncio.run(CoordinatorTrust(TlsMode.ON, "", remembered).certificate(plain_server.address))
    assert not remembered.exists()


class RecordingProxy:
    """A plain TCP relay that keeps a copy of every byte it relays (an eavesdropper on the path)."""

    def __init__(self, target: str, avoid: tuple[int, ...] = ()):
        """Relays to `target`; listens on a port not in `avoid`: the kernel may hand out a port that
        the harness chose for the coordinator but that nothing has bound yet."""
        self.target = target
        self.recorded = bytearray()
        self.lock = threading.Lock()
        held = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        while self.sock.getsockname()[1] in avoid:
            held.append(self.sock)
            self.sock = socket.create_server(("127.0.0.1", 0))
        for sock in held:
            sock.close()
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            try:
                upstream = socket.create_connection((host, int(port)))
            except OSError:  # the target is not up yet: the client sees a closed connection and retries
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("tls", ["on", "off"])
def test_recorded_control_traffic_reads_in_clear_only_without_tls(tmp_path, cache, tls):
    """A 3-stage swarm whose nodes reach the coordinator through a recording relay: with TLS the
    recording holds none of the run config, the node ids or the last loss; without it, it does; and
    each node pinned the coordinator's own certificate."""
    swarm = Swarm(tmp_path, cache=cache)
    proxy = RecordingProxy(swarm.coordinator, avoid=(swarm.grpc_port, swarm.http_port))
    try:
        swarm.start_coordinator("--steps", "4", *SMALL, "--tls", tls)
        for k in range(3):
            swarm.join(f"volunteer-{k}", k, "--quiet", "--tls", tls, coordinator=proxy.address)
        state = swarm.wait_finished(4)
        for k in range(3):
            assert swarm.wait_exit(f"volunteer-{k}") == 0
    finally:
        swarm.stop()
        proxy.close()
    recorded = bytes(proxy.recorded)
    assert len(recorded) > 10_000  # joins, heartbeats and the replies went through the relay
    # protobuf doubles
    secrets = [b'"n_layers"', b'"codec"', b"volunteer-1", struct.pack("<d", state["training"]["loss"])]
    found = [s for s in secrets if s in recorded]
    assert found == ([] if tls == "on" else secrets)
    # the data plane served TLS exactly when asked (and trained: its peers dialled it pinning that certificate)
    assert [(tmp_path / "ck" / f"volunteer-{k}" / CERT_FILE).exists() for k in range(3)] == [tls == "on"] * 3
    if tls == "on":
        trusted = [fingerprint((tmp_path / "ck" / f"volunteer-{k}" / "coordinator.crt").read_bytes()) for k in range(3)]
        assert trusted == [TlsCertificate.load_or_create(tmp_path / "store").fingerprint] * 3
        assert "TLS on, certificate sha256:" in swarm.log("coordinator")


@pytest.mark.slow
def test_a_node_refuses_a_coordinator_other_than_the_pinned_one(tmp_path, cache):
    swarm = Swarm(tmp_path, cache=cache)
    try:
        swarm.start_coordinator("--steps", "4", *SMALL, "--tls", "on")
        wrong = TlsCertificate.generate().fingerprint
        node = swarm.join("n0", 0, "--quiet", "--tls", "on", "--coordinator-fingerprint", wrong)
        assert node.wait(60) == 1
        assert f"not the pinned {wrong}" in swarm.log("n0")
        bad = subprocess.run([*TAHNODE, "join", "--coordinator-fingerprint", "abc"], capture_output=True, text=True,
                             env={**swarm.env, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert bad.returncode == 2 and "64 hex digits" in bad.stderr
    finally:
        swarm.stop()

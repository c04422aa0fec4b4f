"""gRPC over TLS with pinned certificates: every process keeps a key and a self-signed certificate
in its state folder (`TlsCertificate`); a node's certificate reaches its peers through the
coordinator (bound to the node's identity by its signed join), and a node trusts the coordinator's
certificate by fingerprint: given with --coordinator-fingerprint, else remembered on first use
(`CoordinatorTrust`). Whether to speak TLS at all is `TlsMode` (on off loopback by default)."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..config.node import TlsMode
from ..config.token import write_secret
from .errors import CoordinatorTlsMismatch, Unreachable, UntrustedCoordinator
from .p2p.host import is_p2p_address

log = logging.getLogger("tahnode.tls")

__all__ = ["TlsCertificate", "CoordinatorTrust", "fingerprint", "signed_by", "is_loopback", "host_of", "wants_tls",
           "open_grpc_channel", "add_port",
           "fetch_certificate", "NotTls", "TLS_NAME", "CERT_FILE", "KEY_FILE", "PINNED_COORDINATOR_FILE"]

TLS_NAME = "tahnode"                          # the name in every certificate; channels check it, not the address
CERT_FILE, KEY_FILE = "tls.crt", "tls.key"    # in the process's state folder
PINNED_COORDINATOR_FILE = "coordinator.crt"   # in a node's state folder: the coordinator it trusted first
VALID_DAYS = 3650


def fingerprint(cert_pem: bytes) -> str:
    """A certificate's SHA-256 over its DER form, as `sha256:` + hex (what `tahnode certs` shows)."""
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def host_of(address: str) -> str:
    """The host of a HOST:PORT address (an IPv6 host without its brackets)."""
    return address.rsplit(":", 1)[0].strip("[]")


def is_loopback(address: str) -> bool:
    """True for HOST:PORT addresses on this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def wants_tls(mode: TlsMode, address: str) -> bool:
    """Whether a server reached at `address` speaks TLS under `mode`."""
    return mode is TlsMode.ON or (mode is TlsMode.AUTO and not is_loopback(address))


@dataclass(frozen=True)
class TlsCertificate:
    """An ECDSA P-256 key and its self-signed certificate (PEM)."""

    key_pem: bytes
    cert_pem: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_pem)

    @classmethod
    def generate(cls) -> TlsCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .sign(key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cls(key_pem, cert.public_bytes(serialization.Encoding.PEM))

    @classmethod
    def load_or_create(cls, folder: Path) -> TlsCertificate:
        """The pair kept in `folder` (tls.key readable by its owner only), made there on first use."""
        key_path, cert_path = folder / KEY_FILE, folder / CERT_FILE
        if key_path.exists() and cert_path.exists():
            return cls(key_path.read_bytes(), cert_path.read_bytes())
        made = cls.generate()
        write_secret(key_path, made.key_pem)
        cert_path.write_bytes(made.cert_pem)
        return made

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])

    def sign(self, data: bytes) -> bytes:
        """ECDSA (SHA-256) signature of `data` by the certificate's key: what the fingerprint vouches for."""
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        return key.sign(data, ec.ECDSA(hashes.SHA256()))


def signed_by(cert_pem: bytes, data: bytes, signature: bytes) -> bool:
    """Whether `signature` is the key of the certificate `cert_pem` signing `data` (False for anything
    malformed: a certificate or signature from a stranger is just wrong)."""
    try:
        public = x509.load_pem_x509_certificate(cert_pem).public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey):
            return False
        public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except Exception:  # InvalidSignature, a malformed PEM or signature
        return False
    return True


def add_port(server: grpc.aio.Server, listen: str, cert: TlsCertificate | None) -> int:
    """Listen on `listen` with TLS under `cert`, or in plain gRPC without one; 0 if it cannot."""
    if cert is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, cert.server_credentials())


def open_grpc_channel(address: str, pinned: bytes, options: list, interceptors=None) -> grpc.aio.Channel:
    """A channel to `address`: TLS trusting exactly the certificate `pinned` (PEM), or plain gRPC
    when `pinned` is empty (the peer serves no TLS)."""
    if not pinned:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    creds = grpc.ssl_channel_credentials(root_certificates=pinned)
    return grpc.aio.secure_channel(address, creds, options=options + [("grpc.ssl_target_name_override", TLS_NAME)],
                                   interceptors=interceptors)


class NotTls(ConnectionError):
    """The server answered, but not with a TLS handshake (it serves plain gRPC)."""


def fetch_certificate(address: str, timeout: float = 5.0) -> bytes:
    """The certificate the TLS server at `address` presents (PEM), not verified: the caller pins it.
    Raises NotTls if the server speaks no TLS, OSError if it cannot be reached."""
    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
        try:
            with ctx.wrap_socket(sock, server_hostname=TLS_NAME) as tls:
                der = tls.getpeercert(binary_form=True)
        except ssl.SSLEOFError as exc:  # closed without a word: not up yet, or a relay without its target
            raise ConnectionResetError(f"{address} closed the connection during the TLS handshake ({exc})") from None
        except ssl.SSLError as exc:  # it answered, in something other than TLS (a plain gRPC server: HTTP/2)
            raise NotTls(f"{address} does not speak TLS ({exc})") from None
    return ssl.DER_cert_to_PEM_cert(der).encode()


class CoordinatorTrust:
    """Which certificate a node pins for its coordinator: the one matching `pin` (a fingerprint)
    if given, else the one this node saw first (kept in `remembered`). A coordinator that serves
    plain gRPC is accepted only where TLS is not wanted (loopback, or --insecure)."""

    def __init__(self, mode: TlsMode, pin: str, remembered: Path):
        self.mode, self.pin, self.remembered = mode, pin.strip().lower(), remembered

    async def certificate(self, address: str) -> bytes:
        """The PEM to pin for the coordinator at `address`; b"" for plain gRPC, and for a p2p address
        (libp2p authenticates the peer id the address ends in)."""
        if self.mode is TlsMode.OFF or is_p2p_address(address):
            return b""
        try:
            pem = await asyncio.to_thread(fetch_certificate, address)
        except NotTls:
            if wants_tls(self.mode, address):
                raise CoordinatorTlsMismatch(
                    f"the coordinator at {address} does not speak TLS; if it runs with --insecure, this node must "
                    "too (--insecure), and then the swarm's traffic travels in clear") from None
            return b""
        except OSError as exc:
            raise Unreachable(f"coordinator {address} cannot be reached: {exc}") from None
        seen = fingerprint(pem)
        if self.pin:
            if seen != self.pin:
                raise UntrustedCoordinator(f"the coordinator at {address} presents certificate {seen}, not the pinned "
                                           f"{self.pin}: refusing to talk to it")
        elif self.remembered.exists():
            trusted = fingerprint(self.remembered.read_bytes())
            if seen != trusted:
                raise UntrustedCoordinator(
                    f"the coordinator at {address} presents certificate {seen}, but this node trusted {trusted} before "
                    f"(kept in {self.remembered}); if the coordinator really changed its certificate, pin the new one "
                    "with --coordinator-fingerprint (its `tahnode certs` shows it) or delete that file")
        else:
            log.warning("trusting the coordinator's certificate %s on first use (kept in %s; pin it with "
                        "--coordinator-fingerprint, which `tahnode certs` on the coordinator shows)", seen,
                        self.remembered)
        self.remembered.parent.mkdir(parents=True, exist_ok=True)
        self.remembered.write_bytes(pem)
        return pem

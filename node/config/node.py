"""What one process is told on its command line: a stage daemon's settings (`NodeConfig`) and the
coordinator's (`CoordinatorConfig`); the run itself is `RunConfig`, handed out by the coordinator."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .emulation import LinkEmulation

__all__ = ["TransportKind", "TlsMode", "NodeConfig", "CoordinatorConfig", "AUTO_STAGE"]

AUTO_STAGE = -1                       # --stage auto: the coordinator chooses


class TransportKind(Enum):
    """How a node's data plane reaches its neighbours."""

    GRPC = "grpc"  # direct gRPC streams: every node must be reachable at its advertised address

    def __str__(self) -> str:
        return self.value


class TlsMode(Enum):
    """Whether a process serves (and expects) gRPC over TLS (tahnode.net.tls)."""

    AUTO = "auto"  # TLS unless the address served or dialled is loopback
    ON = "on"      # always, loopback too
    OFF = "off"    # never: `--insecure`, with a warning off loopback

    def __str__(self) -> str:
        return self.value


@dataclass
class NodeConfig:
    """`tahnode join`: where the coordinator is, which stage to hold, how to serve the data plane."""

    coordinator: str = "127.0.0.1:7000"
    stage: int = AUTO_STAGE
    listen: str = "0.0.0.0:0"
    advertise: str = ""
    device: str = "auto"
    token: str = ""                 # the swarm secret (tahnode.config.token says where it comes from)
    node_id: str = ""
    checkpoint_dir: str = ""
    data_dir: str = ""              # where the built-in corpus is prepared (default: ~/.cache/tahnode)
    init_from: str = ""             # a local Hugging Face checkpoint directory
    progress: bool = True
    threads: int = 0                # torch's CPU threads (0: torch's default, every core); several stages on one machine share them
    transport: TransportKind = TransportKind.GRPC
    tls: TlsMode = TlsMode.AUTO
    coordinator_fingerprint: str = ""  # the coordinator's certificate, pinned ("sha256:..."); "" = trust on first use
    emulation: LinkEmulation = field(default_factory=LinkEmulation)  # test swarms: RTT and rate in user space


@dataclass
class CoordinatorConfig:
    """`tahnode coordinator`: its addresses, the swarm token, failure detection and the store."""

    listen: str = "0.0.0.0:7000"
    http: str = "0.0.0.0:8080"
    token: str = ""                  # the swarm secret (tahnode.config.token.coordinator_token)
    heartbeat_timeout: float = 10.0  # seconds without heartbeats before a node is declared failed
    store: str = "tahnode-store"     # stage checkpoints uploaded by the nodes (for standbys)
    settle_s: float = 3.0            # seconds without joins before --stage auto nodes are placed
    tls: TlsMode = TlsMode.AUTO

"""What one process is told on its command line: a stage daemon's settings (`NodeConfig`) and the
coordinator's (`CoordinatorConfig`); the run itself is `RunConfig`, handed out by the coordinator."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .emulation import LinkEmulation

__all__ = ["TransportKind", "TlsMode", "P2PSettings", "PlacementSettings", "NodeConfig", "CoordinatorConfig",
           "AUTO_STAGE", "DEFAULT_COORDINATOR", "NODE_P2P_LISTEN", "COORDINATOR_P2P_LISTEN"]

AUTO_STAGE = -1                       # --stage auto: the coordinator chooses
DEFAULT_COORDINATOR = "127.0.0.1:7000"  # where a node looks for the coordinator when told nothing
NODE_P2P_LISTEN = "/ip4/0.0.0.0/tcp/0"            # a node's p2p daemon: any port
COORDINATOR_P2P_LISTEN = "/ip4/0.0.0.0/tcp/7001"  # the coordinator's: a fixed port, so its multiaddr stays the same


class TransportKind(Enum):
    """How a node's data plane reaches its neighbours."""

    GRPC = "grpc"  # direct gRPC streams: every node must be reachable at its advertised address
    P2P = "p2p"    # libp2p streams through hivemind (tahnode.net.p2p.host): reachable behind NAT, through relays

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
class P2PSettings:
    """The libp2p side of a process (`--transport p2p`, the coordinator's `--transport p2p|both`);
    hivemind's defaults where it has one."""

    listen: list[str] = field(default_factory=lambda: [NODE_P2P_LISTEN])  # multiaddrs the p2p daemon listens on
    announce: list[str] = field(default_factory=list)       # public multiaddrs to announce instead of the seen ones
    initial_peers: list[str] = field(default_factory=list)  # multiaddrs of peers already in the swarm's DHT
    use_relay: bool = True          # may reach (and be reached) through circuit relays
    use_auto_relay: bool = False    # behind NAT: reserve a slot on a relay so that others can dial in


@dataclass
class NodeConfig:
    """`tahnode join`: where the coordinator is, which stage to hold, how to serve the data plane."""

    # HOST:PORT or multiaddr; "" = through the DHT of --initial-peers, else DEFAULT_COORDINATOR
    coordinator: str = ""
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
    # torch's CPU threads (0: torch's default, every core); several stages on one machine share them
    threads: int = 0
    transport: TransportKind = TransportKind.GRPC
    tls: TlsMode = TlsMode.AUTO
    coordinator_fingerprint: str = ""  # the coordinator's certificate, pinned ("sha256:..."); "" = trust on first use
    emulation: LinkEmulation = field(default_factory=LinkEmulation)  # test swarms: RTT and rate in user space
    p2p: P2PSettings = field(default_factory=P2PSettings)


@dataclass
class PlacementSettings:
    """How the coordinator measures links and places `--stage auto` nodes (tahnode.coordinator.placement)."""

    settle_s: float = 3.0                # seconds without joins before waiting nodes are placed
    probe_wait_s: float = 4.0            # then at most this long for capacity probes and the chain's full probes
    capacity_samples: int = 2            # small probes each node sends and receives (its upload and download)
    capacity_probe_bytes: int = 2 << 20  # payload of one capacity probe
    capacity_probe_timeout_s: float = 15.0
    concurrent_probes: int = 64          # probes running at once (disjoint pairs: no node is in two)
    rebalance_s: float = 30.0            # seconds between rebalancing checks while training (0 = never)
    hysteresis: float = 0.2              # a new chain must cut the bottleneck by this share to replace the current one
    exact_limit: int = 12                # nodes handed to the search at most (the best-ranked ones): searched exactly
    budget_s: float = 2.0                # time budget of one assignment search (off the event loop)
    tick_s: float = 1.0                  # the placement loop's period (failure sweep, placement, rebalancing)
    reform_s: float = 20.0               # a new pipeline refused for its speed is tried (and measured) again after this

    def __post_init__(self):
        for name in ("settle_s", "probe_wait_s", "rebalance_s", "reform_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"placement: {name} must be >= 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"placement: the hysteresis is a share of the bottleneck in [0, 1), got {self.hysteresis}")
        if self.capacity_samples < 1 or self.concurrent_probes < 1:
            raise ValueError("placement: capacity_samples and concurrent_probes must be at least 1")


@dataclass
class CoordinatorConfig:
    """`tahnode coordinator`: its addresses, the swarm token, failure detection and the store."""

    listen: str = "0.0.0.0:7000"
    http: str = "0.0.0.0:8080"
    token: str = ""                  # the swarm secret (tahnode.config.token.coordinator_token)
    heartbeat_timeout: float = 10.0  # seconds without heartbeats before a node is declared failed
    store: str = "tahnode-store"     # stage checkpoints uploaded by the nodes (for standbys)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    tls: TlsMode = TlsMode.AUTO
    transports: tuple[TransportKind, ...] = (TransportKind.GRPC,)  # --transport grpc|p2p|both: where nodes reach it
    p2p: P2PSettings = field(default_factory=lambda: P2PSettings(listen=[COORDINATOR_P2P_LISTEN]))

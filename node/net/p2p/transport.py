"""The data plane on libp2p (`--transport p2p`): the same StageService servicer as gRPC's, served
on this process's P2PHost, with the same links (they dial each peer by its address, p2p or gRPC),
authentication and size bounds. Peers reach it directly, or through a relay when it is behind NAT."""

from __future__ import annotations

from ...config.emulation import LinkEmulation
from ..auth import Sealer
from ..grpc_transport import GrpcTransport, StageServicer
from .host import P2PHost
from .rpc import serve_service
from ..transport import Measurer

__all__ = ["P2PTransport"]


class P2PTransport(GrpcTransport):
    """Transport (tahnode.net.transport) whose address is `host`'s p2p address. The host belongs
    to the caller, who closes it after this transport."""

    def __init__(self, sealer: Sealer, host: P2PHost, measurer: Measurer | None = None,
                 emulation: LinkEmulation = LinkEmulation()):
        super().__init__(sealer, listen="", measurer=measurer, emulation=emulation, tls=None)
        self.host = host

    async def start(self) -> str:
        await serve_service(self.host, "StageService", StageServicer(self), self.sealer.key, self.peer_keys)
        self.address = await self.host.address()
        self.open_links()
        return self.address

    async def close(self) -> None:
        self.close_links()

"""Channels to another tahnode process, whichever carrier its address names: gRPC over HTTP/2 for
HOST:PORT (TLS pinning a certificate, where it has one), libp2p streams for a p2p address
(tahnode.net.p2p.rpc). Generated stubs work on either."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from ..config.emulation import LinkEmulation
from .emulation import interceptors_for
from .p2p.host import is_p2p_address
from .p2p.rpc import P2PChannel
from .tls import open_grpc_channel

__all__ = ["open_channel", "transport_of", "ChannelPool"]


def open_channel(address: str, pinned: bytes, options: list, emulation: LinkEmulation | None = None):
    """A channel to `address`; `pinned`: the TLS certificate (PEM) a gRPC peer must present (b"":
    plain gRPC); `emulation` delays unary calls by its round trip (test swarms)."""
    if is_p2p_address(address):
        return P2PChannel(address, emulation.delay_s if emulation and emulation.rtt_s > 0 else 0.0)
    return open_grpc_channel(address, pinned, options, interceptors_for(emulation) if emulation else None)


def transport_of(address: str) -> str:
    """"p2p" or "grpc": the carrier a peer at `address` is reached over (the status page's links)."""
    return "p2p" if is_p2p_address(address) else "grpc"


class ChannelPool:
    """Channels kept open for reuse (the coordinator asks many nodes, again and again, to measure
    their links): the `size` most recently used stay open; an evicted one closes `linger_s` later,
    after any call still on it."""

    def __init__(self, options: list, size: int = 256, linger_s: float = 90.0):
        self.options, self.size, self.linger_s = options, size, linger_s
        self.channels: OrderedDict[tuple[str, bytes], object] = OrderedDict()

    def get(self, address: str, pinned: bytes):
        key = (address, pinned)
        channel = self.channels.pop(key, None) or open_channel(address, pinned, self.options)
        self.channels[key] = channel
        while len(self.channels) > self.size:
            _, old = self.channels.popitem(last=False)
            asyncio.get_running_loop().call_later(self.linger_s, lambda old=old: asyncio.ensure_future(old.close()))
        return channel

    async def close(self) -> None:
        channels, self.channels = list(self.channels.values()), OrderedDict()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

"""Typed errors of the control plane (node <-> coordinator): each refusal has its own class and
gRPC status code, so a client tells them apart by type, never by the message's text; and of the
libp2p side (P2PError and its kinds)."""

from __future__ import annotations

import grpc

__all__ = ["CoordinatorError", "Unreachable", "Refused", "NotAuthenticated", "NotFresh", "InvalidRequest", "StageTaken",
           "UnknownNode", "Banned", "UntrustedCoordinator", "CoordinatorTlsMismatch", "from_rpc_error", "P2PError",
           "P2PUnavailable", "P2PStartFailed", "PeerUnreachable", "CoordinatorNotFound"]


class CoordinatorError(RuntimeError):
    """The coordinator refused a request, or cannot be reached."""

    code = grpc.StatusCode.UNKNOWN


class Unreachable(CoordinatorError):
    """No answer from the coordinator (down, unreachable, or too slow)."""

    code = grpc.StatusCode.UNAVAILABLE


class Refused(CoordinatorError):
    """The coordinator answered and said no."""


class NotAuthenticated(Refused):
    """The request's MAC does not match: wrong swarm token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class NotFresh(Refused):
    """The request's seal was refused (tahnode.net.freshness): replayed, meant for another run or
    recipient, or sealed off the coordinator's clock (the clocks differ by more than a minute)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class InvalidRequest(Refused):
    """The request is malformed or asks for something that does not exist."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class StageTaken(Refused):
    """The pinned stage is held by another live node."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class UnknownNode(Refused):
    """The coordinator does not know this node (never joined, left, or declared failed)."""

    code = grpc.StatusCode.NOT_FOUND


class Banned(Refused):
    """This node is out of the swarm for a while: its neighbours kept refusing its micro-batches."""

    code = grpc.StatusCode.ABORTED


class UntrustedCoordinator(CoordinatorError):
    """The coordinator's TLS certificate is not the one this node pinned or trusted before."""

    code = grpc.StatusCode.UNAUTHENTICATED


class CoordinatorTlsMismatch(CoordinatorError):
    """The coordinator serves plain gRPC where this node requires TLS (or the other way round)."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE = {cls.code: cls for cls in (NotAuthenticated, NotFresh, InvalidRequest, StageTaken, UnknownNode, Banned)}
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def from_rpc_error(exc: grpc.aio.AioRpcError, address: str, what: str) -> CoordinatorError:
    """The typed error for a failed call `what` (e.g. "join") to the coordinator at `address`."""
    if exc.code() in _UNREACHABLE:
        return Unreachable(f"coordinator {address} cannot be reached: {exc.details()}")
    cls = _BY_CODE.get(exc.code(), Refused)
    return cls(f"coordinator {address} refused the {what}: {exc.details()}")


class P2PError(RuntimeError):
    """The libp2p side (tahnode.net.p2p.host) cannot do what was asked."""


class P2PUnavailable(P2PError):
    """hivemind, which carries tahnode's libp2p transport, is not installed."""


class P2PStartFailed(P2PError):
    """The p2p daemon or the DHT did not start: a taken port, a bad multiaddr, no initial peer answering."""


class PeerUnreachable(P2PError, ConnectionError):
    """No libp2p connection to a peer (at none of its addresses, nor through a relay); a link that
    meets it fails and tries again, as with any broken connection."""


class CoordinatorNotFound(P2PError):
    """The DHT of the initial peers holds no record of this swarm's coordinator."""

"""A slow network emulated in user space, for test swarms where the kernel cannot (no netem here) or
may not (no root) shape links: every message a process sends waits half the round-trip time before
it leaves, and, with a rate, is paced as a link of that rate would carry it (tahnode.config's
`LinkEmulation` says how much).

A `Pacer` per outgoing link keeps messages in order: message k leaves at max(queued + delay,
when k-1 finished), and finishes nbytes*8/rate later. Only what tahnode sends is delayed (its
messages and replies, data and control); TCP's own acknowledgements are not, so TCP windows see no
extra latency."""

from __future__ import annotations

import asyncio
import time

import grpc

from ..config.emulation import LinkEmulation

__all__ = ["Pacer", "DelayInterceptor", "pacer_for", "interceptors_for"]


def pacer_for(emulation: LinkEmulation, peer: str = "") -> "Pacer":
    """The pacer of the outgoing link to node `peer`."""
    return Pacer(emulation.delay_s, emulation.rate_to(peer))


def interceptors_for(emulation: LinkEmulation) -> list:
    """gRPC client interceptors that add the round trip to every unary call (the control plane)."""
    return [DelayInterceptor(emulation.delay_s)] if emulation.rtt_s > 0 else []


class Pacer:
    """When each message of one outgoing link may leave: after its one-way delay, and after the
    previous message's transmission at `rate_bps` (0: instantly)."""

    def __init__(self, delay_s: float, rate_bps: float):
        self.delay_s, self.rate_bps = delay_s, rate_bps
        self.free_at = 0.0

    async def wait(self, nbytes: int, queued_at: float) -> None:
        """Wait until a message of `nbytes` queued at `queued_at` (time.monotonic()) has crossed."""
        now = time.monotonic()
        due = queued_at + self.delay_s
        if self.rate_bps > 0:
            start = max(now, self.free_at)
            self.free_at = start + nbytes * 8 / self.rate_bps
            due = max(due, self.free_at)
        if due > now:
            await asyncio.sleep(due - now)


class DelayInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Delays a unary call's request and its reply by `delay_s` each."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        await asyncio.sleep(self.delay_s)
        call = await continuation(client_call_details, request)
        response = await call
        await asyncio.sleep(self.delay_s)
        return response

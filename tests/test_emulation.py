"""The user-space network emulation: its units, the pacing arithmetic (on a fake clock), and the
in-process transport delivering later and slower when told so (messages in order, none lost)."""

from __future__ import annotations

import asyncio

import pytest

from tahnode.config import LinkEmulation, parse_duration, parse_rate
from tahnode.net import emulation
from tahnode.net.emulation import Pacer, pacer_for
from tahnode.net.inproc import InProcessNetwork
from tahnode.net.transport import FORWARD
from tahnode.proto import tahnode_pb2 as pb


def test_units_and_flags_round_trip():
    assert (parse_rate("50mbit") == 50e6 and parse_rate("1gbit") == 1e9 and parse_rate("200kbit") == 2e5
            and parse_rate("20") == 20e6)
    assert parse_duration("50ms") == 0.05 and parse_duration("0.2s") == 0.2 and parse_duration("40") == 0.04
    for bad in ("fast", "-3mbit", "10 parsecs"):
        with pytest.raises(ValueError, match="not a rate"):
            parse_rate(bad)
    emu = LinkEmulation.parse("50ms", "20mbit", ["n3=10mbit"])
    assert (emu.delay_s, emu.rate_to("n2"), emu.rate_to("n3")) == (0.025, 20e6, 10e6)
    assert LinkEmulation.parse(*_unflag(emu.flags())) == emu
    with pytest.raises(ValueError, match="PEER=RATE"):
        LinkEmulation.parse(peer_rates=["n3"])
    assert not LinkEmulation().active and emu.active


def _unflag(flags: list[str]) -> tuple:
    d = {"--emulate-rtt": "", "--emulate-rate": "", "--emulate-link": []}
    for k, v in zip(flags[::2], flags[1::2]):
        if k == "--emulate-link":
            d[k].append(v)
        else:
            d[k] = v
    return d["--emulate-rtt"], d["--emulate-rate"], d["--emulate-link"]


class FakeClock:
    def __init__(self, monkeypatch):
        self.now = 100.0
        monkeypatch.setattr(emulation.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(emulation.asyncio, "sleep", self.sleep)

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_pacer_delays_once_and_serializes_at_the_rate(monkeypatch):
    """Three 125 000-byte messages queued together on a 10 Mbit/s link with 25 ms one-way delay:
    the first arrives after its transmission (0.1 s) plus nothing more (the delay overlaps it), the
    next two 0.1 s apart; a message queued on an idle link waits the delay only if it is longer."""
    clock = FakeClock(monkeypatch)
    pacer = Pacer(delay_s=0.025, rate_bps=10e6)
    start = clock.now

    async def send_three():
        times = []
        for _ in range(3):
            await pacer.wait(125_000, start)
            times.append(round(clock.now - start, 6))
        return times

    assert asyncio.run(send_three()) == [0.1, 0.2, 0.3]
    clock.now += 5.0  # idle link; a small message: only the delay counts
    queued = clock.now
    asyncio.run(pacer.wait(100, queued))
    assert clock.now - queued == pytest.approx(0.025)
    plain = Pacer(0.0, 0.0)
    before = clock.now
    asyncio.run(plain.wait(10**9, before))
    assert clock.now == before
    assert pacer_for(LinkEmulation(0.05, 20e6, {"n3": 5e6}), "n3").rate_bps == 5e6


def test_an_emulated_in_process_link_delivers_in_order_and_later():
    """On the real clock, as a lower bound only: with 40 ms of RTT every envelope arrives at least
    20 ms after it was sent, in order, none lost."""
    emu = LinkEmulation(rtt_s=0.04)

    async def scenario():
        net = InProcessNetwork()
        a, b = net.transport("a", emulation=emu), net.transport("b")
        await a.start()
        await b.start()
        a.set_peer(FORWARD, "b", "b")
        loop = asyncio.get_running_loop()
        sent = []
        for k in range(5):
            sent.append(loop.time())
            await a.send(FORWARD, pb.Envelope(shutdown=pb.Shutdown(step=k)), a.generation(FORWARD))
        got = []
        while len(got) < 5:
            item = await asyncio.wait_for(b.inbox.get(), 5)
            if item.envelope is not None:
                got.append((item.envelope.shutdown.step, loop.time()))
        await a.close()
        await b.close()
        return sent, got

    sent, got = asyncio.run(scenario())
    assert [step for step, _ in got] == [0, 1, 2, 3, 4]
    assert all(t - s >= 0.02 for (_, t), s in zip(got, sent))

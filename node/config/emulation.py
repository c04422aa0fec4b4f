"""How a test swarm's slow network is emulated in user space (`LinkEmulation`): a round-trip time
added to every message, and rates at which outgoing links are paced; with the parsers of the
command line's units ("50ms", "20mbit"). tahnode.net.emulation applies it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["LinkEmulation", "parse_rate", "parse_duration"]

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gbit|mbit|kbit|bit)?\s*$", re.I)
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$", re.I)
_RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str) -> float:
    """Bits per second of "50mbit", "1gbit", "200kbit" or a bare number of Mbit/s ("50")."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(f"not a rate: {text!r} (say e.g. 50mbit, 1gbit or 200kbit)")
    return float(m[1]) * _RATE_UNITS[(m[2] or "mbit").lower()]


def parse_duration(text: str) -> float:
    """Seconds of "50ms", "0.2s", "300us" or a bare number of milliseconds ("50")."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (say e.g. 50ms or 0.2s)")
    return float(m[1]) * _DURATION_UNITS[(m[2] or "ms").lower()]


@dataclass(frozen=True)
class LinkEmulation:
    """rtt_s: round-trip time added between this process and every peer (half each way);
    rate_bps: pace every outgoing link at this rate (0: unpaced); peer_rates: other rates for some
    peers, by node id (a slow link)."""

    rtt_s: float = 0.0
    rate_bps: float = 0.0
    peer_rates: dict[str, float] = field(default_factory=dict)

    @property
    def delay_s(self) -> float:
        """One-way delay."""
        return self.rtt_s / 2

    @property
    def active(self) -> bool:
        return self.rtt_s > 0 or self.rate_bps > 0 or bool(self.peer_rates)

    def rate_to(self, peer: str) -> float:
        return self.peer_rates.get(peer, self.rate_bps)

    @classmethod
    def parse(cls, rtt: str = "", rate: str = "", peer_rates: list[str] | None = None) -> "LinkEmulation":
        """From the flags: --emulate-rtt 50ms, --emulate-rate 20mbit, --emulate-link PEER=RATE."""
        peers = {}
        for item in peer_rates or []:
            peer, sep, value = item.partition("=")
            if not sep or not peer:
                raise ValueError(f"--emulate-link takes PEER=RATE (e.g. n3=10mbit), got {item!r}")
            peers[peer] = parse_rate(value)
        return cls(parse_duration(rtt) if rtt else 0.0, parse_rate(rate) if rate else 0.0, peers)

    def flags(self) -> list[str]:
        """The command-line flags that give this emulation (the inverse of `parse`)."""
        out = []
        if self.rtt_s:
            out += ["--emulate-rtt", f"{self.rtt_s * 1e3:g}ms"]
        if self.rate_bps:
            out += ["--emulate-rate", f"{self.rate_bps / 1e6:g}mbit"]
        for peer, rate in sorted(self.peer_rates.items()):
            out += ["--emulate-link", f"{peer}={rate / 1e6:g}mbit"]
        return out

"""The swarm as the status page shows it: nodes, measured links, training progress, the loss
history and events (`swarm_state`, the /api/v1/state document), and the ledger of sample ids."""

from __future__ import annotations

import asyncio
import json
import math

from ..net.channels import transport_of
from ..proto import tahnode_pb2 as pb
from .links import ProbeKind
from .placement import Placement, chain_links
from .registry import SwarmRegistry
from .state import NodeRecord, NodeStatus

__all__ = ["swarm_state", "ledger_json", "all_links", "LedgerDocument"]

OUTER_KEYS = 16  # figures of a node's outer steps shown (a heartbeat's map is the node's to fill)


def latest_on(r: SwarmRegistry, stage: int) -> NodeRecord | None:
    """The active holder of a stage, else the node that held it last (for finished runs)."""
    held = r.roster.holder(stage)
    if held:
        return held
    former = [n for n in r.nodes.values() if n.stage == stage]
    return max(former, key=lambda n: n.last_seen) if former else None


def training(r: SwarmRegistry) -> dict:
    """The swarm's training: the first pipeline's step and loss (the loss stage's: stage 0 of a ring),
    the tokens/s of every pipeline together."""
    last = latest_on(r, r.run.loss_stage)
    senders = [n for n in r.nodes.values() if n.stage >= 0 and n.stats.forward_bits_per_element > 0]
    fw = sum(n.stats.forward_bits_per_element for n in senders) / len(senders) if senders else 0.0
    s = last.stats if last else pb.TrainingStats()
    loss_holders = [h for p in r.roster.pipelines() if (h := r.roster.holder(r.run.loss_stage, p)) is not None]
    return {
        "step": int(s.step),
        "loss": s.loss if last and s.step else None,
        "tokens_per_s": sum(h.stats.tokens_per_s for h in loss_holders) if len(loss_holders) > 1 else s.tokens_per_s,
        "bits_per_element": fw,
        "backward_bits_per_element": s.backward_bits_per_element,
        "loss_first": s.loss_first if last and s.step else None,
        "wire_bytes": sum(n.stats.wire_bytes for n in r.nodes.values()),
        "uncompressed_bytes": sum(n.stats.uncompressed_bytes for n in r.nodes.values()),
        "finished": bool(last and s.finished) if not r.roster.finished else r.finished,
        "replays": sum(n.stats.replays for n in r.nodes.values()),
        "aqsgd_cache_bytes": sum(n.stats.aqsgd_cache_bytes for n in r.nodes.values() if n.status is NodeStatus.ACTIVE),
        "peak_rss_bytes": max((n.stats.peak_rss_bytes for n in r.nodes.values() if n.stage >= 0), default=0),
        "steps_total": r.run.train.steps,
    }


def pipelines(r: SwarmRegistry, placement: Placement) -> list[dict]:
    """Every pipeline: its nodes stage by stage (None: open), whether it trains, its step and tokens/s
    (its loss stage's), and the measured Mbit/s of its links, forward and backward."""
    out = []
    book = placement.book
    for p in r.roster.pipelines():
        holders = [r.roster.holder(k, p) for k in range(r.run.stages)]
        loss = holders[r.run.loss_stage]
        chain = [h.node_id if h else None for h in holders]
        links = [{"src": a, "dst": b, "mbps": book.estimate(a, b), "back_mbps": book.estimate(b, a)}
                 for a, b in zip(chain, chain[1:]) if a and b]
        out.append({"index": p, "nodes": chain, "complete": None not in chain, "finished": p in r.roster.finished,
                    "step": int(loss.stats.step) if loss else None,
                    "tokens_per_s": loss.stats.tokens_per_s if loss else 0.0,
                    "loss": loss.stats.loss if loss and loss.stats.step else None, "links": links})
    return out


def link_row(r: SwarmRegistry, placement: Placement, pair: tuple[str, str]) -> dict:
    """One directed link: its probe (Mbit/s, RTT, kind), the rate real traffic reached at least (a
    lower bound: it raises the estimate `mbps`, never lowers it), the bytes it carried, and the
    carrier (`transport`: the destination's address says grpc or p2p)."""
    book = placement.book
    probe, seen = book.probes.get(pair), book.observed.get(pair)
    src, dst = r.nodes.get(pair[0]), r.nodes.get(pair[1])
    return {"src": pair[0], "dst": pair[1], "mbps": book.estimate(*pair), "rtt_ms": probe.rtt_ms if probe else None,
            "probed_mbps": probe.mbps if probe else None, "probe": probe.kind.value if probe else None,
            "observed_mbps": seen[0] if seen else None, "bytes": src.links.get(pair[1], (0, 0.0))[0] if src else 0,
            "transport": transport_of(dst.address) if dst else None}


def links(r: SwarmRegistry, placement: Placement) -> list[dict]:
    """The links worth showing at any swarm size: those of the chain, those probed in full and those
    that carried traffic (the small capacity probes are in `probes` and under ?links=all)."""
    book = placement.book
    in_use = {pair for chain in placement.chains().values() for pair in chain_links(chain)}
    carried = {(n.node_id, dst) for n in r.nodes.values() for dst, (nbytes, _) in n.links.items() if nbytes}
    shown = in_use | carried | {p for p, probe in book.probes.items() if probe.kind is ProbeKind.FULL}
    return [link_row(r, placement, pair) for pair in sorted(shown)]


def all_links(r: SwarmRegistry, placement: Placement, offset: int, limit: int) -> tuple[list[dict], int]:
    """A page of every measured link (GET /api/v1/state?links=all&offset=..&limit=..), and how many there are."""
    pairs = placement.book.pairs()
    return [link_row(r, placement, pair) for pair in pairs[offset:offset + limit]], len(pairs)


def plan(placement: Placement) -> dict | None:
    """The last rebalancing plan (applied or not: it must stand on full probes and beat the chain
    by the hysteresis share), or None before the first check."""
    p = placement.proposal
    if p is None:
        return None
    return {"chain": p.chain, "bottleneck_ms": p.bottleneck_s * 1e3 if math.isfinite(p.bottleneck_s) else None,
            "bottleneck": p.bottleneck}


def probes(placement: Placement) -> dict:
    """How far the probes are: pairs measured, running, failed, and the payload asked for so far."""
    book, prober = placement.book, placement.prober
    kinds = [probe.kind for probe in book.probes.values()]
    return {"pairs": len(book.probes), "full": sum(k is ProbeKind.FULL for k in kinds),
            "capacity": sum(k is ProbeKind.CAPACITY for k in kinds), "running": len(prober.busy) // 2,
            "failed": prober.failed, "wanted": len(prober.wanted), "capacity_payload_bytes": prober.probe_bytes}


def swarm_state(r: SwarmRegistry, placement: Placement, p2p_maddrs: list[str] = ()) -> dict:
    """The /api/v1/state document; `p2p_maddrs`: where volunteers reach the coordinator over p2p
    (their --initial-peers)."""
    return {
        "nodes": [
            {"id": n.node_id, "stage": n.stage, "pipeline": n.pipeline if n.status is NodeStatus.ACTIVE else None,
             "address": n.address, "status": n.status.value, "device": n.device, "finished": n.stats.finished,
             "rejoins": n.rejoins,
             "codec_seconds": n.stats.codec_seconds, "step_seconds": n.stats.step_seconds,
             "outer": {k: n.stats.outer[k] for k in sorted(n.stats.outer)[:OUTER_KEYS]}}
            for n in sorted(r.nodes.values(),
                            key=lambda n: (n.stage if n.stage >= 0 else 1 << 30, n.pipeline, n.node_id))
        ],
        "pipelines": pipelines(r, placement),
        "links": links(r, placement),
        "probes": probes(placement),
        "rebalance": plan(placement),
        "training": training(r),
        "loss_history": [[step, loss] for step, loss in sorted(r.losses.items())],
        "events": r.events[-20:],
        "stages": r.run.stages,
        "epoch": r.epoch,
        "run": r.sealer.run,
        "refused": refused(r),
        "p2p_maddrs": list(p2p_maddrs),
        "loss_alert": r.watch.alert.to_json(r.run.codec.label) if r.watch.alert else None,
    }



def refused(r: SwarmRegistry) -> list[dict]:
    """Messages refused so far, by receiver (the coordinator, each node) and reason."""
    out = [{"receiver": "coordinator", "reason": reason.value, "count": n} for reason, n in sorted(
        r.sealer.guard.refused.items(), key=lambda kv: kv[0].value)]
    for n in sorted(r.nodes.values(), key=lambda n: n.node_id):
        out += [{"receiver": n.node_id, "reason": reason, "count": count}
                for reason, count in sorted(n.stats.refused.items())]
    return out


def ledger_json(r: SwarmRegistry) -> dict:
    """Every committed step of every pipeline: its loss, sample ids and wall time on the loss stage
    (GET /api/v1/ledger), pipeline by pipeline; a step the pipeline skipped on purpose (it took a newer
    replica's state) has `skipped` and no loss, with the samples it did not train."""
    return {"steps": [{"pipeline": pipeline, "step": step, "loss": None if p.skipped else p.loss,
                       "sample_ids": list(p.sample_ids), "seconds": p.seconds, "skipped": p.skipped}
                      for pipeline, ledger in sorted(r.ledgers().items()) for step, p in sorted(ledger.items())]}


class LedgerDocument:
    """GET /api/v1/ledger's body: built once per change of the ledger, its JSON encoded off the event
    loop, and served as it is to every GET until the ledger changes (each GET built it whole on the
    loop: 0.24-0.36 s and 2.3 MB at 20 k steps, for anyone who asked)."""

    def __init__(self, registry: SwarmRegistry):
        self.r = registry
        self.version, self.body = -1, b""
        self.builds = 0
        self._lock = asyncio.Lock()

    async def get(self) -> bytes:
        async with self._lock:
            version = self.r.db.ledger_version
            if version != self.version:
                rows = ledger_json(self.r)
                self.body = await asyncio.to_thread(lambda: json.dumps(rows).encode())
                self.version = version
                self.builds += 1
            return self.body

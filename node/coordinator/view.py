"""The swarm as the status page shows it: nodes, measured links, training progress, the loss
history and events (`swarm_state`, the /api/v1/state document), and the ledger of sample ids."""

from __future__ import annotations

from ..net.channels import transport_of
from ..proto import tahnode_pb2 as pb
from .placement import Placement
from .registry import SwarmRegistry
from .state import NodeRecord, NodeStatus

__all__ = ["swarm_state", "ledger_json"]


def latest_on(r: SwarmRegistry, stage: int) -> NodeRecord | None:
    """The active holder of a stage, else the node that held it last (for finished runs)."""
    held = r.holder(stage)
    if held:
        return held
    former = [n for n in r.nodes.values() if n.stage == stage]
    return max(former, key=lambda n: n.last_seen) if former else None


def training(r: SwarmRegistry) -> dict:
    last = latest_on(r, r.run.stages - 1)
    senders = [n for n in r.nodes.values() if n.stage >= 0 and n.stats.forward_bits_per_element > 0]
    fw = sum(n.stats.forward_bits_per_element for n in senders) / len(senders) if senders else 0.0
    s = last.stats if last else pb.TrainingStats()
    return {
        "step": int(s.step),
        "loss": s.loss if last and s.step else None,
        "tokens_per_s": s.tokens_per_s,
        "bits_per_element": fw,
        "backward_bits_per_element": s.backward_bits_per_element,
        "loss_first": s.loss_first if last and s.step else None,
        "wire_bytes": sum(n.stats.wire_bytes for n in r.nodes.values()),
        "uncompressed_bytes": sum(n.stats.uncompressed_bytes for n in r.nodes.values()),
        "finished": bool(last and s.finished),
        "replays": sum(n.stats.replays for n in r.nodes.values()),
        "aqsgd_cache_bytes": sum(n.stats.aqsgd_cache_bytes for n in r.nodes.values() if n.status is NodeStatus.ACTIVE),
        "peak_rss_bytes": max((n.stats.peak_rss_bytes for n in r.nodes.values() if n.stage >= 0), default=0),
        "steps_total": r.run.train.steps,
    }


def links(r: SwarmRegistry, placement: Placement) -> list[dict]:
    """Probed links (Mbit/s, RTT), with the rate real traffic achieved where there was some, and
    the carrier each uses (`transport`: the destination's address says grpc or p2p).
    Traffic time includes waiting on a busy receiver, so it is a lower bound: it raises the
    estimate when it exceeds the probe, never lowers it."""
    observed, sent = {}, {}
    for n in r.nodes.values():
        for dst, (nbytes, seconds) in n.links.items():
            if seconds > 0 and nbytes > 0:
                observed[(n.node_id, dst)] = nbytes * 8 / seconds / 1e6
                sent[(n.node_id, dst)] = nbytes
    out = []
    for pair in sorted(set(placement.probes) | set(observed)):
        probed, rtt = placement.probes.get(pair, (None, None))
        seen = observed.get(pair)
        mbps = max(x for x in (probed, seen) if x is not None)
        out.append({"src": pair[0], "dst": pair[1], "mbps": mbps, "rtt_ms": rtt, "probed_mbps": probed, "observed_mbps": seen,
                    "bytes": sent.get(pair, 0), "transport": transport_of(r.nodes[pair[1]].address) if pair[1] in r.nodes else None})
    return out


def swarm_state(r: SwarmRegistry, placement: Placement, p2p_maddrs: list[str] = ()) -> dict:
    """The /api/v1/state document (after a failure sweep); `p2p_maddrs`: where volunteers reach the
    coordinator over p2p (their --initial-peers)."""
    r.sweep()
    return {
        "nodes": [
            {"id": n.node_id, "stage": n.stage, "address": n.address, "status": n.status.value, "device": n.device,
             "finished": n.stats.finished}
            for n in sorted(r.nodes.values(), key=lambda n: (n.stage if n.stage >= 0 else 1 << 30, n.node_id))
        ],
        "links": links(r, placement),
        "training": training(r),
        "loss_history": [[step, loss] for step, loss in sorted(r.losses.items())],
        "events": r.events[-20:],
        "stages": r.run.stages,
        "epoch": r.epoch,
        "run": r.sealer.run,
        "refused": refused(r),
        "p2p_maddrs": list(p2p_maddrs),
    }


def refused(r: SwarmRegistry) -> list[dict]:
    """Messages refused so far, by receiver (the coordinator, each node) and reason."""
    out = [{"receiver": "coordinator", "reason": reason.value, "count": n} for reason, n in sorted(
        r.sealer.guard.refused.items(), key=lambda kv: kv[0].value)]
    for n in sorted(r.nodes.values(), key=lambda n: n.node_id):
        out += [{"receiver": n.node_id, "reason": reason, "count": count} for reason, count in sorted(n.stats.refused.items())]
    return out


def ledger_json(r: SwarmRegistry) -> dict:
    """Every committed step: its loss, sample ids and wall time on the last stage (GET /api/v1/ledger)."""
    return {"steps": [{"step": step, "loss": p.loss, "sample_ids": list(p.sample_ids), "seconds": p.seconds}
                      for step, p in sorted(r.ledger().items())]}

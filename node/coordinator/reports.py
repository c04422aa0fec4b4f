"""What the coordinator keeps of what a node tells it: each heartbeat's stats cut to the figures it
shows (known refusal reasons, a few offenders, the outer step's figures), and a join's names bounded."""

from __future__ import annotations

from ..net.errors import InvalidRequest
from ..net.freshness import RefusalReason
from ..pipeline.state import BAD_MICRO_BATCH
from ..proto import tahnode_pb2 as pb

__all__ = ["kept_stats", "check_names", "MAX_ID", "MAX_DEVICE", "MAX_ADDRESS", "MAX_OFFENDERS", "MAX_OUTER_FIGURES"]

MAX_ID = 128            # characters of a node id
MAX_DEVICE = 64         # of a device string ("cuda:0", "cpu", a GPU's name)
MAX_ADDRESS = 512       # of an address (host:port, or a p2p multiaddress with its peer id)
MAX_OFFENDERS = 16      # senders a node's offence counts name (only its neighbours and replicas are judged)
MAX_OUTER_FIGURES = 16  # figures of its outer steps (tahnode.pipeline.outer_sync.OuterSync.report)
MAX_AVERAGER_PEER = 128  # characters of an averager's peer id in a report
REASONS = frozenset(r.value for r in RefusalReason) | {BAD_MICRO_BATCH}


def kept_stats(stats: pb.TrainingStats) -> pb.TrainingStats:
    """`stats` without its losses (the ledger has them), with only known refusal reasons, the
    first MAX_OFFENDERS offenders and MAX_OUTER_FIGURES outer figures: a heartbeat's maps are the
    node's to fill (a 3.7 MB one was kept whole, shown on /metrics and rendered every second)."""
    kept = pb.TrainingStats()
    kept.CopyFrom(stats)
    kept.ClearField("losses")
    for name in ("refused", "offences", "outer", "outer_reports"):
        kept.ClearField(name)
    kept.refused.update({k: v for k, v in stats.refused.items() if k in REASONS})
    for source, target, most in ((stats.offences, kept.offences, MAX_OFFENDERS),
                                 (stats.outer, kept.outer, MAX_OUTER_FIGURES)):
        target.update({k: source[k] for k in sorted(source, key=lambda k: (len(k), k))[:most] if len(k) <= MAX_ID})
    for report in stats.outer_reports[:MAX_OFFENDERS]:  # the coordinator keeps the evidence itself, cut to size
        if len(report.peer) <= MAX_AVERAGER_PEER:
            kept.outer_reports.add(peer=report.peer, suspect=report.suspect, stalled=report.stalled,
                                   clean=report.clean, excluded=report.excluded, evidence=report.evidence[:80])
    return kept


def check_names(req: pb.JoinRequest) -> None:
    """Refuse a join whose node id, device or address is longer than any real one."""
    for what, value, most in (("node id", req.node_id, MAX_ID), ("device", req.device, MAX_DEVICE),
                              ("address", req.address, MAX_ADDRESS)):
        if len(value) > most:
            raise InvalidRequest(f"a {what} of {len(value)} characters: at most {most}")

"""Where a join puts a node (SwarmRegistry.join): a known node, its id and the key bound to it, resumes its record
and takes its stage back while that stage is still open; a new id from a host where another id is banned waits as a
newcomer until that ban ends; a node that names its stage (--stage N) takes it in the first pipeline whose stage is
open and whose limits (tahnode.coordinator.sybils) allow it, else waits for one; any other node waits for placement.

The newcomer's signal is the host its join came from, as gRPC saw it, wherever an id of that host is banned: a
public host's ban refuses its joins outright (tahnode.coordinator.bans); a private one may be shared by unrelated
machines (a lab or cloud network the coordinator is on), so a new id from it is admitted but placed only once the ban
ends, while the nodes already known there go on as they were. A loopback caller gives no signal: it runs on the
coordinator's own machine (a test swarm on 127.0.0.1, or a proxy in front of the coordinator)."""

from __future__ import annotations

import ipaddress

from .state import STANDBY, NodeRecord, NodeStatus
from .sybils import SybilLimits, caller_host

__all__ = ["admit", "release_newcomers", "WATCH", "NEWCOMER"]

# Bans marks that refuse no join (ban_marks never names them), kept with the bans across restarts:
WATCH = "watch:"        # + a host where an id is banned: a new id from it waits
NEWCOMER = "newcomer:"  # + a node id that waits as a newcomer: rejoining does not shorten its wait


def admit(r, node: NodeRecord, old: NodeRecord | None, asked: int, new_id: bool) -> tuple[str, str]:
    """Set where `node`, the record of a join to registry `r` for stage `asked` (-1: auto), stands; `old`: its id's
    record so far, `new_id`: an id never bound to a key before. (where, for the event log; notice, for the join reply:
    why it waits, "" if it does not.)"""
    if old is not None:  # the same id, signed by its bound key (SwarmRegistry.check): the same node, its standing kept
        node.joined_at, node.rejoins, node.stats = old.joined_at, old.rejoins + 1, old.stats
        node.layer_ms = node.layer_ms or old.layer_ms
    host = caller_host(node.seen)
    wait = newcomer_wait(r, node.node_id, host, new_id)
    if wait:
        node.status = NodeStatus.NEWCOMER
        r.bans.extend([NEWCOMER + node.node_id], r.bans.clock() + wait)
        r.db.ban({NEWCOMER + node.node_id: r.bans.until[NEWCOMER + node.node_id]})
        notice = (f"a newcomer: another id on host {host} is banned for another {wait:.0f} s; this node is admitted "
                  "and takes a stage once that ban ends")
        return f"waits as a newcomer for {wait:.0f} s (another id on host {host} is banned)", notice
    limits = SybilLimits(r.roster, r.identities, r.run.swarm.max_per_host)
    pipeline = _reclaimed(r, node, old, asked, limits)
    if pipeline is not None:
        _hold(r, node, old.stage, pipeline)
        return f"stage {old.stage}{_of(pipeline)} again, still open (resuming from step {node.resume_step})", ""
    if asked < 0:
        return "waiting for an assignment (--stage auto)", ""
    pipeline, why = r.roster.pinned_pipeline(asked, node.node_id, lambda p: limits.refusal(node, asked, p))
    if pipeline is None:
        return f"waits for stage {asked}: {why}", f"waits for stage {asked}: {why}"
    _hold(r, node, asked, pipeline)
    return f"stage {asked}{_of(pipeline)}", ""


def _of(pipeline: int) -> str:
    return f" of pipeline {pipeline}" if pipeline else ""


def _hold(r, node: NodeRecord, stage: int, pipeline: int) -> None:
    node.status, node.stage, node.pipeline = NodeStatus.ACTIVE, stage, pipeline
    node.resume_step = r.resume_step(stage, pipeline)
    r.roster.took_over(node)


def _reclaimed(r, node: NodeRecord, old: NodeRecord | None, asked: int, limits: SybilLimits) -> int | None:
    """The pipeline whose stage `old` held that `node` takes back, if any: it asks for that stage or for any, it held
    the stage when it last went (it failed or left: nobody moved it), its pipeline is still there (another node holds
    a stage of it; or it was the only pipeline), the stage is open or still its own, and the limits allow it."""
    if old is None or old.stage < 0 or asked not in (-1, old.stage) or old.status not in (
            NodeStatus.ACTIVE, NodeStatus.FAILED, NodeStatus.LEFT):
        return None
    p, roster = old.pipeline, r.roster
    others = [h for k in range(r.run.stages) if (h := roster.holder(k, p)) is not None and h.node_id != old.node_id]
    if p in roster.finished or (not others and (p or any(q != p for q in roster.pipelines()))):
        return None
    held = roster.holder(old.stage, p)
    if held is not None and held.node_id != old.node_id or limits.refusal(node, old.stage, p):
        return None
    return p


def newcomer_wait(r, node_id: str, host: str, new_id: bool) -> float:
    """Seconds a join of `node_id` from `host` waits as a newcomer: a new id, while an id of that host is banned; an
    id that joined as a newcomer, until its wait ends."""
    return max(host_ban_left(r, host) if new_id else 0.0, r.bans.left(NEWCOMER + node_id))


def host_ban_left(r, host: str) -> float:
    """Seconds the longest ban of an id on `host` still lasts (0: none, or no host, or loopback)."""
    if not _watched(host):
        return 0.0
    banned = [n.node_id for n in r.nodes.values() if n.status is NodeStatus.BANNED and caller_host(n.seen) == host]
    return r.bans.left_any([WATCH + host, f"host:{host}", *banned])


def _watched(host: str) -> bool:
    """A host whose banned ids make new ids from it wait: any known one but loopback."""
    try:
        return bool(host) and not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def release_newcomers(r) -> None:
    """(Each sweep.) Watch the hosts of banned nodes until their bans end (kept on disk with the bans, so a restart
    keeps them too); newcomers whose host holds no banned id any more wait for placement like any new node."""
    now = r.bans.clock()
    for n in list(r.nodes.values()):
        host = caller_host(n.seen)
        if n.status is NodeStatus.BANNED and _watched(host) and (left := r.bans.left(n.node_id)):
            if r.bans.until.get(WATCH + host, 0.0) < now + left - 1.0:
                r.bans.extend([WATCH + host], now + left)
                r.db.ban({WATCH + host: now + left})
        elif n.status is NodeStatus.NEWCOMER and not newcomer_wait(r, n.node_id, host, new_id=True):
            n.status, n.stage = NodeStatus.JOINING, STANDBY
            r.epoch += 1
            r.event(f"newcomer {n.node_id}: no id on its host {host} is banned any more; it may be placed now")

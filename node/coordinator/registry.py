"""The coordinator's membership: join, heartbeat, leave, failure by timeout; which stage of which pipeline each node
holds and who its neighbours are; the ledger of every pipeline's committed steps and the event log."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path

from ..config import RunConfig
from ..net.auth import BadMac, Sealer, SwarmKey
from ..net.errors import Banned, InvalidRequest, NotAuthenticated, NotFresh, UnknownNode
from ..net.freshness import COORDINATOR, SealRefused
from ..net.identity import NodeKey
from ..pipeline.checkpoint import CheckpointStore
from ..proto import tahnode_pb2 as pb
from .bans import BanPolicy, Bans, ban_marks
from .admission import admit, release_newcomers
from .durable import SwarmDB, run_identity
from .health import LossHistory, LossWatch
from .ledger_order import in_order, resume_from, rollback_floor
from .reports import check_names, kept_stats
from .replicas import ReplicaCouncil
from .roster import Roster
from .state import STANDBY, Census, NodeRecord, NodeStatus

log = logging.getLogger("tahnode.coordinator")

__all__ = ["SwarmRegistry", "LOSS_HISTORY"]

LOSS_HISTORY = 2000  # recent steps whose losses stay in memory (the whole ledger is in SQLite)
LEDGER_SLACK = 200  # steps a stage may run ahead of the ledger (the loss stage's reports come with its heartbeats)
SEEN_COUNTERS_FILE = "seen-counters.json"  # each sender's highest seal counter, so replays fail after a restart too
MAX_LINKS_PER_NODE = 16  # links a node's heartbeat may report (it sends on two, and probes a few)
DEAD_RECORD_S = 600.0    # a node that left, failed or was banned is forgotten this long after it was last heard
HEARTBEATS_PER_S = 300  # the heartbeat rate the coordinator aims at: beyond this many nodes, they beat less often


class SwarmRegistry:
    """Who is in the swarm and which stage each node holds. Not thread-safe: used from the event loop.
    Refused requests raise the typed errors of tahnode.net.errors."""

    def __init__(self, run: RunConfig, key: SwarmKey, heartbeat_timeout: float = 10.0,
                 store_dir: str | Path = "tahnode-store", bans: Bans | None = None):
        self.run = run
        # one folder per run configuration: a checkpoint of another run is never handed out
        run_id = hashlib.sha256(run.to_json().encode()).hexdigest()[:12]
        self.store = CheckpointStore(Path(store_dir) / f"run-{run_id}", keep=3)
        self.sealer = Sealer(key, COORDINATOR, run_identity(self.store.dir),
                             NodeKey.load_or_create(self.store.dir / "coordinator.key"),
                             seen_file=self.store.dir / SEEN_COUNTERS_FILE)
        self.timeout = heartbeat_timeout
        self.bans = bans or Bans(BanPolicy())
        self.nodes: dict[str, NodeRecord] = {}
        self.roster = Roster(run, self.nodes)
        self.council = ReplicaCouncil(run, self.roster, lambda node_id: self.identities.get(node_id, node_id.encode()),
                                      self.ledger_next)
        self.db = SwarmDB(self.store.dir / "coordinator.sqlite")
        self._epoch = self.db.get("epoch", 1)
        for mark, until in self.db.bans().items():  # bans outlive a restart
            self.bans.until[mark] = until
        # the ledger lives in the database; memory holds only the losses the status page draws
        self.histories = {p: LossHistory(self.db.losses(LOSS_HISTORY, p), LOSS_HISTORY) for p in self.db.pipelines()}
        self.identities: dict[str, bytes] = self.db.identities()  # node id -> the public key bound at its first join
        self.events: list[str] = []
        self.census = Census()
        for pipeline, stage, node_id, address, device, cert in self.db.holders():  # presumed alive until timed out
            self.nodes[node_id] = NodeRecord(node_id, address, stage, device, status=NodeStatus.ACTIVE, tls_cert=cert,
                                             pipeline=pipeline)
        if self.histories or self.nodes:
            held = ", ".join(f"{n.node_id} stage {n.stage} of pipeline {n.pipeline}"
                             for n in self.nodes.values()) or "none"
            steps = ", ".join(f"0..{max(h.points, default=-1)}{f' of pipeline {p}' if p else ''}"
                              for p, h in sorted(self.histories.items()))
            self.event(f"restarted: the ledger holds steps {steps or 'none'}, membership epoch "
                       f"{self._epoch}; holders kept: {held}")

    def serving(self) -> None:
        """(Once, as the control plane answers.) The holders kept from before a restart have two heartbeat timeouts to
        report: their channels back off while it is down (a restart under load once took 14 s to serve)."""
        for node in self.live():
            node.last_seen = max(node.last_seen, time.monotonic() + self.timeout)

    def ledger(self, pipeline: int = 0) -> dict[int, pb.LossPoint]:
        """Every committed step of a pipeline: its loss, samples and wall time on its loss stage (from disk)."""
        return self.db.ledger().get(pipeline, {})

    def ledgers(self) -> dict[int, dict[int, pb.LossPoint]]:
        """pipeline -> its ledger."""
        return self.db.ledger()

    @property
    def finished(self) -> bool:
        """The run is over: every complete pipeline (at least one) reported the run's last step."""
        return bool(self.roster.finished) and set(self.roster.complete_pipelines()) <= self.roster.finished

    @property
    def epoch(self) -> int:
        """Bumps whenever any assignment changes; kept on disk, so it only ever grows."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        """A new epoch: the assignments changed, and who holds which stage is saved with it."""
        self._epoch = value
        self.roster.invalidate()
        self.db.put("epoch", value)
        self.db.set_holders([(n.pipeline, n.stage, n.node_id, n.address, n.device, n.tls_cert)
                             for n in self.nodes.values() if n.status is NodeStatus.ACTIVE])

    # -- helpers ----------------------------------------------------------------------------
    def history(self, pipeline: int) -> LossHistory:
        if pipeline not in self.histories:
            self.histories[pipeline] = LossHistory({}, LOSS_HISTORY)
        return self.histories[pipeline]

    @property
    def losses(self) -> dict[int, float]:
        """The recent steps' losses of the first pipeline that has any (what the status page draws)."""
        return self.histories[min(self.histories)].points if self.histories else {}

    @property
    def watch(self) -> LossWatch:
        """The loss watch with an open alert, else the first pipeline's."""
        watches = [h.watch for _, h in sorted(self.histories.items())]
        return next((w for w in watches if w.alert), watches[0] if watches else LossWatch())

    def event(self, text: str, level: int = logging.INFO) -> None:
        log.log(level, text)
        self.events = (self.events + [f"{time.strftime('%H:%M:%S')} {text}"])[-50:]

    def heartbeat_period(self) -> float:
        """Seconds between a node's heartbeats: 1, longer once the swarm has more live nodes than HEARTBEATS_PER_S (at
        most a third of the failure timeout: a node is declared failed after three missed heartbeats at the least)."""
        return min(max(1.0, self.census.live / HEARTBEATS_PER_S), self.timeout / 3)

    def live(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.status.live]

    def waiting(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.status.waiting]

    def check(self, req, speaks_for: str, run_optional: bool = False, bind: bool = False) -> None:
        """Refuse a request that is not authentic (NotAuthenticated); not fresh, not for this run or coordinator, not
        sealed by the node it speaks for, or not signed by the key that node id is bound to (NotFresh). A node id seen
        for the first time is signed for by the key in its seal, and bound to it if `bind` (a join)."""
        key = self.identities.get(speaks_for) or req.seal.public_key
        try:
            self.sealer.check(req, speaks_for=speaks_for, run_optional=run_optional, signed_by=key)
        except BadMac:
            raise NotAuthenticated("request failed authentication: wrong swarm token") from None
        except SealRefused as exc:
            raise NotFresh(f"{type(req).__name__} refused: {exc}") from None
        if bind and speaks_for not in self.identities:
            self.identities[speaks_for] = key
            self.db.bind(speaks_for, key)

    def peer(self, n: NodeRecord) -> pb.Peer:
        """How others reach node `n`: its address, identity key and TLS certificate."""
        return pb.Peer(node_id=n.node_id, address=n.address, stage=n.stage,
                       public_key=self.identities.get(n.node_id, b""), tls_cert=n.tls_cert)

    def _peer(self, stage: int, pipeline: int) -> pb.Peer:
        n = self.roster.holder(stage, pipeline) if 0 <= stage < self.run.stages else None
        return self.peer(n) if n is not None else pb.Peer(stage=stage)

    def resume_step(self, stage: int, pipeline: int = -1) -> int:
        """The step a new holder of `stage` in `pipeline` resumes from (ledger_order.resume_from)."""
        reached = self.ledger_next(pipeline) if pipeline in self.histories else None
        return resume_from(self.run, self.store, stage, self.confirmed_step(), reached)

    def rollback_floor(self, pipeline: int) -> int:
        """The earliest step a loss report may rewrite in `pipeline`'s ledger (ledger_order.rollback_floor), from
        the furthest steps the ledgers reached."""
        reached = {p: h.furthest + 1 for p, h in self.histories.items()}
        return rollback_floor(self.run, self.store, max(reached.values(), default=0), reached.get(pipeline, 0))

    def confirmed_step(self) -> int:
        """The steps the furthest pipeline's ledger holds: a checkpoint of a step up to it is confirmed."""
        return max((self.ledger_next(p) for p in self.histories), default=0)

    def assignment(self, node: NodeRecord, with_config: bool = False) -> pb.Assignment:
        """What `node` holds and who its neighbours are; the run's configuration with it if asked
        (join replies: it never changes while the coordinator runs)."""
        stage = node.stage if node.status is NodeStatus.ACTIVE else STANDBY
        waits = self.roster.averaging_with(node.pipeline) if stage >= 0 else self.roster.complete_pipelines()
        a = pb.Assignment(stage=stage, num_stages=self.run.stages, epoch=self.epoch, resume_step=node.resume_step,
                          run_config=self.run.to_json() if with_config else "",
                          pipeline=node.pipeline if stage >= 0 else 0, pipelines=len(waits))
        if len(self.roster.complete_pipelines()) > 1:
            a.dht_peers.extend(self.roster.dht_peers)
            if stage >= 0:
                for n in self.roster.replicas(stage, node.pipeline):
                    if n.averager:
                        a.replicas.add(node_id=n.node_id, address=n.averager, stage=n.stage)
                a.named_state.CopyFrom(self.council.named(node))
        if stage >= 0:
            for field, offset in (("prev", -1), ("next", 1)):  # around the ring for a tied model (RunConfig.ring)
                other = self.run.neighbour(node.stage, offset)
                getattr(a, field).CopyFrom(self._peer(node.stage + offset if other is None else other, node.pipeline))
        return a

    def place(self, node: NodeRecord, stage: int, pipeline: int = 0) -> bool:
        """Make `node` the holder of `stage` of `pipeline` (resuming from the store); False if it already was."""
        if node.status is NodeStatus.ACTIVE and (node.stage, node.pipeline) == (stage, pipeline):
            return False
        self.roster.invalidate()
        node.stage, node.pipeline, node.status = stage, pipeline, NodeStatus.ACTIVE
        node.resume_step = self.resume_step(stage, pipeline)
        self.roster.took_over(node)
        return True

    def stand_by(self, node: NodeRecord) -> bool:
        """Make `node` a standby; False if it already was."""
        if node.status is NodeStatus.STANDBY:
            return False
        self.roster.invalidate()
        node.status, node.stage, node.pipeline = NodeStatus.STANDBY, STANDBY, 0
        return True

    # -- requests ---------------------------------------------------------------------------
    def join(self, req: pb.JoinRequest, seen: str = "") -> pb.JoinReply:
        """`seen`: the caller as its carrier saw it (context.peer()), which a ban holds (bans.ban_marks)."""
        if not req.node_id or not req.address:
            raise InvalidRequest("join needs a node id and an address")
        check_names(req)
        new_id = req.node_id not in self.identities
        self.check(req, req.node_id, run_optional=True, bind=True)
        banned = self.bans.left_any(ban_marks(req.node_id, req.seal.public_key, req.address, seen))
        if banned:
            raise Banned(f"node {req.node_id} (or its key or address) is banned for another {banned:.0f} s: its "
                         "neighbours kept refusing its micro-batches (malformed, non-finite or oversized)")
        if req.stage < -1 or req.stage >= self.run.stages:
            raise InvalidRequest(f"stage {req.stage} does not exist: this swarm has stages 0..{self.run.stages - 1}")
        if time.monotonic() - self.census.swept >= 1.0:  # the coordinator sweeps every second anyway
            self.sweep()
        auto = req.movable or req.stage < 0
        node = NodeRecord(req.node_id, req.address, STANDBY, req.device, req.memory_bytes, req.compute_ms,
                          status=NodeStatus.JOINING, tls_cert=req.tls_cert, movable=auto, seen=seen,
                          chosen=-1 if auto else req.stage)
        where, notice = admit(self, node, self.nodes.get(req.node_id), req.stage, new_id)  # StageTaken, or where
        self.nodes[req.node_id] = node
        self.epoch += 1
        self.census.last_join = time.monotonic()
        self.event(f"{'joined' if new_id else 'rejoined'}: {req.node_id} at {req.address} ({req.device or '?'}) -> "
                   f"{where}")
        return pb.JoinReply(assignment=self.assignment(node, with_config=True), swarm="tahnode", run=self.sealer.run,
                            coordinator_key=self.sealer.identity.public, notice=notice)

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.check(req, req.node_id)
        node = self.nodes.get(req.node_id)
        if node is None or not node.status.live:
            raise UnknownNode(f"unknown node {req.node_id!r}: join first")
        node.last_seen = time.monotonic()
        node.stats.CopyFrom(kept_stats(req.stats))
        self.roster.heard(node, req.HasField("outer_state"), req.stats.step)
        if req.layer_ms > 0:
            node.layer_ms = req.layer_ms
        for link in req.links[:MAX_LINKS_PER_NODE]:  # to nodes it could have sent to, a few at most
            if link.dst in self.nodes and link.dst != node.node_id:
                node.links[link.dst] = (link.bytes, link.seconds)
        while len(node.links) > MAX_LINKS_PER_NODE:
            del node.links[next(iter(node.links))]
        if req.averager:
            self.roster.bind_averager(node, req.averager)
        self._judge(node, req.stats.offences)
        for verdict in self.council.heartbeat(node, req):
            self._ban(self.nodes[verdict.accused], f"replicas of {len(verdict.accusers)} operators excluded it from "
                      f"their groups and none vouches for it ({'; '.join(verdict.evidence)})")
        self._record(node, list(req.stats.losses))
        self.db.record_skipped(self.council.skipped(node, list(req.stats.skipped)), node.pipeline)
        if req.stats.finished and node.status is NodeStatus.ACTIVE and req.stats.step >= self.run.train.steps:
            self.roster.said_finished(node, self.ledger_next(node.pipeline) >= self.run.train.steps)
        return pb.HeartbeatReply(assignment=self.assignment(node), known=True, run_finished=self.finished,
                                 heartbeat_s=self.heartbeat_period())

    def _judge(self, reporter: NodeRecord, offences) -> None:
        """Ban the neighbours of `reporter` whose micro-batches it keeps refusing (only a stage's
        neighbours receive its micro-batches, so only their reports count)."""
        if not offences or reporter.status is not NodeStatus.ACTIVE:
            return
        near = {self.run.neighbour(reporter.stage, -1), self.run.neighbour(reporter.stage, 1)} - {None}
        senders = {n.node_id for n in self.nodes.values()
                   if n.status is NodeStatus.ACTIVE and n.stage in near and n.pipeline == reporter.pipeline}
        for sender in self.bans.report(reporter.node_id, {s: c for s, c in offences.items() if s in senders}):
            self._ban(self.nodes[sender], f"{reporter.node_id} refused {self.bans.policy.threshold} of its "
                      f"micro-batches within {self.bans.policy.window_s:.0f} s")

    def _ban(self, node: NodeRecord, why: str) -> None:
        """Put `node` out for the ban policy's time: its id, key and address (bans.ban_marks)."""
        until = self.bans.ban(node.node_id)
        node.status = NodeStatus.BANNED
        marks = ban_marks(node.node_id, self.identities.get(node.node_id, b""), node.address, node.seen)
        self.bans.extend(marks, until)
        self.db.ban({m: self.bans.until[m] for m in marks})
        self.council.forget(node.node_id)
        self.epoch += 1
        self.event(f"banned: {node.node_id} (stage {node.stage}) for {self.bans.policy.ban_s:.0f} s: {why}")

    def _record(self, reporter: NodeRecord, points: list[pb.LossPoint]) -> None:
        """Committed steps into its pipeline's ledger, in memory and on disk, from the node that
        computes the loss now (a standby, a former holder or another stage has none to report), those that
        ledger_order.in_order keeps; a loss that is not a number is never stored, but the alert hears of it."""
        if not points:
            return
        if reporter.status is not NodeStatus.ACTIVE or reporter.stage != self.run.loss_stage:
            log.warning("ignored %d losses from %s: only the holder of stage %d reports them", len(points),
                        reporter.node_id, self.run.loss_stage)
            return
        history = self.history(reporter.pipeline)
        ahead = self.ledger_next(reporter.pipeline)  # a report's step below it rewrites the ledger (a rollback)
        kept, floor = in_order(points, self.run.train.steps, ahead, lambda: self.rollback_floor(reporter.pipeline))
        if len(kept) < len(points):
            log.warning("ignored %d losses from %s: a step outside the run's %d, not above the one before it in the "
                        "report, or a rewrite before step %d (the furthest a rollback goes back)",
                        len(points) - len(kept), reporter.node_id, self.run.train.steps, floor)
        for point in kept:
            raised, cleared = (history.add(point.step, point.loss) if math.isfinite(point.loss)
                               else history.watch_only(point.step, point.loss))
            if raised is not None:
                self.event(f"ALERT: {raised.message(self.run.codec.label)}", logging.WARNING)
            elif cleared:
                self.event(f"the loss is back on its trend at step {point.step}")
        stored = [p for p in kept if math.isfinite(p.loss)]
        if stored:
            self.db.record(stored, reporter.pipeline)

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        self.check(req, req.node_id)
        node = self.nodes.get(req.node_id)
        if node is None:
            raise UnknownNode(f"unknown node {req.node_id!r}")
        if node.status is not NodeStatus.BANNED:  # a banned node that leaves stays banned (its record says why it went)
            node.status = NodeStatus.LEFT
        self.epoch += 1
        self.event(f"left: {req.node_id} (stage {node.stage})")
        return pb.LeaveReply()

    def member(self, node_id: str) -> NodeRecord:
        """The node's record; UnknownNode if it never joined (or this coordinator restarted since)."""
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNode(f"unknown node {node_id!r}: join first")
        return node

    def may_upload(self, node_id: str, stage: int, step: int) -> None:
        """Only the node that holds `stage` now may upload its checkpoints, of a step the ledger
        knows (give or take the steps whose report is still on its way), within the run."""
        node = self.member(node_id)
        if node.status is not NodeStatus.ACTIVE or node.stage != stage:
            raise InvalidRequest(f"node {node_id} does not hold stage {stage} now ({node.status}, stage {node.stage}): "
                                 "it may not upload that stage's checkpoints")
        known = self.confirmed_step()
        if not 1 <= step <= min(known + LEDGER_SLACK, self.run.train.steps):
            raise InvalidRequest(f"a checkpoint of step {step} is outside the run: the ledger has {known} "
                                 f"steps of {self.run.train.steps}")

    def ledger_next(self, pipeline: int = 0) -> int:
        """The step after the newest one in a pipeline's ledger (0 before any)."""
        return max(self.histories[pipeline].points, default=-1) + 1 if pipeline in self.histories else 0

    def prune(self) -> None:
        """Forget nodes that left, failed or were banned DEAD_RECORD_S ago: their records and the links others
        reported to them (a ban outlives the record: Bans keeps it; so does an id's key, up to MAX_IDENTITIES)."""
        now = time.monotonic()
        gone = [n.node_id for n in self.nodes.values() if not n.status.live and now - n.last_seen > DEAD_RECORD_S]
        for node_id in gone:
            del self.nodes[node_id]
            self.council.forget(node_id)
        for node_id in self.db.forget_oldest(self.identities, keep=self.nodes):
            del self.identities[node_id]
        if gone:
            for n in self.nodes.values():
                for node_id in gone:
                    n.links.pop(node_id, None)

    def sweep(self) -> None:
        """Declare nodes that missed their heartbeats for `timeout` seconds failed, forget the long
        gone, and let newcomers be placed once no id of their host is banned (the coordinator runs
        it every second, and before a join)."""
        self.prune()
        release_newcomers(self)
        now = time.monotonic()
        if stall := self.census.stalls.take(now):  # its own stall: the nodes get the time it could not hear them
            for node in self.nodes.values():
                node.last_seen += stall
            self.event(f"the coordinator stalled for {stall:.1f} s: no node is failed for heartbeats it could not read")
        self.census.swept, self.census.live = now, sum(n.status.live for n in self.nodes.values())
        for node in self.nodes.values():
            if node.status.live and now - node.last_seen > self.timeout:
                self.fail(node, f"missed heartbeats for {self.timeout:.0f} s")

    def fail(self, node: NodeRecord, why: str) -> None:
        """Declare a live node failed, for `why` (the next placement round fills what it held)."""
        held = f"stage {node.stage}" if node.status is NodeStatus.ACTIVE else str(node.status)
        node.status, self.epoch = NodeStatus.FAILED, self.epoch + 1
        self.event(f"failed: {node.node_id} ({held}) {why}")

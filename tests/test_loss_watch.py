"""No silent divergence: the coordinator's LossWatch raises an alert when the loss leaves its trend
(the shape of the 125M run whose per-channel gradients diverged) or stops being a number, names the
codecs in its log and events, shows it in /api/v1/state and /metrics, and clears it on recovery;
ordinary noise and a rollback raise nothing."""

from __future__ import annotations

import logging
import math
import random

from tahnode.coordinator.health import AlertKind, LossWatch
from tahnode.coordinator.view import swarm_state
from test_durable import KEYS, TOKEN, registry  # noqa: F401
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb


def falling(steps: int, noise: float = 0.05, seed: int = 0) -> list[float]:
    """A healthy run: a loss that falls from 5.5 towards 1.2, with noise of `noise` relative."""
    rng = random.Random(seed)
    return [(1.2 + 4.3 * math.exp(-s / 60)) * (1 + rng.uniform(-noise, noise)) for s in range(steps)]


def feed(watch: LossWatch, losses: list[float], start: int = 0) -> list:
    return [a for a in (watch.observe(start + k, v)[0] for k, v in enumerate(losses)) if a is not None]


def test_a_healthy_noisy_run_raises_nothing():
    for seed in range(5):
        assert feed(LossWatch(), falling(600, noise=0.15, seed=seed)) == []


def test_a_diverging_run_is_caught_and_clears_when_it_recovers():
    watch = LossWatch()
    base = falling(240)
    assert feed(watch, base) == []
    rising = [base[-1] + (3.13 - base[-1]) * k / 90 for k in range(1, 91)]  # 1.46 -> 3.13 in 90 steps, as measured
    alerts = feed(watch, rising, start=240)
    assert len(alerts) == 1 and alerts[0].kind is AlertKind.DIVERGING
    assert 240 < alerts[0].step < 300  # well before the loss doubled
    message = alerts[0].message("tahquant/naive:bits=6")
    assert "diverging" in message and "tahquant/naive:bits=6" in message
    cleared = [watch.observe(330 + k, base[-1])[1] for k in range(12)]
    assert any(cleared) and watch.alert is None


def test_a_nan_loss_is_an_alert_at_once():
    watch = LossWatch()
    feed(watch, falling(5))
    raised, _ = watch.observe(5, math.nan)
    assert raised is not None and raised.kind is AlertKind.NOT_FINITE and watch.alert is raised
    assert watch.observe(6, math.inf)[0] is None  # one alert, not one per step


def beat(reg, node: str, points: list[tuple[int, float]]) -> None:
    sealer = Sealer(SwarmKey(TOKEN), node, reg.sealer.run, KEYS.setdefault(node, NodeKey.generate()))
    stats = pb.TrainingStats(losses=[pb.LossPoint(step=s, loss=v, sample_ids=[s]) for s, v in points])
    reg.heartbeat(sealer.seal(pb.HeartbeatRequest(node_id=node, stats=stats), COORDINATOR))


def test_the_coordinator_says_so_in_its_log_events_state_and_metrics(tmp_path, caplog):
    from tahnode.config import PlacementSettings
    from tahnode.coordinator.placement import Placement
    from tahnode.coordinator.status_page import SwarmView, _Metrics

    def state_of(reg) -> dict:
        return swarm_state(reg, Placement(reg, PlacementSettings(), measure=None))

    reg = registry(tmp_path)
    last = Sealer(SwarmKey(TOKEN), "n2", identity=KEYS.setdefault("n2", NodeKey.generate()))
    reg.join(last.seal(pb.JoinRequest(node_id="n2", address="127.0.0.1:1", stage=2), COORDINATOR))
    healthy = falling(100)
    beat(reg, "n2", list(enumerate(healthy)))
    assert reg.watch.alert is None
    with caplog.at_level(logging.WARNING, logger="tahnode.coordinator"):
        beat(reg, "n2", [(100 + k, 4.0) for k in range(10)])
    assert reg.watch.alert is not None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ALERT" in m and reg.run.codec.label in m for m in warned), warned
    assert any("ALERT" in e for e in reg.events)
    state = state_of(reg)
    assert state["loss_alert"]["kind"] == "diverging" and reg.run.codec.label in state["loss_alert"]["message"]
    view = SwarmView.from_state(state).to_state_json()
    assert view["loss_alert"] == state["loss_alert"]
    assert b"tahnode_loss_alert 1.0" in _Metrics().render(view)
    beat(reg, "n2", [(60, healthy[60])])  # a rollback to step 60: the steps after it are trained again
    assert reg.watch.alert is not None  # but only losses back on their trend after the alert's step clear it
    again = falling(130)
    beat(reg, "n2", [(s, again[s]) for s in range(61, 130)])
    assert reg.watch.alert is None and any("back on its trend" in e for e in reg.events)
    assert state_of(reg)["loss_alert"] is None


def test_a_rollback_to_before_an_alert_clears_it_only_with_losses_after_it():
    """Issue 60: a rewrite of the ledger fed the watch again from scratch, so a report that went back
    before an open alert's step cleared it, earned or not. It stays open until the loss is back on its
    trend on a step after the alert's."""
    from tahnode.coordinator.health import LossHistory

    history, base = LossHistory({}, 2000), falling(200)
    for step in range(100):
        history.add(step, base[step])
    raised = [history.add(100 + k, 4.0)[0] for k in range(10)]
    alert = next(a for a in raised if a is not None)
    assert history.add(60, base[60]) == (None, False) and history.watch.alert is alert  # the rollback
    assert not any(history.add(s, base[s])[1] for s in range(61, alert.step + 1)) and history.watch.alert is alert
    assert history.add(alert.step + 1, base[alert.step + 1]) == (None, True) and history.watch.alert is None

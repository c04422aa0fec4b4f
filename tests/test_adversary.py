"""A malicious volunteer in a real swarm (issue 26): a coordinator, honest daemons on stages 0 and 2
and a standby, all started as users start them, and a token holder on stage 1 (tests/adversary.py:
the real daemon, its envelopes tampered with on a script) that also lies to the coordinator, uploads
checkpoints whose metadata lies and pads its frames to 4 MiB (issue 39). Every honest daemon lives
through it; the neighbours' reports ban the liar, the standby takes stage 1, and training ends near
where one process's training ends (exactly until the first attack, within 5% over the last 10 steps
after it), every step in the ledger once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tahnode.config import RunConfig
from tahnode.train.data import open_dataset
from tahnode.train.local import train_local
from swarm import Swarm

pytestmark = pytest.mark.slow

STEPS = 40
RUN = ["--steps", str(STEPS), "--stages", "3", "--checkpoint-every", "4", "--micro-batches", "2", "--batch-size", "2",
       "--seq-len", "32", "--codec", "none", "--backward-codec", "none", "--seed", "3"]
ATTACKS = ["gradient norm -1", "activation 3e38", "step end norm inf", "shutdown backward"]
# issue 39's: refused as they come, by the coordinator (the checkpoints) and the next stage (the frames)
REFUSED = ["checkpoint metadata not JSON", "checkpoint metadata of wrong types", "checkpoint unreported [[0, 9.9]]",
           "padded frames"]


def test_a_malicious_stage_holder_kills_nothing_poisons_nothing_and_is_banned(tmp_path):
    swarm = Swarm(tmp_path)
    log, evil = tmp_path / "attacks.log", None
    try:
        swarm.start_coordinator(*RUN, "--heartbeat-timeout", "5")
        swarm.wait_for(lambda s: s is not None, 60, "the coordinator")
        swarm.join("n0", 0, "--threads", "1")
        swarm.join("n2", 2, "--threads", "1")
        state_url = f"http://127.0.0.1:{swarm.http_port}/api/v1/state"
        evil = subprocess.Popen([sys.executable, str(Path(__file__).parent / "adversary.py"), str(log), state_url, "--",
                                 "--coordinator", swarm.coordinator, "--stage", "1", "--listen", "127.0.0.1:0",
                                 "--node-id", "evil", "--checkpoint-dir", str(tmp_path / "ck" / "evil"),
                                 "--device", "cpu", "--threads", "1"],
                                stdout=(tmp_path / "evil.log").open("a"), stderr=subprocess.STDOUT, env=swarm.env)
        swarm.wait_for(lambda s: s["training"]["step"] >= 2, 180, "training with the adversary on stage 1")
        swarm.join("n3", "auto", "--threads", "1")  # the standby that takes the liar's stage
        state = wait_past(swarm, STEPS)
        attacks = log.read_text()
        for attack in ATTACKS:
            assert attack in attacks, attacks
        for attempt in ("ledger wipe", "60000 links", "checkpoint of step 10^15", "checkpoint of another stage",
                        "join as n0"):
            line = next(line for line in attacks.splitlines() if attempt in line)
            # a heartbeat goes through; its lie does not
            assert "accepted" not in line or attempt in ("ledger wipe", "60000 links"), line
        for attempt in REFUSED:
            line = next((line for line in attacks.splitlines() if attempt in line), attacks)
            assert line.endswith(f"{attempt}: INVALID_ARGUMENT"), line
        for name in ("coordinator", "n0", "n2", "n3"):  # every honest process lives (they end once the run is over)
            assert swarm.procs[name].poll() in (None, 0), swarm.log(name)[-3000:]
        record = next(n for n in state["nodes"] if n["id"] == "evil")
        assert record["status"] == "banned", state["nodes"]
        assert any("banned: evil" in e for e in state["events"])
        standby = next(n for n in state["nodes"] if n["id"] == "n3")  # took stage 1 and trained it to the end
        assert (standby["stage"] == 1 and standby["finished"]
                and any("assigned: n3 -> stage 1" in e for e in state["events"]))
        ledger = swarm.ledger()["steps"]
        assert [p["step"] for p in ledger] == list(range(STEPS))  # every committed step, once
        run = RunConfig.build("llama-tiny", None,
                              **{"train.steps": STEPS, "train.micro_batches": 2, "train.batch_size": 2,
                                 "train.seq_len": 32, "train.seed": 3, "codec.forward": "none",
                                 "codec.backward": "none", "codec.backward_params": {}})
        reference = train_local(run, open_dataset(run, str(tmp_path / "cache")))
        # The step-end lie makes stage 2 clip one step by its own norm, not the global one: a real,
        # bounded change of one update. On this tiny run (4 samples of 32 tokens a step) one such
        # change moves the last steps' loss by several percent (measured: the clipping norm of one
        # step 10% off moved the mean of the last 10 losses by +2.1%, of the last 20 by +3.6%), so
        # the bound is 5% on the last 10: the poison that matters (inf or NaN updates, a wiped
        # ledger) would move it by far more.
        final, expected = sum(p["loss"] for p in ledger[-10:]) / 10, sum(reference[-10:]) / 10
        assert abs(final / expected - 1) < 0.05, (final, expected)
        assert [p["loss"] for p in ledger[:2]] == pytest.approx(reference[:2], abs=1e-5)  # before any attack: exact
    finally:
        swarm.stop()
        if evil is not None and evil.poll() is None:
            evil.kill()
            evil.wait()


def wait_past(swarm: Swarm, steps: int) -> dict:
    """Until the ledger has every step (the liar's process may have ended: it was banned)."""
    deadline = time.monotonic() + 600
    state = None
    while time.monotonic() < deadline:
        for name in ("coordinator", "n0", "n2", "n3"):
            code = swarm.procs[name].poll()
            assert code in (None, 0), f"{name} exited with {code}:\n{swarm.log(name)[-4000:]}"
        state = swarm.state()
        if state and state["training"]["step"] >= steps and state["training"]["finished"]:
            return state
        time.sleep(0.5)
    logs = "\n".join(f"--- {n}\n{swarm.log(n)[-3000:]}" for n in swarm.procs)
    raise AssertionError(f"the run did not finish: {state and state['training']}\n{logs}")

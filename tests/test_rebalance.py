"""Rebalancing in a live swarm (root: namespaces with tc): three `--stage auto` nodes must use n3,
whose links run at 4 Mbit/s; a fast fourth node joins later, stands by, is probed, and the
coordinator moves n3's stage to it while training goes on; every step is in the ledger once."""

from __future__ import annotations

import pytest
from tahnode.tools.swarm import LocalSwarm, SwarmSpec
from test_swarm import chain_of, needs_root, probed_links

pytestmark = [pytest.mark.slow, pytest.mark.netns]
STEPS = 120


@needs_root
def test_rebalancing_moves_a_stage_off_a_slow_node_to_a_faster_newcomer(tmp_path):
    spec = SwarmSpec(nodes=4, stages=3, bandwidth_bps=100e6, slow_links={frozenset(("n1", "n3")): 4e6, frozenset(("n2", "n3")): 4e6},
                     prefix="trb-", workdir=tmp_path / "swarm", auto=True, late=1, heartbeat_timeout=10,
                     placement_flags=["--probe-wait", "30", "--rebalance-every", "4"],
                     run_flags=["--steps", str(STEPS), "--checkpoint-every", "5", "--micro-batches", "2", "--batch-size", "4",
                                "--seq-len", "64", "--codec", "none", "--backward-codec", "none"])
    swarm = LocalSwarm.up(spec)
    try:
        before = swarm.wait(lambda s: len(chain_of(s)) == 3 and s["training"]["step"] >= 3, 180, "training on n1, n2 and n3")
        assert "n3" in chain_of(before)
        swarm.start_late()
        moved = swarm.wait(lambda s: any("rebalancing:" in e for e in s["events"]) and len(chain_of(s)) == 3
                           and "n3" not in chain_of(s), 240, "n3's stage moved to n4")
        chain = chain_of(moved)
        assert "n4" in chain
        probed = probed_links(moved)
        for a, b in zip(chain, chain[1:]):  # the new chain stands on full probes, all far above n3's 4 Mbit/s
            assert probed[(a, b)][0] > 40 and probed[(b, a)][0] > 40, (a, b, probed)
        done = swarm.wait(lambda s: s["training"]["finished"], 300, f"{STEPS} steps")
        ledger = swarm.state("ledger")["steps"]
    finally:
        LocalSwarm.down(spec.prefix, spec.workdir)
    assert next(n for n in done["nodes"] if n["id"] == "n3")["stage"] == -1  # stood by, then left
    assert [e["step"] for e in ledger] == list(range(STEPS))
    losses = [e["loss"] for e in ledger]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5

"""A real coordinator against 200 simulated volunteers (`tahnode bench coordinator`, as users run
it): every one is placed (active or standby, pipelines formed) without waiting for all pairs to be probed, no node is
ever in two probes at once, heartbeats are answered, and SIGTERM ends the coordinator within 2 s."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_two_hundred_simulated_volunteers_are_placed_and_sigterm_ends_the_coordinator(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tahnode.cli", "bench", "coordinator", "--nodes", "200", "--stages",
                          "4", "--window", "5", "--place-timeout", "45", "--no-doc", "--json"],
                         capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [row] = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["nodes"] == 200 and row["joined"] == 200
    assert row["placed"] == 200 and row["placed_s"] is not None, out.stderr[-3000:]
    # as many as their speeds allow: 49 chains of 4 leave 4 standbys, and no fewer than 1
    assert 2 <= row["pipelines"] <= 49
    assert row["heartbeats"] > 0 and row["heartbeat_ms"]["p50_ms"] > 0
    assert 0 < row["probes"] < 200 * 199 / 10  # a few per node, not every pair
    assert row["probes_per_node_max"] == 1
    assert row["state_kb"] > 0 and row["metrics_kb"] > 0
    assert row["sigterm_exit_s"] is not None and row["sigterm_exit_s"] < 2
    assert not (tmp_path / "docs").exists()  # --no-doc

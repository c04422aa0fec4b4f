"""`tahnode bench abuse` end to end, small: a real coordinator and stage daemon; a neighbour's padded
and never-ending frames, then a token holder's oversized and stats-padded heartbeats, fresh joins
and heartbeats under made-up sender names; the rows say what was sent and refused: every attack
stream is refused (none OK), the made-up senders are refused (no member of that name)."""

from __future__ import annotations

import json

import pytest

from tahnode.tools import bench_abuse

pytestmark = pytest.mark.slow


def test_a_short_abuse_bench_reports_its_phases(capsys):
    argv = ["--heartbeats", "20", "--links", "50", "--fat-heartbeats", "5", "--stats", "500", "--joins", "10",
            "--senders", "100", "--settle", "1", "--padded-frames", "6", "--endless-frames", "6", "--no-doc", "--json"]
    assert bench_abuse.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["phase"] for r in rows] == ["before", "padded frames", "endless frames", "coordinator abuse", "after"]
    for frames in rows[1:3]:  # refused where they are parsed or reassembled, or over the sender's streams at once
        assert (frames["streams"] == [6, 6] and "OK" not in frames["refused_as"]
                and "INVALID_ARGUMENT" in frames["refused_as"])
    during = rows[3]
    assert during["heartbeats"] == [25, 0] and during["joins"] == [10, 0] and during["senders"] == [100, 100]
    assert all(r["rss_mb"] > 0 and r["daemon_rss_mb"] > 0 and r["state"]["p50_ms"] is not None for r in rows)
    # the daemon, the neighbour, the stage-2 holder, the abuser and its joins (made-up senders never become nodes)
    assert rows[-1]["nodes"] == 3 + 1 + 10

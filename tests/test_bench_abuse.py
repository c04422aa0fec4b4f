"""`tahnode bench abuse` end to end, small: a real coordinator, a token holder's oversized and
stats-padded heartbeats, fresh joins and heartbeats under made-up sender names; the rows say what
was sent and refused, and the made-up senders are refused (no member of that name)."""

from __future__ import annotations

import json

import pytest

from tahnode.tools import bench_abuse

pytestmark = pytest.mark.slow


def test_a_short_abuse_bench_reports_its_phases(capsys):
    argv = ["--heartbeats", "20", "--links", "50", "--fat-heartbeats", "5", "--stats", "500", "--joins", "10",
            "--senders", "100", "--settle", "1", "--no-write", "--json"]
    assert bench_abuse.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["phase"] for r in rows] == ["before", "during", "after"]
    during = rows[1]
    assert during["heartbeats"] == [25, 0] and during["joins"] == [10, 0] and during["senders"] == [100, 100]
    assert all(r["rss_mb"] > 0 and r["state"]["p50_ms"] is not None for r in rows)
    assert rows[2]["nodes"] == 3 + 1 + 10  # the holders, the abuser and its joins (made-up senders never become nodes)

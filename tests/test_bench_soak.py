"""`tahnode bench soak` as users run it, shortened: a real swarm (coordinator, three stages, a
standby) trains while every process is sampled; the report and the plot are written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_a_short_soak_writes_its_report_and_plot(tmp_path):
    doc, plots = tmp_path / "bench.md", tmp_path / "plots"
    out = subprocess.run([sys.executable, "-m", "tahnode.cli", "bench", "soak", "--minutes", "0.45",
                          "--warmup-minutes", "0.15",
                          "--every", "1", "--doc", str(doc), "--plots", str(plots), "--workdir", str(tmp_path / "w"),
                          "--prefix", "tks-", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    series = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(s["name"] for s in series) == ["coord", "n1", "n2", "n3", "n4"]
    for s in series:
        assert len(s["samples"]) >= 15
        assert all(x["rss_mb"] > 10 and x["fds"] > 3 for x in s["samples"])
    text = doc.read_text()
    assert "| process | RSS MB after warm-up |" in text and "| coord |" in text
    assert "Steps trained:" in text and (plots / "soak.png").stat().st_size > 10_000

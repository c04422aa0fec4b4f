"""`tahnode bench swarm`, short: one shaped rate and the unshaped baseline, two codec pairs, two
steps each. It writes its table (exactly the documented columns) into the doc, its PNG plots
beside it, and its rows as JSON; a second run replaces its section instead of adding one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tahnode.tools.bench_swarm import COLUMNS, CodecPair
from test_swarm import root_reason

pytestmark = pytest.mark.slow


def test_codec_pairs_parse_with_parameters_and_refuse_unknown_ones():
    pair = CodecPair.parse("aqsgd:bits=4/naive:bits=8")
    assert (pair.forward, pair.forward_params, pair.backward, pair.backward_params) == ("aqsgd", {"bits": 4}, "naive", {"bits": 8})
    assert CodecPair.parse("tahquant/naive").backward_params == {"bits": 6}  # the paper's gradient codec
    for bad in ("tahquant", "zstd/naive", "naive:bits=99/none", "a/b/c"):
        with pytest.raises(ValueError):
            CodecPair.parse(bad)


def test_a_short_bench_writes_its_table_plots_and_json(tmp_path):
    shaper = "tc" if root_reason() is None else "userspace"
    doc, plots = tmp_path / "benchmarks.md", tmp_path / "plots"
    doc.write_text("# Benchmarks\n\nkept as it is\n")
    args = [sys.executable, "-m", "tahnode.cli", "bench", "swarm", "--rates", "0,20", "--rtts", "0", "--stages", "3",
            "--pairs", "none/none,tahquant/naive", "--steps", "1", "--unshaped-steps", "1", "--warmup", "1",
            "--tokens-per-step", "4096", "--seq-len", "64", "--shaper", shaper, "--doc", str(doc), "--plots", str(plots),
            "--workdir", str(tmp_path / "work"), "--prefix", f"tb{os.getpid() % 1000}-", "--json"]
    env = {**os.environ, "TAHNODE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(row["rate_mbps"], row["pair"]) for row in rows] == [(0, "none/none"), (0, "tahquant/naive"),
                                                                  (20, "none/none"), (20, "tahquant/naive")]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["limit"] in ("link", "compute") and 0 < row["share"]
        assert len(row["losses"]) == 2 and row["peak_rss_mb"] > 50
    shaped = [row for row in rows if row["rate_mbps"]]
    assert all(row["busiest_bytes_per_step"] > 0 for row in shaped)
    none, tah = shaped
    assert none["busiest_bytes_per_step"] > 4 * tah["busiest_bytes_per_step"]  # 32 bits vs ~4.4 forward, 6 back
    assert none["losses"][0] == pytest.approx(tah["losses"][0], rel=0.05)  # the same training
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept as it is\n")
    assert "| " + " | ".join(COLUMNS) + " |" in text and text.count("| unshaped |") == 2
    assert "Machine:" in text and "Command: `tahnode bench swarm" in text
    for name in ("swarm-throughput.png", "swarm-loss.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{name})" in text
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and doc.read_text().count("<!-- bench-swarm:swarm:begin -->") == 1

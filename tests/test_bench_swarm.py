"""`tahnode bench swarm`, short: one shaped rate, two codec pairs on gRPC and on p2p links, two
steps each. It writes its table (exactly the documented columns) into the doc, its PNG plots
beside it, and its rows as JSON. A section written again replaces itself; limits (link or
compute, from the unshaped rows) are checked on rows made by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tahnode.tools.bench_probes import stat_fields
from tahnode.tools.bench_report import write_section
from tahnode.tools.bench_swarm import COLUMNS, CodecPair, Row, with_limits
from tahnode.tools.swarm_convergence import convergence_cells, mean_curves
from test_swarm import root_reason

pytestmark = pytest.mark.slow


def test_codec_pairs_parse_with_parameters_and_refuse_unknown_ones():
    pair = CodecPair.parse("aqsgd:bits=4/naive:bits=8")
    assert ((pair.forward, pair.forward_params, pair.backward, pair.backward_params)
            == ("aqsgd", {"bits": 4}, "naive", {"bits": 8}))
    assert CodecPair.parse("tahquant/naive").backward_params == {"bits": 6}  # the paper's gradient codec
    # issue 43: `default` sends what a run sends by default (bare tahquant: the same codec, no schedule)
    from tahnode.config.run import CodecConfig
    assert CodecConfig(**CodecPair.parse("default").codec_table()).label == CodecConfig().label
    assert CodecConfig(**CodecPair.parse("tahquant/naive").codec_table()).forward_codec_params == {}
    for bad in ("tahquant", "zstd/naive", "naive:bits=99/none", "a/b/c"):
        with pytest.raises(ValueError):
            CodecPair.parse(bad)


def test_limits_are_the_smaller_of_link_and_compute_per_stages_pair_and_transport():
    rows = [Row(0, 0, 3, "none/none", "grpc", tokens_per_s=1000), Row(0, 0, 3, "none/none", "p2p", tokens_per_s=800),
            Row(20, 0, 3, "none/none", "grpc", tokens_per_s=300, busiest_bytes_per_step=4096 * 20e6 / 8 / 500),
            Row(20, 0, 3, "none/none", "p2p", tokens_per_s=700, busiest_bytes_per_step=4096 * 20e6 / 8 / 5000)]
    with_limits(rows, 4096)
    assert [(r.limit, round(r.limit_tokens_per_s), round(r.share, 2)) for r in rows] == [
        ("compute", 1000, 1.0), ("compute", 800, 1.0), ("link", 500, 0.6), ("compute", 800, 0.88)]
    assert [r.series for r in rows[:2]] == ["none/none", "none/none over p2p"]


def test_pipelines_rows_take_the_smaller_limit_and_their_speed_up_over_one_pipeline():
    from tahnode.tools.bench_pipelines import PipelineRow, compute_shares, pipeline_limits

    rows = [PipelineRow(0, 1, 3, 8, tokens_per_s=2000), PipelineRow(0, 2, 3, 8, tokens_per_s=3000),
            PipelineRow(10, 1, 3, 8, tokens_per_s=450, link_limit=500),
            PipelineRow(10, 2, 3, 8, tokens_per_s=880, link_limit=1000),
            PipelineRow(50, 2, 3, 8, tokens_per_s=2700, link_limit=5000)]
    pipeline_limits(rows)
    assert [(r.limit, r.limit_tokens_per_s, round(r.share, 2), round(r.speedup, 2)) for r in rows] == [
        ("compute", 2000, 1.0, 0.0), ("compute", 3000, 1.0, 1.5), ("link", 500, 0.9, 0.0), ("link", 1000, 0.88, 1.96),
        ("compute", 3000, 0.9, 0.0)]  # no 1-pipeline row at 50 Mbit/s: no speed-up
    assert rows[3].cells()[:6] == ["10", "2", "3", "every 8", "880", "1.96×"]
    assert compute_shares(rows) == {10: 0.225}  # 450 of 2000; no 1-pipeline row at 50 Mbit/s
    assert compute_shares(rows[2:]) == {}       # no unshaped row: nothing to compare with


def test_the_pipelines_report_says_what_share_of_the_machine_one_pipeline_needs_at_each_rate(tmp_path):
    from tahnode.tools.bench_pipelines import PipelineBench, PipelineRow, pipeline_limits, report

    rows = [PipelineRow(0, 1, 3, 4, tokens_per_s=69527), PipelineRow(0, 2, 3, 4, tokens_per_s=60905),
            PipelineRow(50, 1, 3, 4, tokens_per_s=22227, link_limit=22848),
            PipelineRow(50, 2, 3, 4, tokens_per_s=39444, link_limit=45735)]
    pipeline_limits(rows)
    doc = tmp_path / "log.md"
    report(rows, PipelineBench(), doc, tmp_path / "plots", "t", "tahnode bench swarm --pipelines 1,2")
    text = doc.read_text()
    assert "One pipeline at 50 Mbit/s trains 32% of what it trains unshaped." in text
    assert "| 50 | 2 | 3 | every 4 | 39,444 | 1.77× |" in text
    assert (tmp_path / "plots" / "t-pipelines.png").stat().st_size > 0


def test_convergence_compares_each_seed_with_the_reference_of_the_same_seed():
    def run(pair, seed, final, first=5.0):
        return Row(0, 0, 3, pair, losses=[first] * 5 + [final] * 10, seed=seed, bits_fwd=4.0,
                   tokens_per_s=100.0 * (seed + 1))

    rows = [run("none/none", 0, 2.0), run("tahquant/naive", 0, 2.1), run("none/none", 1, 1.5, first=4.0),
            run("tahquant/naive", 1, 1.5), run("tahquant/tahquant", 1, 1.2)]  # a pair may lack a seed
    cells = convergence_cells(rows)
    assert [c[:5] for c in cells] == [["none/none", "15", "2", "1.7500", "+0.00% (+0.0, +0.0)"],
                                      ["tahquant/naive", "15", "2", "1.8000", "+2.50% (+5.0, +0.0)"],
                                      ["tahquant/tahquant", "15", "1", "1.2000", "-20.00% (-20.0)"]]
    assert cells[0][5:] == ["4.00 / 0.00", "150"]
    assert convergence_cells([run("naive/naive", 0, 1.0)])[0][4] == "no reference run"
    curves = mean_curves(rows)
    assert [c.pair for c in curves] == ["none/none", "tahquant/naive", "tahquant/tahquant"]
    assert curves[0].losses == [4.5] * 5 + [1.75] * 10


@pytest.mark.root_network  # namespaces and tc where root
def test_a_short_bench_writes_its_table_plots_and_json(tmp_path):
    """Two codec pairs on gRPC and on p2p links, at one shaped rate."""
    shaper = "tc" if root_reason() is None else "userspace"
    doc, plots = tmp_path / "benchmarks.md", tmp_path / "plots"
    doc.write_text("# Benchmarks\n\nkept as it is\n")
    args = [sys.executable, "-m", "tahnode.cli", "bench", "swarm", "--rates", "20", "--rtts", "0", "--stages", "3",
            "--pairs", "none/none,tahquant/naive", "--transports", "grpc,p2p", "--steps", "1", "--warmup", "1",
            "--tokens-per-step", "4096", "--seq-len", "64", "--shaper", shaper, "--doc", str(doc),
            "--plots", str(plots),
            "--workdir", str(tmp_path / "work"), "--prefix", f"tb{os.getpid() % 1000}-", "--json", "--device", "cpu"]
    env = {**os.environ, "TAHNODE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(row["pair"], row["transport"]) for row in rows] == [("none/none", "grpc"), ("none/none", "p2p"),
                                                                  ("tahquant/naive", "grpc"), ("tahquant/naive", "p2p")]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["limit"] == "link" and 0 < row["share"]
        assert len(row["losses"]) == 2 and row["peak_rss_mb"] > 50 and row["busiest_bytes_per_step"] > 0
    none_grpc, none_p2p, tah_grpc, tah_p2p = rows
    # 32 bits vs ~4.4 forward, 6 back
    assert none_grpc["busiest_bytes_per_step"] > 4 * tah_grpc["busiest_bytes_per_step"]
    # the same envelopes, framed by either carrier
    for grpc_row, p2p_row in ((none_grpc, none_p2p), (tah_grpc, tah_p2p)):
        assert p2p_row["busiest_bytes_per_step"] == pytest.approx(grpc_row["busiest_bytes_per_step"], rel=0.15)
        assert p2p_row["losses"][0] == pytest.approx(grpc_row["losses"][0], rel=1e-3)
    assert none_grpc["losses"][0] == pytest.approx(tah_grpc["losses"][0], rel=0.05)  # the same training
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept as it is\n")
    assert "| " + " | ".join(COLUMNS) + " |" in text and text.count("| p2p |") == 2
    assert "Machine:" in text and "Command: `tahnode bench swarm" in text
    assert "stages on cpu." in text and "no GPU used" in text
    for name in ("swarm-throughput.png", "swarm-loss.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{name})" in text


def test_a_section_written_again_replaces_itself_and_keeps_the_rest(tmp_path):
    doc, plot = tmp_path / "benchmarks.md", tmp_path / "plots" / "a.png"
    doc.write_text("# Benchmarks\n\nkept as it is\n")
    write_section(doc, "swarm", "Swarm", ["first table"], [plot])
    with doc.open("a") as f:
        f.write("\na note after the section\n")
    write_section(doc, "swarm", "Swarm", ["second table"], [plot])
    write_section(doc, "nat", "NAT", ["nat table"], [])
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept as it is\n\n## Swarm\n")
    assert text.count("<!-- bench-swarm:swarm:begin -->") == 1 and "first table" not in text and "second table" in text
    assert (text.index("second table") < text.index("a note after the section") < text.index("## NAT")
            < text.index("nat table"))
    assert "![a](plots/a.png)" in text and "Machine: " in text


def _state(pid: int) -> str | None:
    fields = stat_fields(pid)
    return fields[0] if fields else None


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()
            and (fields := stat_fields(entry)) and fields[0] != "Z" and int(fields[1]) == pid]


@pytest.mark.root_network
def test_a_bench_stopped_by_sigterm_takes_its_swarm_down(tmp_path):
    """`timeout`, `kill` or a service manager sends SIGTERM: the bench unwinds as on Ctrl-C, stops its
    coordinator and daemons (each in a session of its own) and removes its namespaces, and exits 130.
    Before, SIGTERM ended the bench at once and left the swarm running, its namespaces in place."""
    import signal
    import time

    from tahnode.tools import netns

    shaper = "tc" if root_reason() is None else "userspace"
    prefix = f"ts{os.getpid() % 1000}-"
    args = [sys.executable, "-m", "tahnode.cli", "bench", "swarm", "--rates", "20", "--rtts", "0", "--stages", "3",
            "--pairs", "none/none", "--steps", "50", "--warmup", "1", "--tokens-per-step", "4096", "--seq-len", "64",
            "--shaper", shaper, "--doc", str(tmp_path / "b.md"), "--plots", str(tmp_path / "plots"),
            "--workdir", str(tmp_path / "work"), "--prefix", prefix, "--device", "cpu"]
    bench = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "TAHNODE_CACHE": str(tmp_path / "cache")})
    try:
        deadline = time.monotonic() + 300
        while len(started := _children(bench.pid)) < 4:  # the coordinator and three daemons
            assert bench.poll() is None and time.monotonic() < deadline, "the bench never started its swarm"
            time.sleep(0.5)
        time.sleep(3)
        bench.send_signal(signal.SIGTERM)
        out, _ = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 130, out[-3000:]
    assert "interrupted" in out
    deadline = time.monotonic() + 15
    while left := [pid for pid in started if _state(pid) not in (None, "Z")]:
        assert time.monotonic() < deadline, f"the swarm's processes outlived the bench: {left}"
        time.sleep(0.5)
    if shaper == "tc":
        assert netns.namespaces(prefix) == []

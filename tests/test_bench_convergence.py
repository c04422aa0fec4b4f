"""`tahnode bench convergence` end to end on a few steps: runs in worker processes, a result file per
(pair, seed) that a second invocation reuses at any --jobs, the table (gaps to the reference of the same seed,
bits, error per crossing, tokens and link time to the reference's loss) and the plot in the doc;
and the arithmetic of the summary on made-up runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tahnode.tools import bench_convergence
from tahnode.tools.bench_report import machine
from tahnode.tools.convergence_report import standard_error, spread, steps_to_reach, summarize, table
from tahnode.tools.convergence_runs import RunResult

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "3", "--seeds", "2", "--seq-len", "32", "--tokens-per-message", "256", "--data-mb", "1",
        "--eval-every", "2", "--eval-samples", "16", "--jobs", "2"]


@pytest.mark.slow
def test_the_bench_trains_reports_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAHNODE_CACHE", str(tmp_path / "cache"))
    doc, plots, work = tmp_path / "bench.md", tmp_path / "plots", tmp_path / "work"
    argv = [*ARGS, "--pairs", "none/none,tahquant-paper/pertoken", "--workdir", str(work), "--doc", str(doc), "--plots",
            str(plots), "--json"]
    assert bench_convergence.main(argv) == 0
    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted((r["pair"], r["seed"]) for r in runs) == [("none/none", 0), ("none/none", 1),
                                                            ("tahquant-paper/pertoken", 0),
                                                            ("tahquant-paper/pertoken", 1)]
    for r in runs:
        assert len(r["losses"]) == 3 and [e[0] for e in r["evals"]] == [0, 2, 3] and not r["diverged"]
        assert all(math.isfinite(x) for x in r["losses"])
    quant = next(r for r in runs if r["pair"] == "tahquant-paper/pertoken")
    assert 4.2 < quant["bits_fwd"] < 4.5 and 6.1 < quant["bits_bwd"] < 6.2 and 0.03 < quant["error_fwd"] < 0.3
    text = doc.read_text()
    assert "| tahquant-paper/pertoken |" in text and "Command: `tahnode bench convergence" in text
    assert (plots / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(work.glob("*.json"))) == 4
    before = {p.name: p.stat().st_mtime_ns for p in work.glob("*.json")}
    assert bench_convergence.main(argv) == 0  # nothing trained again
    assert bench_convergence.main([*argv, "--jobs", "1"]) == 0  # nor with every core for each run (another key)
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("*.json")} == before


def test_bad_arguments_are_refused_before_anything_runs(capsys):
    assert bench_convergence.main(["--pairs", "tahquant/zstd"]) == 2
    assert bench_convergence.main(["--tokens-per-message", "100", "--seq-len", "64"]) == 2
    assert bench_convergence.main(["--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert "zstd" in err and "tokens-per-message" in err and "--seeds" in err


def run(pair: str, seed: int, evals, bits=(4.25, 6.125), diverged: str = "") -> RunResult:
    return RunResult(pair, seed, tokens_per_step=1000, losses=[1.0] * 10, evals=[list(e) for e in evals],
                     bits_fwd=bits[0], bits_bwd=bits[1], dim=128, diverged=diverged)


def test_gaps_and_tokens_compare_each_seed_with_its_own_reference():
    results = [run("none/none", 0, [(0, 5.0), (10, 2.0), (20, 1.0)], bits=(32, 32)),
               run("none/none", 1, [(0, 5.0), (10, 2.2), (20, 1.1)], bits=(32, 32)),
               run("q/q", 0, [(0, 5.0), (10, 1.5), (20, 1.02)]),
               run("q/q", 1, [(0, 5.0), (10, 1.1), (20, 1.0)]),
               run("bad/q", 0, [(0, 5.0)], diverged="step 3: NaN")]
    s = {x.pair: x for x in summarize(results, "none/none")}
    assert s["q/q"].gaps == pytest.approx({0: 2.0, 1: 100 * (1.0 / 1.1 - 1)})
    assert s["q/q"].tokens_to_target[0] == math.inf  # never reached 1.0 within the run
    assert s["q/q"].tokens_to_target[1] == pytest.approx(10_000)  # reached 1.1 at step 10
    assert s["bad/q"].gaps[0] == math.inf
    assert steps_to_reach([[0, 5.0], [10, 3.0], [20, 1.0]], 2.0) == pytest.approx(15.0)  # interpolated
    # a link's busier direction carries the 6.125-bit gradients: 1e6 tokens of width 128 at 10 Mbit/s
    assert s["q/q"].link_seconds(1e6, 10) == pytest.approx(1e6 * 128 * 6.125 / 10e6)
    # the reference reaches q/q's final loss of seed 0 (1.02) after 19.8 steps of 1000 tokens, at 32 bits; never
    # its seed-1 one (1.0, below its own 1.1). q/q took its 20 steps at 6.125 bits
    assert s["q/q"].reference_tokens_to_own == pytest.approx({0: 19_800, 1: math.inf})
    assert s["q/q"].race(10) == f"{20_000 * 128 * 6.125 / 10e6:.0f} s / {19_800 * 128 * 32 / 10e6:.0f} s"
    # a pair whose every seed diverged (the GPU's llama-125m table) has a row of its own, its gap and races unknown
    assert s["bad/q"].race(10) == "—"
    bad = next(line for line in table(list(s.values()), [10]).splitlines() if line.startswith("| bad/q |"))
    assert "| diverged | —; **diverged** with seed 0 |" in bad


def test_the_table_gives_each_gap_its_standard_error_and_the_reference_its_spread():
    results = [run("none/none", seed, [(0, 5.0), (20, final)], bits=(32, 32))
               for seed, final in enumerate((1.0, 1.1, 1.2))]
    results += [run("q/q", seed, [(0, 5.0), (20, final)]) for seed, final in enumerate((1.01, 1.122, 1.2))]
    lines = table(summarize(results, "none/none"), [10]).splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in lines}
    assert standard_error([1.0, 2.0, 0.0]) == pytest.approx(1 / math.sqrt(3))
    # a diverged seed's gap is not a number: no error (Python 3.12's statistics raises on one), a nan
    assert all(math.isnan(standard_error(gaps)) for gaps in ([1.0], [math.nan, 1.0], [1.0, math.inf]))
    assert spread([1.0, 1.1, 1.2]) == pytest.approx(100 * 0.2 / 1.1)
    assert "| +1.00% ± 0.58 (+1.00, +2.00, +0.00) |" in rows["q/q"]  # paired: each seed against its own reference
    assert "| spread 18.2% (1.0000 to 1.2000) |" in rows["none/none"]


def test_a_run_stops_when_its_bench_has_gone(tmp_path, monkeypatch):
    """A worker whose bench was killed (its pool cannot be told) stops at its next step rather than
    training for nobody."""
    import multiprocessing

    from tahnode.tools.convergence_runs import train_one

    class Gone:
        @staticmethod
        def is_alive() -> bool:
            return False

    monkeypatch.setenv("TAHNODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: Gone())
    spec = bench_convergence.plan(bench_convergence.build_parser().parse_args([*ARGS, "--pairs", "none/none",
                                                                               "--seeds", "1"]))[0]
    with pytest.raises(SystemExit, match="the bench that started it has ended"):
        train_one(spec)


@pytest.mark.slow
def test_a_bench_ended_by_sigterm_leaves_no_process_behind(tmp_path):
    """SIGTERM (a `timeout`, a service manager) ends the bench at once, and its workers and their manager
    with it, mid-step: none is left training or waiting."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from tahnode.tools.bench_probes import process_tree

    argv = [sys.executable, "-m", "tahnode.cli", "bench", "convergence", *ARGS, "--steps", "100000", "--pairs",
            "none/none", "--workdir", str(tmp_path / "work"), "--no-doc"]
    bench = subprocess.Popen(argv, env={**os.environ, "TAHNODE_CACHE": str(tmp_path / "cache")},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(helpers := process_tree(bench.pid)[1:]) < 3:  # the manager and two workers
            assert bench.poll() is None and time.monotonic() < deadline, "the bench did not start its workers"
            time.sleep(0.2)
        time.sleep(3)  # into training
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=30)
        deadline = time.monotonic() + 15
        while left := [pid for pid in helpers if os.path.exists(f"/proc/{pid}") and _alive(pid)]:
            assert time.monotonic() < deadline, f"left behind: {left}"
            time.sleep(0.2)
    finally:
        for pid in process_tree(bench.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not list((tmp_path / "work").glob("*.json"))


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_bench_trains_on_its_reference_schedule_unless_a_config_names_another(tmp_path):
    """Without --config every run takes the bench's steadier [train] (60 warm-up steps); a TOML's [train]
    is taken whole, and the two never share a result file."""
    parse = bench_convergence.build_parser().parse_args
    default = bench_convergence.plan(parse(["--pairs", "none/none", "--seeds", "1"]))[0].run_config().train
    assert (default.lr, default.warmup_steps, default.micro_batches) == (3e-3, 60, 4)
    toml = tmp_path / "mine.toml"
    toml.write_text("[train]\nlr = 1e-3\n")
    mine = bench_convergence.plan(parse(["--pairs", "none/none", "--seeds", "1", "--config", str(toml)]))[0]
    assert (mine.run_config().train.lr, mine.run_config().train.warmup_steps) == (1e-3, 10)  # the run default
    assert mine.key != bench_convergence.plan(parse(["--pairs", "none/none", "--seeds", "1"]))[0].key


def test_runs_at_two_messages_a_step_keep_their_result_files(monkeypatch):
    """The GPU's 125M runs in docs/runs/gpu-125m, trained at 2 messages a step before the bench's reference
    took 4, resume with --messages-per-step 2 (as .ci/gpu-checks asks); the default trains runs of its own."""
    argv = ["--device", "cuda", "--model", "llama-125m", "--stages", "4", "--seq-len", "512", "--tokens-per-message",
            "8192", "--steps", "600", "--seeds", "2", "--config", "docs/runs/gpu-125m/run.toml", "--jobs", "4",
            "--pairs", "none/none;tahquant:group_size=128,qmax=12@start=0.12,end=0,qmax=31/pertoken"]
    monkeypatch.chdir(ROOT)  # the runs were keyed with the TOML's path from the repository's root
    parse, work = bench_convergence.build_parser().parse_args, ROOT / "docs/runs/gpu-125m"
    before = bench_convergence.plan(parse([*argv, "--messages-per-step", "2"]))
    assert len(before) == 4 and all(spec.result_file(work).exists() for spec in before)
    assert "--messages-per-step 2" in (ROOT / ".ci/gpu-checks").read_text()
    assert not any(spec.result_file(work).exists() for spec in bench_convergence.plan(parse(argv)))


def test_pairs_split_on_semicolons_else_commas_and_one_pair_keeps_its_commas():
    parse = bench_convergence.parse_pairs
    assert [p.label for p in parse("none/none,tahquant-paper/naive")] == ["none/none", "tahquant-paper/naive"]
    one = parse("tahquant:group_size=64,qmax=11/pertoken")
    assert len(one) == 1 and (one[0].forward, one[0].forward_params) == ("tahquant", {"group_size": 64, "qmax": 11})
    assert len(parse("tahquant:group_size=64,qmax=11/pertoken;none/none")) == 2
    with pytest.raises(ValueError, match="tahquant-paper"):  # a CodecError: tahquant's layouts are codecs now
        parse("tahquant:layout=1/pertoken")
    paper = parse("tahquant-paper:rho=0.5@start=0.1,bits_high=6/tahquant-paper")[0]
    assert (paper.forward, paper.forward_params, paper.backward) == ("tahquant-paper", {"rho": 0.5}, "tahquant-paper")
    assert paper.schedule == {"forward_high_params": {"bits_high": 6}, "forward_high_start": 0.1,
                              "forward_high_end": 0.0}


def test_a_swarm_with_a_shorter_schedule_is_compared_with_its_reference_and_timed_against_one_pipeline():
    """--swarm-steps: the P pipelines and their reference with P× the batch train N steps (their
    schedule over N), one pipeline alone --steps; the row pairs each swarm run with the reference of
    its seed and length, and the wall-clock column is the swarm's steps to that pipeline's final
    loss over that pipeline's steps."""
    from types import SimpleNamespace

    from tahnode.tools.convergence_pipelines import pipeline_report, pipeline_specs
    from tahnode.tools.convergence_runs import RunSpec

    base = [RunSpec("none/none", "none", {}, "none", {}, seed, "llama-tiny", 3, 20, 32, 8, 2) for seed in (0, 1)]
    args = SimpleNamespace(pipelines="4", outer_every="2", outer_bits=4, outer_lr=1.0, outer_momentum=0.0,
                           swarm_steps=10, outer_feedback="off")
    specs = pipeline_specs(base, args)
    assert [(s.pair, s.steps) for s in specs if s.seed == 0] == [
        ("none/none", 20), ("none/none 1×4 batch 10 steps", 10), ("none/none 4 pipelines H=2 10 steps", 10)]
    assert next(s for s in specs if s.swarm).messages_per_step == 2 and specs[1].messages_per_step == 8
    with pytest.raises(ValueError, match="--swarm-steps"):
        pipeline_specs(base, SimpleNamespace(**{**vars(args), "swarm_steps": -1}))
    # error feedback is in a run's [swarm] only when on: runs cached without it keep their keys
    assert "outer_feedback" not in next(s for s in specs if s.swarm).swarm
    fed = next(s for s in pipeline_specs(base, SimpleNamespace(**{**vars(args), "outer_feedback": "on"})) if s.swarm)
    assert fed.swarm["outer_feedback"] is True and fed.run_config().swarm.outer_feedback

    def result(pair, seed, evals, steps, **kw):
        return RunResult(pair, seed, tokens_per_step=1000, losses=[1.0] * steps, evals=[list(e) for e in evals],
                         bits_fwd=32, bits_bwd=32, dim=128, **kw)

    swarm = {"pipelines": 4, "activation_bytes": 1000, "averaging_bytes": 0, "outer_steps": 0}
    results = [result("none/none", s, [(0, 5.0), (10, 2.0), (20, 1.0)], 20) for s in (0, 1)]
    results += [result("none/none 1×4 batch 10 steps", s, [(0, 5.0), (10, 1.0)], 10) for s in (0, 1)]
    results += [result("none/none 4 pipelines H=2 10 steps", 0, [(0, 5.0), (5, 1.0), (10, 1.01)], 10, **swarm),
                result("none/none 4 pipelines H=2 10 steps", 1, [(0, 5.0), (5, 3.0), (10, 1.0)], 10, **swarm)]
    row = [c.strip() for c in pipeline_report(results, specs, 10).splitlines()[2].strip("|").split("|")]
    assert row[:3] == ["4", "every 2 steps, 4-bit, lr 1", "2"]
    assert row[4].startswith("+0.50% ± 0.50")  # +1% and 0% against the reference of their own seed and length
    assert row[7] == "8 of 10" and row[8] == "0.38×"  # steps 5 and 10 (7.5) to one pipeline's 1.0; over its 20 steps
    assert row[9] == "0.50×"  # the reference with four times the batch reaches 1.0 at its step 10 of the single's 20


def test_the_section_names_where_its_runs_trained_when_that_was_elsewhere():
    """A table made here from runs trained on a lent GPU says so, not that this machine trained them."""
    here, gpu = machine("cpu"), "16 CPU cores (x), 128 GiB, GPU NVIDIA H200; Python 3.12.3, torch 2.11.0"
    assert bench_convergence.trained_on([run("a", 0, [(0, 1.0)]) for _ in range(2)], "cpu") is not None
    mine = [RunResult("a", seed, 1, machine=here) for seed in range(2)]
    assert bench_convergence.trained_on(mine, "cpu") is None  # the usual case: the line names this machine
    mixed = [*mine, RunResult("a", 2, 1, machine=gpu), RunResult("a", 3, 1)]
    assert bench_convergence.trained_on(mixed, "cpu") == (f"2 runs on {here}; 1 run on {gpu}; "
                                                          "1 run that did not record where it trained")

"""`tahnode bench abuse` end to end, small: a real coordinator and stage daemon; a neighbour's padded
and never-ending frames, then a token holder's oversized and stats-padded heartbeats, fresh joins
and heartbeats under made-up sender names; the rows say what was sent and refused: every attack
stream is refused (none OK), the made-up senders are refused (no member of that name).

`--averaging`: the liar's lies, the figures of a row from made-up outcomes, the held-out samples, argument
errors; and one short real two-pipeline swarm whose stage-1 liar is excluded and reported, nobody honest banned."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from tahnode.config import RunConfig
from tahnode.tools import abuse_averaging, bench_abuse
from tahnode.tools.abuse_averaging_eval import Alone, heldout_ids
from tahnode.tools.abuse_averaging_swarm import LIAR, Exclusion, Setup, SwarmOutcome, banned_ids, exclusions
from tahnode.tools.averaging_liar import Lie, lie
from tahnode.tools import averaging_liar


@pytest.mark.slow
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


# -- --averaging: the pure parts ---------------------------------------------------------------------------------


def test_each_lie_is_what_it_says():
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(lie(Lie.REVERSED, g), -9 * g)
    assert torch.allclose(lie(Lie.TINY, g), g * 1e-9) and float(lie(Lie.TINY, g).norm()) < 1e-6
    assert float(lie(Lie.ZEROS, g).abs().max()) == 0.0
    noise = lie(Lie.RANDOM, g, torch.Generator().manual_seed(2))
    assert noise.shape == g.shape and noise.dtype == g.dtype
    assert float(noise.norm()) == pytest.approx(float(g.norm()), rel=1e-5)
    assert abs(float(torch.nn.functional.cosine_similarity(noise, g, dim=0))) < 0.05  # no direction of its own


def test_a_lie_is_named_as_on_the_command_line_and_an_unknown_one_is_refused(capsys):
    assert [Lie.parse(t) for t in ("-9x", "tiny", "zeros", " random")] == list(Lie)
    with pytest.raises(ValueError, match="no lie 'big': one of -9x, tiny, zeros, random"):
        Lie.parse("big")
    assert averaging_liar.main(["big", "join"]) == 2 and "no lie 'big'" in capsys.readouterr().err
    assert averaging_liar.main(["-9x", "coordinator"]) == 2 and "usage" in capsys.readouterr().err


def test_the_patched_outer_optimizer_sends_the_lie(monkeypatch, capsys):
    from tahnode.config.swarm import SwarmConfig
    from tahnode.train import outer

    monkeypatch.setattr(outer.OuterOptimizer, "pseudo_gradient", outer.OuterOptimizer.pseudo_gradient)
    layer = torch.nn.Linear(4, 4)
    opt = outer.OuterOptimizer(layer.parameters(), SwarmConfig())
    with torch.no_grad():
        layer.weight.add_(1.0)
    honest = opt.pseudo_gradient()
    averaging_liar.patch(Lie.REVERSED)
    assert torch.equal(opt.pseudo_gradient(), -9 * honest)
    assert "liar: outer step 1: sends -9x" in capsys.readouterr().out


def test_exclusions_and_bans_are_read_from_the_logs():
    log = ("2026-12-07 01:32:13,556 tahnode.pipeline WARN stage 1: excludes replica QmAbc from its groups: round 2: "
           "refused (cosine -0.43, norm ratio 9.03) (2 rounds held against it)\nstep 5/12 loss 4.1\n"
           "x WARN stage 0: excludes replica QmDef from its groups: round 7: opposed (cosine 0.02, norm ratio 1.11)\n")
    assert exclusions(log, "p0s1") == [Exclusion("p0s1", 1, "QmAbc", 2, "refused"),
                                       Exclusion("p0s1", 0, "QmDef", 7, "opposed")]
    events = ("INFO banned: p1s1-liar (stage 1) for 600 s: p0s1, p2s1 excluded it\nINFO joined: p0s0\n"
              "INFO banned: p1s1-liar (stage 1) for 600 s: again\nINFO banned: p0s0 (stage 0) for 600 s: x\n")
    assert banned_ids(events) == [LIAR, "p0s0"]


def _outcome(**fields) -> SwarmOutcome:
    base = dict(lie="-9x", seconds=120.0, losses=[5.0, 4.8, 4.6, 4.5, 4.4], reported=True, lies=40,
                outer=[{"steps": 40.0, "alone": 0.0, "refused": 0.0, "seconds": 9.0},
                       {"steps": 2.0, "alone": 38.0, "refused": 2.0, "seconds": 3.5}],
                excluded=[Exclusion("p0s1", 1, "QmLiar", 2, "refused"), Exclusion("p0s0", 0, "QmP1s0", 9, "opposed")])
    return SwarmOutcome(**{**base, **fields})


def test_a_rows_figures_from_made_up_outcomes():
    alone = Alone(heldout=4.0, losses=[5.0, 4.8, 4.61, 4.5], seconds=60.0)
    row = abuse_averaging.row_of(_outcome(banned=[LIAR]), 4.02, alone, pair=3.9, outer_every=4)
    assert row.vs_alone == pytest.approx(0.5) and row.vs_pair == pytest.approx(100 * (4.02 / 3.9 - 1))
    assert row.within_bar and row.excluded_at == 2 and row.offence == "refused" and row.reported
    assert row.honest_banned == [] and row.others == ["p0s0 excluded its stage-0 replica at outer step 9 (opposed)"]
    assert row.first_period == pytest.approx(0.01) and row.minutes == 2.0
    cells = abuse_averaging.cells(row)
    assert len(cells) == len(abuse_averaging.COLUMNS)
    assert cells[:6] == ["liar -9x", "4.0200", "+0.50%", "yes", "+3.08%", "at outer step 2 (refused)"]
    assert cells[7:] == ["none", "p0s0 excluded its stage-0 replica at outer step 9 (opposed)",
                         "s0 40 / 0 / 0, s1 2 / 38 / 2", "3.5", "2.0"]
    # more than 1% above one pipeline alone, never excluded, an honest id banned: the row says so
    worse = abuse_averaging.row_of(_outcome(excluded=[], reported=False, banned=["p0s1"]), 4.1, alone, None, 4)
    assert not worse.within_bar and worse.excluded_at is None and worse.honest_banned == ["p0s1"]
    assert abuse_averaging.cells(worse)[2:8] == ["+2.50%", "**no**", "—", "no", "no", "p0s1"]
    pair = abuse_averaging.row_of(_outcome(lie="none", excluded=[], lies=0), 3.9, alone, 3.9, 4)
    assert not pair.liar and abuse_averaging.cells(pair)[3:7] == ["—", "+0.00%", "—", "—"]
    assert len(abuse_averaging.cells(abuse_averaging.alone_row(alone))) == len(abuse_averaging.COLUMNS)


def test_the_report_goes_into_its_doc_section(tmp_path):
    alone = Alone(4.0, [5.0, 4.8], 30.0)
    rows = [abuse_averaging.alone_row(alone), abuse_averaging.row_of(_outcome(), 4.02, alone, None, 2)]
    doc = tmp_path / "log.md"
    args = argparse.Namespace(no_doc=False, doc=str(doc), name="abuse-averaging", eval_samples=64)
    text = abuse_averaging.report(rows, Setup(outer_steps=6, outer_every=2), args, "tahnode bench abuse --averaging")
    written = doc.read_text()
    assert text in written and "Command: `tahnode bench abuse --averaging`" in written
    assert "12 steps = 6 outer steps of 2" in written and "Machine:" in written


def test_the_held_out_samples_are_trained_by_no_pipeline():
    run = RunConfig.build("llama-tiny", None, **{"stages": 2, "train.steps": 40, "train.batch_size": 4,
                                                 "train.micro_batches": 2, "swarm.pipelines": 2})
    ids = heldout_ids(run, 1000, 100)
    assert len(ids) == 100 and ids == sorted(ids) and len(set(ids)) == 100
    from tahnode.train.data import SampleSchedule

    schedule = SampleSchedule.for_run(run, 1000)
    trained = {i for p in (0, 1) for s in range(40) for i in schedule.ids_at(s, 0, 8, p)}
    assert not trained & set(ids)
    with pytest.raises(ValueError, match="at most a quarter"):
        heldout_ids(run, 1000, 251)


def test_the_setup_gives_the_coordinator_two_pipelines_of_the_runs_steps():
    flags = Setup(outer_steps=6, outer_every=2, stages=3).coordinator_flags()
    as_dict = dict(zip(flags[::2], flags[1::2]))
    assert as_dict["--pipelines"] == "2" and as_dict["--steps"] == "12" and as_dict["--outer-every"] == "2"
    assert as_dict["--codec"] == "none" and as_dict["--backward-codec"] == "none"


@pytest.mark.parametrize("argv, message", [
    (["--outer-steps", "0"], "--outer-steps must be at least 1, got 0"),
    (["--stages", "1"], "--stages must be at least 2, got 1"),
    (["--lie", "big"], "no lie 'big'"),
    (["--lie", ","], "--lie names at least one lie"),
    (["--outer-timeout", "0"], "--outer-timeout must be > 0 seconds"),
    (["--eval-samples", "-1"], "--eval-samples must be at least 1"),
])
def test_bad_arguments_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_abuse.main(["--averaging", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_lie_that_starts_with_a_dash_is_taken_after_a_space():
    args, setup, lies = abuse_averaging.parse(["--lie", "-9x", "--outer-steps", "3"])
    assert lies == [Lie.REVERSED] and setup.steps == 3 * setup.outer_every
    assert abuse_averaging.parse(["--lie=-9x,zeros,-9x"])[2] == [Lie.REVERSED, Lie.ZEROS]
    assert abuse_averaging.parse([])[2] == list(Lie)


# -- --averaging: a short real swarm -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_short_averaging_bench_excludes_the_liar_and_bans_nobody_honest(capsys, tmp_path):
    argv = ["--averaging", "--lie", "-9x", "--outer-steps", "6", "--outer-every", "2", "--no-pair", "--eval-samples",
            "64", "--swarm-timeout", "400", "--workdir", str(tmp_path), "--no-doc", "--json"]
    assert bench_abuse.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in rows] == ["one pipeline alone (in-process)", "liar -9x"]
    liar = rows[1]
    # excluded by its honest replica within SUSPECT_ROUNDS of its first lie, and the heartbeats carry it
    assert liar["excluded_at"] is not None and liar["excluded_at"] <= 3 and liar["reported"]
    assert liar["honest_banned"] == [] and liar["lies"] >= liar["excluded_at"]
    assert liar["first_period"] is not None and liar["first_period"] < 1e-3  # the reference trains what it trains
    assert all(Path(p).exists() for p in (tmp_path / "lie-reversed" / "ck").iterdir())

"""`tahnode bench chaos`: the seeded fault schedule is the same for the same seed and keeps its
constraints; the report's figures (stalls, steps once, time to full speed, replicas' difference) come
out right from made-up runs; bad flags are named; and one short real run with kills reports them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from tahnode.tools import bench_chaos
from tahnode.tools.chaos.faults import (COORDINATOR, ChaosError, FaultKind, FaultTimes, ScheduleConfig, parse_faults,
                                        schedule)
from tahnode.tools.chaos.figures import figures, ledger_holes, longest_stall, samples_twice, time_to_full_speed
from tahnode.tools.chaos.record import RunRecord, mark_of, replica_spread
from tahnode.tools.chaos.report import row_cells

DAEMONS = tuple(f"n{k}" for k in range(1, 8))
ALL = tuple(FaultKind)


def plan(**kw) -> ScheduleConfig:
    return ScheduleConfig(**{"daemons": DAEMONS, "pipelines": 2, "stages": 3, "seed": 7, "every": 20.0,
                             "minutes": 20.0, "tail": 60.0, "kinds": ALL, **kw})


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    a, b, c = schedule(plan()), schedule(plan()), schedule(plan(seed=8))
    assert a == b and a != c
    assert [f.to_json() for f in a] == [f.to_json() for f in schedule(plan())]


def test_the_schedule_keeps_its_constraints():
    cfg = plan(every=10.0)
    faults = schedule(cfg)
    assert len(faults) > 50 and {f.kind for f in faults} == set(FaultKind)
    assert all(f.at % 10 == 0 and 10 <= f.at <= 20 * 60 - 60 for f in faults)
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    held: dict[str, float] = {}
    for f in faults:
        if f.kind is FaultKind.OVERLAP:
            assert 0 <= f.pipeline < 2 and 0 <= f.stage < 3 and f.target == ""
            continue
        assert (f.target == COORDINATOR) == (f.kind is FaultKind.COORDINATOR)
        assert f.target == COORDINATOR or f.target in DAEMONS
        assert held.get(f.target, 0.0) <= f.at, f"{f.label} at {f.at} while an earlier fault holds it"
        held[f.target] = f.at + cfg.times.span(f.kind)
        assert f.seconds == cfg.times.seconds(f.kind)
    only_kills = schedule(plan(kinds=(FaultKind.KILL,), every=30.0))
    assert len(only_kills) == (20 * 60 - 60) // 30 and {f.kind for f in only_kills} == {FaultKind.KILL}


def test_a_stop_longer_than_the_period_skips_times_when_every_daemon_is_held():
    faults = schedule(ScheduleConfig(("n1", "n2"), 1, 2, every=5.0, minutes=2.0, tail=0.0, kinds=(FaultKind.STOP,),
                                     times=FaultTimes(stop_s=12.0)))
    assert [f.at for f in faults][:4] == [5.0, 10.0, 20.0, 25.0]  # at 15 both are still stopped


@pytest.mark.parametrize("kw, message", [
    ({"every": 0.0}, "--every"), ({"minutes": 1.0}, "no fault fits"), ({"tail": -1.0}, "--tail")])
def test_a_schedule_that_cannot_be_made_says_which_flag(kw, message):
    with pytest.raises(ChaosError, match=message):
        plan(**kw)


def test_fault_kinds_are_parsed_and_an_unknown_one_is_named():
    assert parse_faults("kill, overlap,kill") == (FaultKind.KILL, FaultKind.OVERLAP)
    with pytest.raises(ChaosError, match="'kil'"):
        parse_faults("kil")
    with pytest.raises(ChaosError, match="restart-after"):
        FaultTimes(restart_after=0)


@pytest.mark.parametrize("argv, message", [
    (["--faults", "kill,nap"], "--faults takes"), (["--pipelines", "0"], "--pipelines must be 1 or more"),
    (["--name", "a b"], "--name takes"), (["--coordinator-args", "'unclosed"], "--coordinator-args"),
    (["--minutes", "0.5"], "no fault fits")])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    assert bench_chaos.main(["--plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_prints_the_schedule_without_starting_anything(capsys):
    assert bench_chaos.main(["--plan", "--minutes", "3", "--every", "40", "--faults", "kill,stop"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].split()[:2] == ["40.0", "s"]


def test_longest_stall_counts_the_edges_of_the_measurement():
    assert longest_stall([12.0, 15.0, 40.0], 10.0, 50.0) == (25.0, 15.0)
    assert longest_stall([], 0.0, 30.0) == (30.0, 0.0)
    assert longest_stall([5.0, 45.0], 10.0, 50.0) == (35.0, 10.0)  # times outside are not steps of the measurement


def test_ledger_holes_name_missing_and_skipped_steps_and_samples_twice():
    ledger = [{"pipeline": 0, "step": s, "sample_ids": [s]} for s in (0, 1, 2, 5, 6)]
    ledger[-1]["sample_ids"].append(5)  # step 6 trains a sample of step 5 again
    ledger += [{"pipeline": 1, "step": s, "sample_ids": [100 + s]} for s in (0, 1, 2)]
    ledger += [{"pipeline": 1, "step": 3, "sample_ids": [103], "skipped": True},
               {"pipeline": 1, "step": 4, "sample_ids": [1, 104]}]
    missing, skipped = ledger_holes(ledger)
    assert missing == {0: [3, 4]} and skipped == {1: [3]}
    # sample 5 twice in pipeline 0; sample 1 in both pipelines, whose lanes of the sample stream are epochs apart
    assert samples_twice(ledger) == 1


def test_time_to_full_speed_ends_at_the_step_that_opens_a_window_at_full_speed():
    # one step a second until 100, none until 130, then one every 0.5 s
    times = [float(t) for t in range(100)] + [130 + 0.5 * k for k in range(200)]
    assert time_to_full_speed(times, 100.0, full_rate=1.0, window=10.0, end=230.0) == pytest.approx(30.0)
    assert time_to_full_speed(times, 50.0, full_rate=1.0, window=10.0, end=230.0) == 0.0
    assert time_to_full_speed(times, 100.0, full_rate=5.0, window=10.0, end=230.0) is None


def made_up_run(t0: float = 1000.0) -> RunRecord:
    """Two pipelines, one step a second each for 120 s; a kill at 30 s stops pipeline 1 for 20 s; its
    steps 25-27 never made it into the ledger, and stage 0 logged 6 regroups."""
    settings = {"pipelines": 2, "stages": 3, "standbys": 1, "seq_len": 8, "batch_size": 2, "micro_batches": 1}
    r = RunRecord(settings=settings, measure={}, schedule=[{"at": 30.0}], times={}, plan={"every": 30.0},
                  t0=t0, t_end=t0 + 120)
    for p in (0, 1):
        for s in range(120):
            t = t0 + s if p == 0 or s < 30 else t0 + s + 20 if s < 100 else None
            if t is not None and not (p == 1 and 25 <= s <= 27):
                r.commits.append([t + 0.1 * p, p, s])
                r.ledger.append({"pipeline": p, "step": s, "sample_ids": [1000 * p + 2 * s, 1000 * p + 2 * s + 1]})
    r.events = [{"t": t0 + 30, "fault": 0, "kind": "kill", "action": "sigkill", "target": "n2", "detail": ""},
                {"t": t0 + 38, "fault": 0, "kind": "kill", "action": "restart", "target": "n2", "detail": ""}]
    r.log_marks = [[t0 + 31 + k, "n1", "regroup"] for k in range(6)] + [[t0 - 5, "n1", "regroup"]]
    r.node_ids = {f"host-{k}": f"n{k}" for k in range(8)}
    r.replicas = {"0": {"diff": 2e-9}, "1": {"diff": 3e-3}, "2": {"diff": None}}
    return r


def test_figures_of_a_made_up_run():
    run = made_up_run()
    base = made_up_run(t0=5000.0)
    base.commits = [[5000 + s / 2, p, s] for p in (0, 1) for s in range(240)]
    base.ledger = [{"pipeline": p, "step": s, "sample_ids": [0, 1]} for p in (0, 1) for s in range(240)]
    f = figures(run, base, window=10.0)
    assert f.baseline_tokens_per_s == pytest.approx(480 * 2 * 8 / 120)
    steps_in = 120 + (100 - 3)  # pipeline 1: steps 0..99 less the three missing
    assert f.tokens_per_s == pytest.approx(steps_in * 16 / 120)
    assert f.share == pytest.approx(steps_in / 480)
    assert f.longest_stall_s == pytest.approx(1.0)  # pipeline 0 never stopped
    assert f.pipeline_stall_s["1"] == pytest.approx(21.0)  # pipeline 1: step 29 at 1029.1, step 30 at 1050.1
    assert f.missing == {"1": [25, 26, 27]} and f.skipped == {} and f.samples_twice == 0
    assert [r["at"] for r in f.recoveries] == [30.0] and f.applied == {"kill": 1}
    assert f.after_last_s is None  # the baseline runs at 4 steps a second: this run never gets to 90% of it
    assert f.regroups_per_min == pytest.approx(6 / 2) and f.node_ids == 8 and f.daemons == 7
    # full speed from before the first fault: 57 steps in 30 s; 90% of it in 10 s is 17.1 steps, first
    # reached by the window 1047-1057 (11 steps of pipeline 0, 7 of pipeline 1 from 1050.1 on)
    alone = figures(run, None, window=10.0)
    assert alone.full_speed_from.startswith("this run") and alone.share is None
    assert alone.recoveries[0]["seconds"] == pytest.approx(17.0)
    cells = row_cells("r", run, alone)
    assert cells[0] == "r" and cells[1] == "1 kill, every 30 s" and cells[8] == "3"
    assert "s1 3.0e-03" in cells[11] and "s2 —" in cells[11]


def test_a_log_line_is_marked_with_its_time():
    t, mark = mark_of("2026-12-07 00:51:18,839 tahnode.pipeline WARNING stages are at steps 28..36: every stage "
                      "returns to its stage's latest outer step\n")
    assert mark == "regroup" and t == pytest.approx(time.mktime((2026, 12, 7, 0, 51, 18, 0, 0, -1)) + 0.839)
    assert mark_of("2026-12-07 00:51:18,839 tahnode.daemon ERROR n3: the averager did not start")[1] == "error"
    assert mark_of("2026-12-07 00:51:18,839 tahnode.pipeline INFO step 4 loss 3.2") is None
    assert mark_of("Dec 07 00:51:39.508 [ERROR] p2pd") is None


def test_replica_spread_compares_outer_weights_at_the_newest_common_step_up_to_the_drain(tmp_path):
    anchor = torch.arange(6, dtype=torch.float32)
    for name, steps, shift in (("n1", (20, 40), 0.0), ("n2", (20, 40, 43), 0.25), ("n3", (20,), 0.0)):
        (tmp_path / name).mkdir()
        for s in steps:
            save_file({"outer/anchor": anchor + shift * (s == 40)}, str(tmp_path / name / f"stage1-of3-step{s}"
                                                                        ".safetensors"))
    state = {"nodes": [{"address": "a1", "status": "active", "stage": 1, "pipeline": 0},
                       {"address": "a2", "status": "active", "stage": 1, "pipeline": 1},
                       {"address": "a3", "status": "failed", "stage": 1, "pipeline": None}]}
    out = replica_spread(state, {"n1": "a1", "n2": "a2", "n3": "a3"}, tmp_path, 3)
    assert out["1"]["step"] == 40 and out["1"]["diff"] == pytest.approx(0.25) and out["1"]["replicas"] == ["n1", "n2"]
    assert out["0"]["diff"] is None and "fewer than two" in out["0"]["note"]
    drained = replica_spread(state, {"n1": "a1", "n2": "a2", "n3": "a3"}, tmp_path, 3, at_most=39)["1"]
    assert drained["step"] == 20 and drained["diff"] == 0.0  # a save past the drain's step is not compared
    state["nodes"][1]["address"] = "a3"
    state["nodes"][2]["status"] = "standby"
    assert "no checkpoint step common" in replica_spread(state, {"n1": "a1", "n3": "a3"}, tmp_path / "none", 3)["1"][
        "note"]


def test_the_report_is_made_again_from_a_saved_record(tmp_path, capsys):
    path = made_up_run().save(tmp_path / "run" / "chaos.json")
    doc = tmp_path / "bench.md"
    argv = ["--from", str(path), "--name", "again", "--workdir", str(tmp_path), "--plots", str(tmp_path / "plots"),
            "--doc", str(doc), "--json"]
    assert bench_chaos.main(argv) == 0
    out = capsys.readouterr().out
    assert "| again | 1 kill, every 30 s |" in out and "pipeline 1 lacks steps 25–27" in out
    assert json.loads(out.strip().splitlines()[-1])["missing"] == {"1": [25, 26, 27]}
    text = doc.read_text()
    assert "<!-- bench-swarm:chaos:begin -->" in text and "![again](plots/again.png)" in text
    assert (tmp_path / "plots" / "again.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "rows.json").read_text())["chaos"]["again"]["cells"][0] == "again"


@pytest.mark.slow
def test_a_short_run_with_kills_reports_them(tmp_path):
    """One pipeline of two stages and a standby on 127.0.0.1, two kills 30 s apart: the faults happened
    (each kill, each restart), and the report has its table, its raw record and its plot."""
    work, plots = tmp_path / "w", tmp_path / "plots"
    out = subprocess.run([sys.executable, "-m", "tahnode.cli", "bench", "chaos", "--pipelines", "1", "--stages", "2",
                          "--standbys", "1", "--minutes", "1.5", "--every", "30", "--tail", "25", "--warmup-steps", "2",
                          "--drain", "30", "--checkpoint-every", "5", "--batch-size", "2", "--restart-after", "4",
                          "--name", "smoke", "--workdir", str(work), "--plots", str(plots), "--no-doc", "--json",
                          "--prefix", "tct-"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    f = json.loads(out.stdout.strip().splitlines()[-1])
    record = RunRecord.load(work / "smoke" / "chaos.json")
    actions = [(e["fault"], e["action"]) for e in record.events]
    assert actions.count((0, "sigkill")) == 1 and (0, "restart") in actions and (1, "sigkill") in actions
    assert f["applied"] == {"kill": 2} and len(f["recoveries"]) == 2 and f["daemons"] == 3
    assert record.commits and record.ledger and record.t_end - record.t0 == pytest.approx(90, abs=5)
    assert "| smoke | 2 kill, every 30 s |" in out.stdout and (plots / "smoke.png").stat().st_size > 10_000

"""Every [train] and [swarm] setting is a flag of `tahnode coordinator` and `tahnode demo`, made from
TrainConfig's and SwarmConfig's own fields (`--pipelines auto` too); a fine-tuning learning rate is
accepted (min_lr follows lr unless set) and reaches the run config the nodes receive; a contradiction
names the flags to change; the Makefile picks the CPU build of torch on a machine without an NVIDIA GPU."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from tahnode import cli
from tahnode.config import RunConfig, TrainConfig
from tahnode.config.flags import KNOB_TABLES, run_config_from, train_flag

ROOT = Path(__file__).resolve().parents[1]


def run_of(*flags: str, command: str = "coordinator") -> RunConfig:
    return run_config_from(cli.build_parser().parse_args([command, *flags]))


def options(command: str) -> set[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings}


@pytest.mark.parametrize("table", [kind for _, kind in KNOB_TABLES], ids=[name for name, _ in KNOB_TABLES])
@pytest.mark.parametrize("command", ["coordinator", "demo"])
def test_every_train_and_swarm_field_is_a_flag(command, table):
    flags = {train_flag(f) for f in dataclasses.fields(table)}
    assert len(flags) == len(dataclasses.fields(table))
    assert flags <= options(command), flags - options(command)
    help_text = cli.build_parser()._subparsers._group_actions[0].choices[command].format_help()
    for f in dataclasses.fields(table):
        assert train_flag(f) in help_text and f.metadata["help"].split()[0] in help_text


def test_swarm_flags_and_tables_reach_the_nodes(tmp_path):
    run = run_of("--pipelines", "3", "--outer-every", "7", "--outer-bits", "8", "--outer-momentum", "0.9",
                 "--standbys", "2")
    s = RunConfig.from_json(run.to_json()).swarm  # what a node gets in its JoinReply
    assert ((s.pipelines, s.outer_every, s.outer_bits, s.outer_momentum, s.standbys, s.data_slots)
            == (3, 7, 8, 0.9, 2, 3))
    auto = run_of("--pipelines", "auto", "--max-pipelines", "5").swarm
    assert (auto.auto, auto.data_slots) == (True, 5)
    toml = tmp_path / "run.toml"
    toml.write_text('[swarm]\npipelines = "auto"\nouter_every = 3\n')
    assert (run_of("--config", str(toml)).swarm.auto, run_of("--config", str(toml)).swarm.outer_every) == (True, 3)
    assert run_of("--config", str(toml), "--pipelines", "2").swarm.pipelines == 2  # a flag beats the file
    toml.write_text("[swarm]\npipelines = 'many'\n")
    with pytest.raises(ValueError, match=r"\[swarm\] pipelines is 'auto' or a whole number"):
        run_of("--config", str(toml))
    for bad, match in ((["--outer-every", "0"], "outer_every"), (["--outer-momentum", "1"], "outer_momentum"),
                       (["--min-chain-share", "2"], "min_chain_share")):
        with pytest.raises(ValueError, match=match):
            run_of(*bad)
    with pytest.raises(SystemExit):  # argparse: not auto, not a number
        run_of("--pipelines", "two")


@pytest.mark.parametrize("flags,lr,min_lr", [
    (["--lr", "1e-5"], 1e-5, 1e-6),
    (["--lr", "0"], 0.0, 0.0),
    (["--lr", "1e-4", "--min-lr", "1e-5"], 1e-4, 1e-5),
    ([], 3e-3, 3e-4),  # the defaults as before: min_lr = lr / 10
])
def test_fine_tuning_learning_rates_reach_the_nodes(flags, lr, min_lr):
    run = run_of(*flags, "--warmup-steps", "7", "--weight-decay", "0", "--beta2", "0.99", "--grad-clip", "0.5",
                 "--seed", "4", "--stall-timeout", "60")
    received = RunConfig.from_json(run.to_json())  # what a node gets in its JoinReply
    t = received.train
    assert (t.lr, t.min_lr) == pytest.approx((lr, min_lr))
    assert ((t.warmup_steps, t.weight_decay, t.beta2, t.grad_clip, t.seed, t.stall_timeout_s)
            == (7, 0.0, 0.99, 0.5, 4, 60.0))


def test_a_contradiction_names_both_flags(capsys):
    with pytest.raises(ValueError, match=r"--min-lr.*--lr"):
        run_of("--min-lr", "1", "--lr", "1e-3")
    assert cli.main(["coordinator", "--min-lr", "1", "--lr", "1e-3", "--store", "/nonexistent/never-made"]) == 2
    err = capsys.readouterr().err
    assert "--min-lr" in err and "--lr" in err and "Traceback" not in err


def test_min_lr_from_a_toml_and_a_bad_value(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nlr = 2e-5\nmin_lr = 0\n")
    assert run_of("--config", str(toml)).train.min_lr == 0.0
    toml.write_text("[train]\nmin_lr = 'low'\n")
    with pytest.raises(ValueError, match="min_lr must be a number"):
        run_of("--config", str(toml))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_picks_the_torch_build_by_the_machine():
    dry = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout
    has_gpu = subprocess.run("nvidia-smi -L 2>/dev/null | grep -q '^GPU'", shell=True).returncode == 0
    assert ('install -q "torch"' in dry) if has_gpu else ('install -q "torch==2.13.0"' in dry), dry
    forced = subprocess.run(["make", "-n", "-B", ".venv/.installed", "TORCH=torch==9.9"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60).stdout
    assert 'install -q "torch==9.9"' in forced

"""Chaos: one 3-stage run with a standby, in network namespaces, survives a stage killed, a link cut
for 5 s, a stage stopped for 18 s, the coordinator killed and restarted, and a corrupt checkpoint;
every step's samples are trained exactly once and the loss ends where an undisturbed run's does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tahnode.config import RunConfig
from tahnode.pipeline.checkpoint import CORRUPT_SUFFIX, read_verified
from tahnode.tools.swarm import LocalSwarm, fetch
from tahnode.train.data import SampleSchedule, open_dataset
from tahnode.train.local import train_local
from test_swarm import needs_root, swarm_cmd, wait_state

pytestmark = [pytest.mark.slow, pytest.mark.netns]

STEPS, BATCH, MICRO, SEQ, SEED = 240, 4, 2, 64, 5
FLAGS = ["--steps", str(STEPS), "--checkpoint-every", "5", "--micro-batches", str(MICRO), "--batch-size", str(BATCH),
         "--seq-len", str(SEQ), "--codec", "none", "--backward-codec", "none", "--seed", str(SEED)]


class Chaos:
    """The swarm under test: who holds what, and the user's ways of breaking and restarting it."""

    def __init__(self, prefix: str, workdir: Path):
        self.prefix, self.workdir = prefix, workdir
        self.pids = json.loads((workdir / "state.json").read_text())["pids"]
        self.commands = {name: self._cmdline(pid) for name, pid in self.pids.items()}

    @staticmethod
    def _cmdline(pid: int) -> list[str]:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")

    def state(self, predicate=lambda s: True, what: str = "the status page", timeout: float = 240) -> dict:
        return wait_state(self.workdir, predicate, timeout, what)

    def holders(self) -> dict[int, str]:
        return {n["stage"]: n["id"] for n in self.state()["nodes"] if n["status"] == "active"}

    def advance(self, steps: int, what: str) -> dict:
        """Wait until training went `steps` steps past where it is now."""
        now = self.state()["training"]["step"]
        return self.state(lambda s: s["training"]["step"] >= now + steps, f"{what}: step {now + steps}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pids[name], sig)

    def restart(self, name: str, stage: int | None = None) -> None:
        """Start `name` again in its namespace with its own command line (pinned to `stage` if given)."""
        args = list(self.commands[name])
        if stage is not None:
            args[args.index("--stage") + 1] = str(stage)
        log = open(self.workdir / "logs" / f"{name}.log", "a")
        proc = subprocess.Popen(["ip", "netns", "exec", self.prefix + name, *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.pids[name] = proc.pid

    def link(self, name: str, up: bool) -> None:
        subprocess.run(["ip", "-n", self.prefix + "hub", "link", "set", name, "up" if up else "down"], check=True)

    def log(self, name: str) -> str:
        return (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")


def corrupt_newest(folder: Path) -> Path:
    """Flip bytes in the middle of the newest checkpoint file in `folder` (a rotting disk)."""
    newest = max(folder.glob("stage*.safetensors"), key=lambda p: int(p.stem.rsplit("step", 1)[1]))
    data = bytearray(newest.read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + 64):
        data[k] ^= 0xFF
    newest.write_bytes(bytes(data))
    return newest


@needs_root
def test_training_survives_kill_cut_stop_restart_and_a_corrupt_checkpoint(tmp_path):
    prefix, workdir, cache = f"tc{os.getpid() % 1000}-", tmp_path / "swarm", tmp_path / "cache"
    try:
        swarm_cmd("up", "--nodes", "4", "--stages", "3", "--rtt", "60ms", "--heartbeat-timeout", "10", "--prefix",
                  prefix, "--workdir", str(workdir), *FLAGS, env={**os.environ, "TAHNODE_CACHE": str(cache)})
        chaos = Chaos(prefix, workdir)
        chaos.state(lambda s: len([n for n in s["nodes"] if n["status"] == "active"]) == 3
                    and s["training"]["step"] >= 10, "placement and 10 steps")

        # 1. kill -9 the holder of stage 1: the standby takes it over; the killed node comes back as a standby
        victim = chaos.holders()[1]
        chaos.kill(victim)
        chaos.state(lambda s: any(n["stage"] == 1 and n["status"] == "active" and n["id"] != victim
                                  for n in s["nodes"]),
                    "the standby to take stage 1")
        chaos.restart(victim)
        chaos.state(lambda s: any(n["id"] == victim and n["status"] == "standby" for n in s["nodes"]), "a new standby")
        chaos.advance(5, "after the kill")

        # 2. cut stage 2's link for 5 s (less than the heartbeat timeout: nobody is replaced)
        cut = chaos.holders()[2]
        chaos.link(cut, up=False)
        time.sleep(5)
        chaos.link(cut, up=True)
        chaos.advance(5, "after the cut")
        assert chaos.holders()[2] == cut

        # 3. SIGSTOP stage 0 for 18 s: declared failed after 10 s, the standby takes over, the stopped one rejoins
        stopped = chaos.holders()[0]
        chaos.kill(stopped, signal.SIGSTOP)
        time.sleep(18)
        chaos.kill(stopped, signal.SIGCONT)
        chaos.state(lambda s: any(n["stage"] == 0 and n["status"] == "active" and n["id"] != stopped
                                  for n in s["nodes"]),
                    "stage 0 taken over")
        chaos.advance(5, "after the stop")

        # 4. kill -9 the coordinator and start it again on the same store
        chaos.kill("coord")
        time.sleep(2)
        chaos.restart("coord")
        chaos.advance(5, "after the coordinator's restart")

        # 5. a rotting disk: stage 2's newest checkpoint is corrupt when its node restarts. The standby goes first
        # (a killed holder is failed within seconds, its address refusing: the standby would take stage 2, and the
        # restarted holder never load its own checkpoint); it is back once the holder took its stage again
        spare = next(name for name in chaos.pids if name != "coord" and name not in chaos.holders().values())
        chaos.kill(spare)
        chaos.state(lambda s: all(n["status"] in ("failed", "left") for n in s["nodes"] if n["id"] == spare),
                    "the standby gone")
        holder = chaos.holders()[2]
        chaos.kill(holder)
        corrupted = corrupt_newest(workdir / "ck" / holder)
        chaos.restart(holder, stage=2)
        chaos.state(lambda s: any(n["id"] == holder and n["stage"] == 2 and n["status"] == "active"
                                  for n in s["nodes"]), "the holder back on stage 2")
        chaos.restart(spare)
        final = chaos.state(lambda s: s["training"]["finished"] and s["training"]["step"] >= STEPS, f"{STEPS} steps",
                            600)
        ledger = fetch(json.loads((workdir / "state.json").read_text())["http"], "ledger")["steps"]
        log = chaos.log(holder)
    finally:
        LocalSwarm.down(prefix, workdir)
    assert corrupted.with_name(corrupted.name + CORRUPT_SUFFIX).exists()
    if corrupted.exists():  # the store's copy of that step, fetched in its place (and not pruned yet): whole
        read_verified(corrupted)
    assert "corrupt" in log
    assert final["epoch"] > 0
    assert [e["step"] for e in ledger] == list(range(STEPS))
    run = RunConfig.build("llama-tiny",
                          **{"train.steps": STEPS, "train.batch_size": BATCH, "train.micro_batches": MICRO,
                             "train.seq_len": SEQ, "train.seed": SEED, "codec.forward": "none",
                             "codec.backward": "none", "codec.backward_params": {}})
    dataset = open_dataset(run, str(cache))
    schedule = SampleSchedule.for_run(run, len(dataset))
    for e in ledger:
        assert sorted(e["sample_ids"]) == sorted(i for m in range(MICRO) for i in schedule.ids(e["step"], m))
    trained = [i for e in ledger for i in e["sample_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * BATCH * MICRO  # within one epoch: none lost, none twice
    reference = train_local(run, dataset)
    last, expected = sum(e["loss"] for e in ledger[-5:]) / 5, sum(reference[-5:]) / 5
    assert abs(last - expected) <= 0.02 * expected

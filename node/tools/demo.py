"""`tahnode demo` / `make demo`: a coordinator and one stage daemon per stage (per stage and pipeline,
with --pipelines N) as real processes on 127.0.0.1, training on built-in defaults with progress
shown, ending with a summary."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import RunConfig
from ..config.token import new_token_file
from .interrupt import stops_as_interrupt
from .swarm import fetch, free_ports, share_of_cores

WARM_STEPS = 2  # steps that compile kernels and fill caches; the codec share counts after them
LAST_REPORTS_S = 15.0  # how long the summary waits, once the loss stage finished, for the other stages' last reports


def warm_steps(run: RunConfig) -> int:
    """The step from which the codec share counts: WARM_STEPS after the start, or after the opening
    phase of the run's precision schedule, whose end switches the forward codec to its run
    parameters and so compiles its GPU kernels again; never past the run's last step."""
    steps = run.train.steps
    first_low = next((s for s in range(steps) if not run.codec.high_phase(s, steps)), 0)
    return min(first_low + WARM_STEPS, steps - 1)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def codec_share(state: dict, since: dict | None) -> float:
    """The largest share of a stage's step time spent in encode + decode between two states of the
    swarm (from the start when `since` is None): the first steps, which compile kernels, can be left out."""
    before = {n["id"]: n for n in (since or {}).get("nodes", [])}
    shares = []
    for n in state["nodes"]:
        b = before.get(n["id"], {})
        step = n.get("step_seconds", 0.0) - b.get("step_seconds", 0.0)
        if n["stage"] >= 0 and step > 0:
            shares.append((n.get("codec_seconds", 0.0) - b.get("codec_seconds", 0.0)) / step)
    if not shares and since is not None:  # no heartbeat since `since` (a short run): from the start then
        return codec_share(state, None)
    return max(shares, default=0.0)


def stages_reported(state: dict) -> bool:
    """Every stage's holder has sent its last report (finished): the summary's byte and bit counts
    are whole only then, as the stages before the loss stage finish after it, and a short run
    can end before their first periodic report."""
    done = {n["stage"] for n in state["nodes"] if n["finished"]}
    return done >= set(range(state["stages"]))


def summary_of(state: dict, elapsed: float, warm: dict | None = None) -> dict:
    """The demo's result; `warm`: the state after its first steps (the codec share counts from there)."""
    t = state["training"]
    return {
        "steps": t["step"],
        "loss_first": t["loss_first"],
        "loss_last": t["loss"],
        "tokens_per_s": t["tokens_per_s"],
        "forward_bits_per_element": t["bits_per_element"],
        "backward_bits_per_element": t["backward_bits_per_element"],
        "wire_bytes": t["wire_bytes"],
        "uncompressed_bytes": t["uncompressed_bytes"],
        "replays": t.get("replays", 0),
        "codec_share": codec_share(state, warm),
        "seconds": round(elapsed, 1),
        "losses": [loss for _, loss in state.get("loss_history", [])],
    }


class Swarm:
    """The child processes of the demo; stops them all on exit, whatever happens."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "tahnode.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append((name, proc))
        return proc

    def failed(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() not in (None, 0)]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the stage daemons (they save and leave), then the coordinator; kill stragglers."""
        nodes = [p for name, p in self.procs if name != "coordinator"]
        coordinator = [p for name, p in self.procs if name == "coordinator"]
        for group in (nodes, coordinator):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def tail(self, name: str, lines: int = 15) -> str:
        text = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@stops_as_interrupt()  # the daemons run in sessions of their own: `kill`, `timeout` or a closed terminal stops them
def main(args, run: RunConfig) -> int:
    console = Console(stderr=True, highlight=False)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tahnode-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if getattr(args, "swarm_max_per_host", None) is None:  # every daemon on this machine: its replicas too
        run.swarm.max_per_host = 0
    (workdir / "run.toml").write_text(run.to_toml())
    grpc_port, http_port = free_ports(2)
    if args.http_port and args.http_port != grpc_port and port_free(args.http_port):
        http_port = args.http_port
    token = new_token_file(workdir / "token")  # a fresh secret for every demo swarm
    swarm = Swarm(workdir)
    started = time.monotonic()
    try:
        swarm.start("coordinator",
                    ["coordinator", "--listen", f"127.0.0.1:{grpc_port}", "--http", f"127.0.0.1:{http_port}",
                     "--model", args.model, "--config", str(workdir / "run.toml"), "--token-file", str(token),
                     "--store", str(workdir / "store")])
        # --pipelines N: N chains (a pinned node takes the first open one)
        pipelines = 1 if run.swarm.auto else run.swarm.pipelines
        for name in (f"p{p}-stage{k}" if p else f"stage{k}" for p in range(pipelines) for k in range(run.stages)):
            stage = name.rsplit("stage", 1)[1]
            swarm.start(name,
                        ["join", "--coordinator", f"127.0.0.1:{grpc_port}", "--stage", stage, "--listen", "127.0.0.1:0",
                         "--node-id", f"demo-{name}", "--token-file", str(token), "--checkpoint-dir",
                         str(workdir / "checkpoints" / name), "--device", args.device,
                         "--threads", str(share_of_cores(run.stages * pipelines))])
        chains = (f"{pipelines} pipelines of {run.stages} stage daemons" if pipelines > 1
                  else f"{run.stages} stage daemons")
        console.print(f"tahnode demo: coordinator + {chains} on 127.0.0.1, {run.model.n_layers}-layer model, "
                      f"codecs {run.codec.forward}/{run.codec.backward}, {run.train.steps} steps, device {args.device}")
        console.print(f"status page: http://127.0.0.1:{http_port}/   logs and checkpoints: {workdir}")
        state = warm = ended = None
        warm_at = warm_steps(run)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("training", total=run.train.steps, info="starting (stage 0 prepares the corpus)")
            while True:
                time.sleep(0.5)
                failed = swarm.failed()
                if failed:
                    bar.stop()
                    for name in failed:
                        console.print(f"[red]{name} exited with an error[/red]; last lines of "
                                      f"{workdir / (name + '.log')}:\n{swarm.tail(name)}")
                    return 1
                state = fetch(f"http://127.0.0.1:{http_port}") or state
                if not state:
                    continue
                t = state["training"]
                info = (f"loss {t['loss']:.3f}  {t['tokens_per_s']:.0f} tok/s  {t['bits_per_element']:.2f} bits/el"
                        if t["loss"] is not None else "warming up")
                bar.update(task, completed=t["step"], info=info)
                if warm is None and t["step"] >= warm_at > 0:
                    warm = state
                if t["finished"] and t["step"] >= run.train.steps:
                    ended = ended or time.monotonic()
                    if stages_reported(state) or time.monotonic() - ended > LAST_REPORTS_S:
                        break
        summary = summary_of(state, time.monotonic() - started, warm)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the swarm (each stage saves its checkpoint)")
        swarm.stop()
        return 130
    finally:
        swarm.stop()
    ratio = summary["uncompressed_bytes"] / max(1, summary["wire_bytes"])
    console.print(
        f"done: {summary['steps']} steps in {summary['seconds']} s; loss {summary['loss_first']:.3f} -> "
        f"{summary['loss_last']:.3f}; {summary['tokens_per_s']:.0f} tokens/s ({100 * summary['codec_share']:.1f}% of a "
        f"stage's step in encode + decode); activations {summary['forward_bits_per_element']:.2f} bits/element, "
        f"gradients {summary['backward_bits_per_element']:.2f}; {summary['wire_bytes'] / 2**20:.1f} MB on the wire vs "
        f"{summary['uncompressed_bytes'] / 2**20:.1f} MB uncompressed ({ratio:.1f}x less)"
    )
    if args.json:
        print(json.dumps(summary))
    return 0

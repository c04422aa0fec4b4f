"""The stage daemons train for real: three `tahnode join` processes and a coordinator on loopback,
real gRPC, checked against single-process training and across codecs, restarts and bad peers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from swarm import Swarm
from tahnode.config import RunConfig
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.identity import NodeKey
from tahnode.net.framing import frames_of
from tahnode.proto import tahnode_pb2 as pb
from tahnode.proto import tahnode_pb2_grpc as pb_grpc
from tahnode.train.data import open_dataset
from tahnode.train.local import train_local

pytestmark = pytest.mark.slow
SMALL = ["--micro-batches", "2", "--batch-size", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def swarm(tmp_path, cache):
    s = Swarm(tmp_path, cache=cache)
    yield s
    s.stop()


def run_swarm(swarm: Swarm, steps: int, *flags: str, stages: int = 3) -> dict:
    swarm.start_coordinator("--steps", str(steps), "--stages", str(stages), *flags)
    for k in range(stages):
        swarm.join(f"n{k}", k, "--quiet")
    return swarm.wait_finished(steps)


def plain_frames(sealer, to: str, data: bytes) -> list[pb.Frame]:
    """The frames of `data` as protobuf Frames (what the generated stub serializes)."""
    return [pb.Frame.FromString(f.SerializeToString()) for f in frames_of(sealer, to, data)]


@pytest.mark.parametrize("host_copy", ["inline", "overlap"])
def test_pipeline_equals_single_process(swarm, cache, host_copy):
    """Codec none, fp32, fixed seed: 5 steps of 3 stages give the losses of one process to 1e-5,
    whether the compute thread checksums what it sends or the link's thread does (train.host_copy)."""
    state = run_swarm(swarm, 5, "--codec", "none", "--backward-codec", "none", "--seed", "3", "--host-copy", host_copy)
    run = RunConfig.build("llama-tiny", **{"train.steps": 5, "codec.forward": "none", "codec.backward": "none",
                                            "codec.backward_params": {}, "train.seed": 3})
    reference = train_local(run, open_dataset(run, str(cache)))
    losses = swarm.losses(state)
    assert [s for s, _ in state["loss_history"]] == [0, 1, 2, 3, 4]
    assert losses == pytest.approx(reference, abs=1e-5)
    assert reference[-1] < reference[0]
    for k in range(3):
        assert swarm.wait_exit(f"n{k}") == 0


def test_tahquant_converges_like_none(swarm, tmp_path, cache):
    """The default pair (tahquant forward, pertoken 6-bit backward): the loss falls clearly
    over 100 steps and ends no more than 2% above the uncompressed run with the same seed."""
    state = run_swarm(swarm, 100, *SMALL)
    quant = swarm.losses(state)
    # C = 128: one tile per token, Rice-coded at qmax 12 (about 4.4 bits here); the precision schedule
    # sends 12 of the 100 steps at qmax 31
    assert 4.3 < state["training"]["bits_per_element"] < 4.7
    assert 6.0 < state["training"]["backward_bits_per_element"] < 6.4  # + a bf16 scale per token and 128 channels
    swarm.stop()
    plain = Swarm(tmp_path / "none", cache=cache)
    (tmp_path / "none").mkdir()
    try:
        ref = plain.losses(run_swarm(plain, 100, *SMALL, "--codec", "none", "--backward-codec", "none"))
    finally:
        plain.stop()
    first, last = sum(quant[:5]) / 5, sum(quant[-10:]) / 10
    assert last < first - 1.5
    # not worse than uncompressed by more than 2% (over the last 10 steps of 2 samples each: on this
    # tiny run the compressed one ended 3% *below* none, which is noise, not a defect)
    assert last <= 1.02 * sum(ref[-10:]) / 10


@pytest.mark.parametrize("codec,schedule",
                         [("naive", "gpipe"), ("group", "1f1b"), ("aqsgd", "1f1b"), ("amaq", "gpipe")])
def test_every_codec_trains_through_the_pipeline(swarm, codec, schedule):
    state = run_swarm(swarm, 12, *SMALL, "--codec", codec, "--schedule", schedule)
    losses = swarm.losses(state)
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
    t = state["training"]
    if codec == "amaq":  # starts at 8 bits per channel and anneals down
        assert 8.0 < t["bits_per_element"] < 9.0
    if codec == "aqsgd":  # samples differ each step: first visits go in full precision
        assert t["bits_per_element"] > 16


def test_a_kernel_stage_and_reference_stages_interoperate(swarm, tmp_path, cache):
    """Stage 1 encodes and decodes with the Triton kernels (what a GPU node runs; here in Triton's
    interpreter), stages 0 and 2 with the pure-torch references: the run trains as the all-reference
    run does, step for step (the payloads match up to the documented Hadamard rounding)."""
    pytest.importorskip("triton")
    flags = ("--micro-batches", "2", "--batch-size", "2", "--seq-len", "32")
    swarm.start_coordinator("--steps", "4", *flags)
    swarm.join("n0", 0, "--quiet")
    swarm.join("n1", 1, "--quiet", env={"TAHNODE_FORCE_TRITON": "1", "TRITON_INTERPRET": "1"})
    swarm.join("n2", 2, "--quiet")
    mixed = swarm.losses(swarm.wait_finished(4))
    swarm.stop()
    (tmp_path / "ref").mkdir()
    plain = Swarm(tmp_path / "ref", cache=cache)
    try:
        reference = plain.losses(run_swarm(plain, 4, *flags))
    finally:
        plain.stop()
    assert mixed == pytest.approx(reference, rel=1e-3)
    assert reference[-1] < reference[0]


def test_sigterm_and_restart_resumes_from_checkpoint(swarm):
    """SIGTERM stage 1 mid-run: it saves its stage; restarted, it resumes and the run completes
    with every step trained exactly once."""
    swarm.start_coordinator("--steps", "40", "--checkpoint-every", "5", *SMALL)
    for k in range(3):
        swarm.join(f"n{k}", k, "--quiet")
    swarm.wait_for(lambda s: s["training"]["step"] >= 10, 120, "step 10")
    swarm.procs["n1"].send_signal(signal.SIGTERM)
    assert swarm.wait_exit("n1") == 0
    assert "saving stage 1" in swarm.log("n1")
    swarm.join("n1", 1, "--quiet")
    state = swarm.wait_finished(40)
    assert "resumed stage 1 from its checkpoint" in swarm.log("n1")
    steps = [s for s, _ in state["loss_history"]]
    assert steps == list(range(40))
    losses = swarm.losses(state)
    assert sum(losses[-5:]) < sum(losses[:5]) - 5
    assert state["training"]["replays"] >= 1


def test_bad_peers_get_clear_errors_and_the_daemon_keeps_serving(swarm):
    swarm.start_coordinator("--steps", "200", *SMALL)  # long enough for the stranger's wait
    for k in range(3):
        swarm.join(f"n{k}", k, "--quiet")
    state = swarm.wait_for(lambda s: s["training"]["step"] >= 3, 120, "step 3")
    target = next(n["address"] for n in state["nodes"] if n["id"] == "n1")
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.StageServiceStub(ch)
        run = state["run"]
        wrong = Sealer(SwarmKey("not-the-token"), "intruder", run)
        env = pb.Envelope(shutdown=pb.Shutdown(step=1)).SerializeToString()
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(iter(plain_frames(wrong, "n1", env)), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authentication" in err.value.details()
        # a token holder, but no neighbour of n1
        right = Sealer(SwarmKey(swarm.token), "confused", run, NodeKey.generate())
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(iter(plain_frames(right, "n1", b"\xff\xff\xff garbage")), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not a neighbour" in err.value.details()
        impostor = Sealer(SwarmKey(swarm.token), "n0", run, NodeKey.generate())  # n0's name, not n0's key
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(iter(plain_frames(impostor, "n1", env)), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not signed by the key" in err.value.details()
        for sealer in (None, wrong):  # who is here and which stage it holds: only for the swarm
            ping = pb.PingRequest(nonce=b"12345678")
            with pytest.raises(grpc.RpcError) as err:
                stub.Ping(sealer.seal(ping, "n1") if sealer else ping, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ping = right.seal(pb.PingRequest(nonce=b"12345678"), "n1")
        reply = stub.Ping(ping, timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            stub.Ping(ping, timeout=5)  # recorded and sent again
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "replayed" in err.value.details()
        assert reply.nonce == b"12345678" and reply.node_id == "n1" and reply.stage == 1
    final = swarm.wait_finished(200)
    assert [s for s, _ in final["loss_history"]] == list(range(200))
    n1 = {r["reason"]: r["count"] for r in final["refused"] if r["receiver"] == "n1"}
    # reported by the node, shown by the coordinator (a neighbour's first frames, sent before n1's
    # assignment named it, waited for that assignment instead of counting as a stranger's)
    assert n1 == {"bad_mac": 3, "stranger": 1, "wrong_key": 1, "replayed": 1}


def test_a_standby_leaves_when_the_run_finishes(swarm):
    """A spare `--stage auto` node waits as a standby while two pinned nodes train; when the run
    ends it leaves the swarm and exits 0 instead of waiting for ever."""
    swarm.start_coordinator("--steps", "6", "--stages", "2", *SMALL)
    swarm.join("n0", 0, "--quiet")
    swarm.join("n1", 1, "--quiet")
    swarm.join("spare", "auto", "--quiet")
    swarm.wait_finished(6)
    assert swarm.wait_exit("spare", timeout=60) == 0  # heartbeats once a second, but two cores run three nodes
    log = swarm.log("spare")
    assert "waiting for a stage" in log and "a standby is no longer needed" in log
    swarm.wait_for(lambda s: next(n for n in s["nodes"] if n["id"] == "spare")["status"] == "left", 10,
                   "the spare's leave on the status page (a snapshot made once a second)")


def test_demo_runs_the_whole_swarm_and_prints_a_json_summary(tmp_path, cache):
    """`tahnode demo` as `make demo` runs it (fewer steps): real processes, a summary on the last line."""
    import json

    env = {**os.environ, "TAHNODE_CACHE": str(cache)}
    r = subprocess.run([sys.executable, "-m", "tahnode.cli", "demo", "--steps", "8", "--json", "--http-port", "0",
                        "--workdir", str(tmp_path / "demo")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(summary) >= {"steps", "loss_first", "loss_last", "tokens_per_s", "forward_bits_per_element",
                            "backward_bits_per_element", "wire_bytes", "uncompressed_bytes"}
    assert summary["steps"] == 8 and summary["loss_last"] < summary["loss_first"]
    assert (len(summary["losses"]) == 8 and summary["losses"][0] == summary["loss_first"]
            and summary["losses"][-1] == summary["loss_last"])
    assert 0.0 < summary["codec_share"] < 1.0  # tahquant encode/decode on the CPU: a real share of each step
    assert "of a stage's step in encode + decode" in " ".join(r.stderr.split())  # the summary line (rich wraps it)
    # the default forward codec, tahquant (Rice-coded, qmax 12): its size follows the activations
    assert 4.2 < summary["forward_bits_per_element"] < 4.7 and summary["wire_bytes"] * 4 < summary["uncompressed_bytes"]
    assert "status page: http://127.0.0.1:" in r.stderr
    assert sorted(p.name for p in (tmp_path / "demo" / "checkpoints").glob("*/*.safetensors")) == [
        "stage0-of3-step8.safetensors", "stage1-of3-step8.safetensors", "stage2-of3-step8.safetensors"]


def test_the_demo_codec_share_counts_from_the_state_after_warm_up():
    """The largest share of a stage's step time in encode + decode, over the steps after `warm`
    (the first steps compile kernels); from the start when no heartbeat came since."""
    from tahnode.tools.demo import codec_share

    def state(*nodes):
        return {"nodes": [dict(id=i, stage=st, codec_seconds=c, step_seconds=t) for i, st, c, t in nodes]}

    end = state(("a", 0, 3.0, 10.0), ("b", 1, 1.0, 10.0), ("s", -1, 0.0, 0.0))
    warm = state(("a", 0, 2.0, 4.0), ("b", 1, 0.5, 4.0))
    assert codec_share(end, None) == pytest.approx(0.3)
    assert codec_share(end, warm) == pytest.approx(1.0 / 6.0)  # a: 1 s of 6 s; b: 0.5 s of 6 s
    assert codec_share(end, end) == pytest.approx(0.3)  # nothing new since: the whole run
    assert codec_share(state(("s", -1, 0.0, 0.0)), None) == 0.0


def test_the_demo_summary_waits_for_every_stages_last_report():
    """The loss stage finishes first; the stages before it (the activations' senders) report their
    last figures after it, and a 2-step run can end before their first periodic report: the
    summary is read once every stage's holder reported finished (a standby's report counts for none)."""
    from tahnode.tools.demo import stages_reported

    def state(*nodes):
        return {"stages": 3, "nodes": [dict(id=f"n{i}", stage=st, finished=f) for i, (st, f) in enumerate(nodes)]}

    assert not stages_reported(state((0, False), (1, False), (2, True)))
    assert not stages_reported(state((0, True), (2, True), (-1, True)))
    assert not stages_reported(state((0, True), (1, False), (1, False), (2, True)))
    assert stages_reported(state((0, True), (1, False), (1, True), (2, True)))  # a replaced holder and its successor
    assert stages_reported(state((0, True), (1, True), (2, True), (-1, False)))


def test_the_demo_codec_share_counts_after_the_precision_schedules_opening_phase():
    """Leaving the schedule's opening phase compiles the forward codec's kernels for its run
    parameters again: the share counts from WARM_STEPS after it (from WARM_STEPS without a schedule)."""
    from tahnode.config import RunConfig
    from tahnode.tools.demo import WARM_STEPS, warm_steps

    assert warm_steps(RunConfig.build("llama-tiny", **{"train.steps": 30})) == 3 + WARM_STEPS  # 12% of 30: steps 0-2
    assert warm_steps(RunConfig.build("llama-tiny", **{"train.steps": 600})) == 72 + WARM_STEPS
    assert (warm_steps(RunConfig.build("llama-tiny", **{"train.steps": 30, "codec.forward_high_params": {}}))
            == WARM_STEPS)
    assert warm_steps(RunConfig.build("llama-tiny", **{"train.steps": 30, "codec.forward": "none"})) == WARM_STEPS
    assert warm_steps(RunConfig.build("llama-tiny", **{"train.steps": 3})) == 2  # never past the last step


def _processes_with(marker: str) -> list[int]:
    """Pids of the processes whose command line holds `marker`."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_demo_stops_every_process_on_ctrl_c_and_sigterm(tmp_path, cache, sig):
    """The daemons run in sessions of their own; Ctrl-C (SIGINT) or SIGTERM to `tahnode demo` stops
    them all, each stage saving its checkpoint, and the demo exits with 130."""
    from tahnode.tools.swarm import fetch, free_port

    port = free_port()
    env = {**os.environ, "TAHNODE_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "tahnode.cli", "demo", "--steps", "1000", "--http-port", str(port),
                             "--workdir", str(tmp_path / "demo")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    marker = str(tmp_path / "demo" / "token")  # the swarm's token file, on every daemon's command line
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            state = fetch(f"http://127.0.0.1:{port}")
            if state and state["training"]["step"] >= 2:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        else:
            pytest.fail("the demo did not reach step 2")
        assert len(_processes_with(marker)) == 4  # coordinator + 3 stages
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted: stopping the swarm" in err
    assert _processes_with(marker) == []
    saved = sorted(p.name for p in (tmp_path / "demo" / "checkpoints").glob("*/*.safetensors"))
    assert [n.split("-step")[0] for n in saved] == ["stage0-of3", "stage1-of3", "stage2-of3"], saved

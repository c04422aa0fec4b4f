"""A checkpoint's metadata is a typed, bounded record (issue 39, finding 1): a holder that uploads a
file whose SHA-256 and tensors are right but whose metadata is wrong JSON, wrong types or made-up
steps is refused with INVALID_ARGUMENT and the store keeps its copy; a node that meets such a file
moves it aside and resumes from the one before, and the ledger keeps its steps."""

from __future__ import annotations

import json

import grpc
import pytest
import torch
from safetensors.torch import save, save_file

from tahnode.config import RunConfig
from tahnode.net.freshness import COORDINATOR
from tahnode.net.inproc import InProcessNetwork
from tahnode.pipeline.checkpoint import DIGEST_KEY, CheckpointStore, digest, read_verified
from tahnode.pipeline.worker import StageWorker
from tahnode.proto import tahnode_pb2 as pb
from tahnode.train.model import build_stage
from servers import NODE, Servers
from test_malicious_member import heartbeat, stored, upload

def poisons(stage_params: list[str]) -> dict[str, dict]:
    """Metadata edits, each a way a file's metadata can lie (None: the key is gone)."""
    name = stage_params[0]
    return {
        "unreported not JSON": {"unreported": "[[0, 9.9"},
        "unreported [[0, 9.9]]": {"unreported": "[[0, 9.9]]"},
        "unreported an object": {"unreported": '{"0": 9.9}'},
        "unreported step 0 (a ledger wipe)": {"unreported": "[[0, 9.9, [], 0.0]]"},
        "unreported of a later step": {"unreported": "[[8, 9.9, [1], 0.5]]"},
        "unreported loss NaN": {"unreported": "[[7, NaN, [1], 0.5]]"},
        "unreported 10^6 sample ids": {"unreported": json.dumps([[7, 2.0, list(range(10**6)), 0.5]])},
        "unreported nested deep": {"unreported": "[" * 100_000 + "]" * 100_000},
        "optim_steps not JSON": {"optim_steps": "{"},
        "optim_steps a list": {"optim_steps": "[1]"},
        "optim_steps past the step": {"optim_steps": json.dumps({name: 1e12})},
        "optim_steps a string": {"optim_steps": json.dumps({name: "1"})},
        "optim_steps of no parameter": {"optim_steps": json.dumps({"backdoor": 1.0})},
        "run not JSON": {"run": "x"},
        "run a list": {"run": "[]"},
        "run too long": {"run": json.dumps({"pad": "x" * (1 << 20)})},
        "step made up": {"step": "12"},
        "step missing": {"step": None},
        "step not a number": {"step": "4_0"},
        "stage of another": {"stage": "1"},
    }


POISONS = list(poisons(["x"]))


def poisoned(path, edit: dict) -> bytes:
    """The file at `path` with its metadata edited and a right SHA-256."""
    tensors, meta = read_verified(path)
    for key, value in edit.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    meta[DIGEST_KEY] = digest(tensors, meta)
    return save(tensors, metadata=meta)


def trained(run: RunConfig, stage: int):
    model = build_stage(run.model, stage, run.stages, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.square().sum() for p in model.parameters()).backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The loss stage's sound checkpoints of steps 4 and 8 (step 8 holding step 7 unreported)."""
    run = RunConfig.build("llama-tiny", **{"train.steps": 20})
    store = CheckpointStore(tmp_path_factory.mktemp("sound"), keep=3)
    model, opt = trained(run, run.loss_stage)
    store.save(run.loss_stage, run.stages, 4, model, opt, run.to_json())
    store.save(run.loss_stage, run.stages, 8, model, opt, run.to_json(), unreported=[[7, 2.5, [1, 2], 0.5]])
    return run, store, [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("poison", POISONS)
def test_a_node_moves_a_checkpoint_with_lying_metadata_aside_and_resumes_from_the_one_before(saved, poison, tmp_path):
    """Before, resume() died with TypeError, JSONDecodeError or AttributeError (only CorruptCheckpoint
    was caught), on every standby that took the stage; or the poisoned step 0 went to the coordinator."""
    run, sound, params = saved
    store = CheckpointStore(tmp_path / "n", keep=3)
    store.dir.mkdir()
    for ckpt in sound.list(run.loss_stage, run.stages):
        (store.dir / ckpt.path.name).write_bytes(ckpt.path.read_bytes())
    newest = store.path(run.loss_stage, run.stages, 8)
    newest.write_bytes(poisoned(newest, poisons(params)[poison]))
    worker = StageWorker(run, run.loss_stage, InProcessNetwork().transport("x"), "cpu", store)
    try:
        assert worker.resume() == 4
        assert worker.stats.outbox == []  # nothing of the poisoned file's to report
        assert [c.step for c in store.list(run.loss_stage, run.stages)] == [4]
        assert newest.with_name(newest.name + ".corrupt").exists()
    finally:
        worker.close()


def test_a_sound_checkpoint_brings_back_its_unreported_steps(saved, tmp_path):
    run, sound, _ = saved
    worker = StageWorker(run, run.loss_stage, InProcessNetwork().transport("x"), "cpu", sound)
    try:
        assert worker.resume() == 8
        assert [(r.step, r.loss, list(r.sample_ids), r.seconds) for r in worker.stats.outbox] == [(7, 2.5, [1, 2], 0.5)]
    finally:
        worker.close()


@pytest.fixture
def servers(tmp_path):
    s = Servers(tmp_path)
    yield s
    s.stop()


@pytest.mark.parametrize("poison", POISONS)
def test_the_coordinator_refuses_an_upload_with_lying_metadata_and_keeps_its_copy(servers, poison):
    """Before, the store took it (its SHA-256 and tensors were right) and handed it to every standby."""
    names = [n for n, _ in build_stage(servers.run_cfg.model, 0, servers.run_cfg.stages).named_parameters()]
    assert upload(servers, servers.checkpoint.read_bytes(), step=7) is None
    kept = servers.registry.store.path(0, servers.run_cfg.stages, 7).read_bytes()
    assert (upload(servers, poisoned(servers.checkpoint, poisons(names)[poison]), step=7)
            == grpc.StatusCode.INVALID_ARGUMENT)
    assert stored(servers) == [7] and servers.registry.store.path(0, servers.run_cfg.stages, 7).read_bytes() == kept
    assert not list(servers.registry.store.dir.glob("*.part"))


def test_the_ledger_keeps_its_steps_when_the_loss_stage_changes_hands(servers, saved, tmp_path):
    """The variant: `unreported = [[0, 9.9, [], 0.0]]` in the loss stage's checkpoint made its next
    holder report step 0, and the coordinator's ledger went from 8 steps to 1."""
    run, sound, params = saved
    reg = servers.registry
    reg.join(servers.sealer("n-last", run="").seal(pb.JoinRequest(node_id="n-last", address="127.0.0.1:5",
                                                                  stage=run.loss_stage), COORDINATOR))
    heartbeat(servers, "n-last", [pb.LossPoint(step=k, loss=5.0 - k / 10, sample_ids=[k]) for k in range(8)])
    store = CheckpointStore(tmp_path / "n-last", keep=3)
    store.dir.mkdir()
    for ckpt in sound.list(run.loss_stage, run.stages):
        (store.dir / ckpt.path.name).write_bytes(ckpt.path.read_bytes())
    newest = store.path(run.loss_stage, run.stages, 8)
    newest.write_bytes(poisoned(newest, poisons(params)["unreported step 0 (a ledger wipe)"]))
    worker = StageWorker(run, run.loss_stage, InProcessNetwork().transport("x"), "cpu", store)
    try:
        worker.resume()
        heartbeat(servers, "n-last", list(worker.stats.report(worker.committed, 0).losses))
    finally:
        worker.close()
    assert sorted(reg.ledger()) == list(range(8)) and reg.ledger()[0].loss == 5.0


def test_a_checkpoint_keeps_the_run_of_unreported_steps_the_coordinator_would_end_with():
    """A rollback leaves steps trained again in the outbox after the old ones (the coordinator lets
    the later report of a step replace it and every step after it): a checkpoint keeps what that
    leaves, one run of steps up to its own, so that it parses back."""
    from tahnode.pipeline.checkpoint_meta import MAX_UNREPORTED, kept_unreported
    from tahnode.pipeline.state import StepRecord

    def steps(outbox: list[int], step: int) -> list[int]:
        return [r.step for r in kept_unreported([StepRecord(s, 1.0, [s], 0.1) for s in outbox], step)]

    assert steps([5, 6, 7, 5, 6], 7) == [5, 6]
    assert steps([7, 8, 5, 6], 7) == [5, 6]
    assert steps([5, 6, 7], 5) == []  # rolled back to 5, nothing trained again yet
    assert steps([2, 4, 5], 6) == [4, 5]
    assert steps(list(range(3000)), 3000) == list(range(3000 - MAX_UNREPORTED, 3000))


def test_codec_state_of_another_shape_is_a_corrupt_checkpoint(tmp_path):
    """Any file that does not load is corrupt, codec state too: an AMAQ gate of the wrong shape
    raised RuntimeError in copy_ (uncaught) on the node resuming from it."""
    run = RunConfig.build("llama-tiny", **{"train.steps": 20, "codec.forward": "amaq"})
    store = CheckpointStore(tmp_path / "n", keep=3)
    worker = StageWorker(run, 1, InProcessNetwork().transport("x"), "cpu", store)
    try:
        gate = worker.codecs.tensors()["amaq_gate"].detach().clone()
        model, opt = trained(run, 1)
        store.save(1, run.stages, 4, model, opt, run.to_json(), {"amaq_gate": gate + 1})
        store.save(1, run.stages, 8, model, opt, run.to_json(), {"amaq_gate": torch.zeros(gate.numel() + 1)})
        assert worker.resume() == 4
        assert torch.equal(worker.codecs.tensors()["amaq_gate"], gate + 1)
        assert [c.step for c in store.list(1, run.stages)] == [4]
    finally:
        worker.close()


def test_checkpoints_ahead_of_the_ledger_neither_push_out_confirmed_ones_nor_become_the_resume_point(servers):
    """Issue 39, finding 9: uploads of steps up to the ledger + 200 were taken as they came and the
    store kept its newest 3 whatever they were: a holder's 43, 44 and a made-up 250 pushed out the
    real 40, and every new holder resumed at 250. Files ahead of the ledger now wait apart."""
    reg, names = (servers.registry,
                  [n for n, _ in build_stage(servers.run_cfg.model, 0, servers.run_cfg.stages).named_parameters()])
    reg.join(servers.sealer("n-last", run="").seal(pb.JoinRequest(node_id="n-last", address="127.0.0.1:5",
                                                                  stage=servers.run_cfg.loss_stage), COORDINATOR))

    def at(step: int) -> bytes:
        return poisoned(servers.checkpoint, {"step": str(step)})

    heartbeat(servers, "n-last", [pb.LossPoint(step=k, loss=5.0, sample_ids=[k]) for k in range(8)])
    assert upload(servers, servers.checkpoint.read_bytes(), step=7) is None
    for step in (10, 11, 90):  # ahead of the ledger's 8 steps, within its slack and the run's 100
        assert upload(servers, at(step), step=step) is None
    assert stored(servers) == [7, 10, 11, 90] and reg.resume_step(0) == 7
    heartbeat(servers, "n-last", [pb.LossPoint(step=k, loss=5.0, sample_ids=[k]) for k in range(8, 11)])
    assert reg.resume_step(0) == 11  # the ledger holds 11 steps now: the file of step 11 is confirmed
    for step in (12, 13, 14):
        assert upload(servers, at(step), step=step) is None
    assert stored(servers) == [7, 10, 11, 13, 14, 90] and reg.resume_step(0) == 11  # 3 confirmed, 3 ahead

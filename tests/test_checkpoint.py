"""Checkpoint integrity: every file carries a SHA-256 of its metadata and tensors; a flipped bit,
a truncated file or a file of another run is refused before anything is loaded, and a corrupt file
never enters a store (the coordinator's uploads and a node's downloads go through ChunkWriter)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tahnode.config import RunConfig
from tahnode.pipeline.checkpoint import (DIGEST_KEY, CheckpointStore, ChunkWriter, CorruptCheckpoint, ForeignCheckpoint,
                                         digest, load, read_chunks, read_verified)
from tahnode.train.model import build_stage


def trained_stage(run: RunConfig, seed: int = 0):
    """Stage 1 of `run` after one AdamW step (so the optimizer has state to save)."""
    model = build_stage(run.model, 1, run.stages, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.square().sum() for p in model.parameters()).backward()
    opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path):
    run = RunConfig.build("llama-tiny", **{"train.steps": 4})
    model, opt = trained_stage(run)
    store = CheckpointStore(tmp_path / "ck")
    path = store.save(1, run.stages, 4, model, opt, run.to_json(), {"gate": torch.arange(5.0)})
    return run, store, path, model


def fresh_stage(run: RunConfig):
    model, opt = trained_stage(run, seed=7)
    return model, opt, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_checkpoint_records_its_sha256_and_loads_back_exactly(saved):
    run, store, path, model = saved
    tensors, meta = read_verified(path)
    assert len(meta[DIGEST_KEY]) == 64 and meta["step"] == "4"
    target, opt, _ = fresh_stage(run)
    extra, meta = load(store.latest(1, run.stages), target, opt, run)
    assert meta.step == 4 and meta.optim_steps and set(meta.optim_steps.values()) == {1}
    assert torch.equal(extra["gate"], torch.arange(5.0))
    for (name, a), b in zip(model.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name


def flip_last_data_byte(data: bytearray) -> None:
    data[-1] ^= 0x01


def flip_the_step_in_the_metadata(data: bytearray) -> None:
    at = data.index(b'"step":"4"')
    data[at + 8] = ord("5")


def truncate(data: bytearray) -> None:
    del data[len(data) // 2:]


@pytest.mark.parametrize("damage", [flip_last_data_byte, flip_the_step_in_the_metadata, truncate])
def test_a_damaged_checkpoint_is_refused_and_nothing_is_loaded(saved, damage):
    run, store, path, _ = saved
    data = bytearray(path.read_bytes())
    damage(data)
    path.write_bytes(bytes(data))
    target, opt, before = fresh_stage(run)
    with pytest.raises(CorruptCheckpoint, match="corrupt|unreadable"):
        load(store.latest(1, run.stages), target, opt, run)
    for name, value in target.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_checkpoint_of_another_run_is_refused(saved, tmp_path):
    run, store, _, _ = saved
    other = RunConfig.build("llama-tiny", **{"train.steps": 4, "stages": 2})
    target, opt, _ = fresh_stage(run)
    with pytest.raises(ForeignCheckpoint, match="another run"):
        load(store.latest(1, run.stages), target, opt, other)


def test_a_checkpoint_written_before_a_model_field_existed_is_of_the_same_run(saved):
    """Older versions wrote the run's model config without rope_scaling (default None): such a
    checkpoint still loads; one whose model really differs does not."""
    run, store, path, stage = saved
    tensors, meta = read_verified(path)
    old_run = json.loads(meta["run"])
    assert old_run["model"].pop("rope_scaling") is None
    for model, fits in ((old_run["model"], True), ({**old_run["model"], "rope_theta": 500000.0}, False)):
        meta.pop(DIGEST_KEY, None)
        meta["run"] = json.dumps({**old_run, "model": model})
        meta[DIGEST_KEY] = digest(tensors, meta)
        save_file(tensors, str(path), metadata=meta)
        target, opt, _ = fresh_stage(run)
        if fits:
            load(store.latest(1, run.stages), target, opt, run)
            assert all(torch.equal(v, stage.state_dict()[k]) for k, v in target.state_dict().items())
        else:
            with pytest.raises(ForeignCheckpoint, match="model differs"):
                load(store.latest(1, run.stages), target, opt, run)


def test_a_checkpoint_without_a_checksum_is_refused(saved):
    """Issue 26, finding 13: such files were read with a warning; nothing vouches for them."""
    run, store, path, _ = saved
    tensors, meta = read_verified(path)
    del meta[DIGEST_KEY]
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CorruptCheckpoint, match="no checksum"):
        read_verified(path)


@pytest.mark.parametrize("poison", ["shape", "unknown", "missing", "integer", "codec state"])
def test_a_checkpoint_that_does_not_fit_the_stage_is_moved_aside_not_loaded(saved, poison):
    """Issue 26, finding 3: a file whose SHA-256 is right but one tensor has the wrong shape raised
    RuntimeError in load_state_dict, and crashed every later holder of the stage."""
    from tahnode.pipeline.checkpoint import StageSaver

    run, store, path, _ = saved
    tensors, meta = read_verified(path)
    name = "model/model.layers.2.mlp.up_proj.weight"
    if poison == "shape":
        tensors[name] = torch.zeros(3, 3)
    elif poison == "unknown":
        tensors["model/backdoor"] = torch.zeros(1)
    elif poison == "missing":
        del tensors[name]
    elif poison == "integer":
        tensors[name] = tensors[name].to(torch.int32)
    else:
        tensors["extra/gate"] = torch.zeros(10**6)
    meta[DIGEST_KEY] = digest(tensors, meta)
    save_file(tensors, str(path), metadata=meta)
    target, opt, before = fresh_stage(run)
    with pytest.raises(CorruptCheckpoint, match="does not fit|codec state"):
        load(store.latest(1, run.stages), target, opt, run)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing changed

    class NoCodecState:
        def tensors(self):
            return {}

        def load(self, tensors, step):
            pass

    saver = StageSaver(store, 1, run)
    # moved aside: the stage starts afresh instead of crashing
    assert saver.load_latest(target, opt, NoCodecState()) == 0
    assert not store.list(1, run.stages) and path.with_name(path.name + ".corrupt").exists()


def test_checkpoint_files_are_readable_by_their_owner_only(saved, tmp_path):
    run, store, path, _ = saved
    assert path.stat().st_mode & 0o777 == 0o600
    received = tmp_path / "store" / path.name
    with ChunkWriter(received) as writer:
        for data, _ in read_chunks(path, size=4096):
            writer.write(data)
        writer.commit()
    assert received.stat().st_mode & 0o777 == 0o600


def test_chunk_writer_stores_a_sound_file_and_refuses_a_corrupt_one(saved, tmp_path):
    run, store, path, _ = saved
    sound = tmp_path / "store" / path.name
    with ChunkWriter(sound) as writer:
        for data, _ in read_chunks(path, size=4096):
            writer.write(data)
        writer.commit()
    assert sound.read_bytes() == path.read_bytes()

    damaged = bytearray(path.read_bytes())
    flip_last_data_byte(damaged)
    refused = tmp_path / "store" / path.name.replace("step4", "step8")
    with ChunkWriter(refused, ".n1.part") as writer:
        writer.write(bytes(damaged))
        with pytest.raises(CorruptCheckpoint):
            writer.commit()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [sound.name]

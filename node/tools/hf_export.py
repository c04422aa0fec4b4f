"""`tahnode export`: a trained swarm back in the Hugging Face layout. Every stage's checkpoint of one
step (from the coordinator's store) merged into sharded safetensors with their index, config.json,
generation_config.json and the run's tokenizer files: a folder `from_pretrained` loads."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import RunConfig
from ..pipeline.checkpoint import NAME, read_verified, tied_aliases
from ..train.corpus import DatasetInfo, index_path
from ..train.model import StageModel

__all__ = ["ExportError", "Exported", "export", "run_folder", "pick_step"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SHARD_BYTES = 2 << 30


class ExportError(ValueError):
    """The checkpoints cannot be exported (the message says which and why)."""


@dataclass
class Exported:
    out: Path
    step: int
    stages: int
    tensors: int
    bytes: int
    shards: int
    tokenizer: bool  # the run's tokenizer files were copied


def run_folder(directory: Path) -> Path:
    """The folder holding the stage checkpoints: `directory` itself, or its one run-* folder (a
    coordinator's --store holds one per run configuration)."""
    if not directory.is_dir():
        raise ExportError(f"--checkpoint-dir {directory} is not a directory")
    if any(NAME.match(p.name) for p in directory.iterdir()):
        return directory
    runs = sorted(p for p in directory.glob("run-*") if p.is_dir())
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise ExportError(f"{directory} holds no stage checkpoints (stageK-ofN-stepS.safetensors) and no run-* "
                          "folder of a coordinator's --store")
    raise ExportError(f"{directory} holds several runs ({', '.join(p.name for p in runs)}): pass the "
                      "folder of the one to export")


def pick_step(folder: Path, step: int | None) -> tuple[int, int]:
    """(stages, step): the newest step every stage has a checkpoint of, or `step` if all have it."""
    found: dict[int, dict[int, set[int]]] = {}  # num_stages -> stage -> steps
    for p in folder.iterdir():
        if m := NAME.match(p.name):
            found.setdefault(int(m[2]), {}).setdefault(int(m[1]), set()).add(int(m[3]))
    if len(found) != 1:
        raise ExportError(f"{folder} holds checkpoints of {sorted(found) or 'no'} stage counts: export needs one")
    stages, by_stage = next(iter(found.items()))
    lacking = [k for k in range(stages) if k not in by_stage]
    if lacking:
        raise ExportError(f"{folder} has no checkpoint of stage(s) {lacking} of {stages}")
    common = set.intersection(*by_stage.values())
    if step is not None:
        if step not in common:
            without = [k for k in range(stages) if step not in by_stage[k]]
            raise ExportError(f"step {step} is not saved for stage(s) {without}; every stage has "
                              f"{sorted(common) or 'no common step'}")
        return stages, step
    if not common:
        raise ExportError(f"the stages of {folder} have no saved step in common "
                          f"({ {k: sorted(v) for k, v in by_stage.items()} })")
    return stages, max(common)


def merge(folder: Path, stages: int, step: int) -> tuple[RunConfig, dict[str, torch.Tensor]]:
    """The run and the whole model's weights (Hugging Face names), from each stage's verified file."""
    weights: dict[str, torch.Tensor] = {}
    runs = set()
    for k in range(stages):
        tensors, meta = read_verified(folder / f"stage{k}-of{stages}-step{step}.safetensors")
        runs.add(meta["run"])
        for name, tensor in tensors.items():
            if name.startswith("model/"):
                weights[name.removeprefix("model/")] = tensor
    if len(runs) != 1:
        raise ExportError(f"the stages' checkpoints at step {step} belong to different runs")
    run = RunConfig.from_json(runs.pop())
    with torch.device("meta"):
        whole = StageModel(run.model, 0, 1)
        aliases = tied_aliases(whole)  # a tied head: only the embedding
        expected = set(whole.state_dict()) - set(aliases)
    weights = {k: v for k, v in weights.items() if k not in aliases}  # older files stored it twice
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ExportError(f"the stages at step {step} do not make the whole model: missing {missing[:5]}, "
                          f"unexpected {extra[:5]}")
    return run, weights


def write_shards(weights: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> tuple[int, int]:
    """model-0000K-of-0000N.safetensors files of at most `shard_bytes` (one tensor may exceed it)
    and their model.safetensors.index.json; returns (shards, bytes of all the tensors)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(weights):
        nbytes = weights[name].numel() * weights[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    return len(shards), total


def copy_tokenizer(run: RunConfig, out: Path) -> DatasetInfo | None:
    """The tokenizer files of the run's data (beside the tokenizer.json it was prepared with), if
    this machine has them; the data's index, if it has that."""
    if not run.data or not index_path(Path(run.data)).is_file():
        return None
    info = DatasetInfo.read(index_path(Path(run.data)))
    source = Path(info.tokenizer)
    if info.tokenizer != "bytes" and source.is_file():
        for name in TOKENIZER_FILES:
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, out / name)
    return info


def export(checkpoint_dir: str | Path, out: str | Path, step: int | None = None,
           shard_bytes: int = SHARD_BYTES) -> Exported:
    """Write the Hugging Face folder `out` (which must not exist, or be empty) from the stage
    checkpoints under `checkpoint_dir`; written in a temporary folder, renamed when whole."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder: refusing to write over it")
    folder = run_folder(Path(checkpoint_dir))
    stages, step = pick_step(folder, step)
    run, weights = merge(folder, stages, step)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shards, total = write_shards(weights, tmp, shard_bytes)
        config = run.model.to_hf_config()
        config["torch_dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
        info = copy_tokenizer(run, tmp)
        generation = {"_from_model_config": True}
        if info is not None:
            config["eos_token_id"] = generation["eos_token_id"] = info.eod_token
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if out.exists():
            out.rmdir()
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, step, stages, len(weights), total, shards, (out / "tokenizer.json").is_file())

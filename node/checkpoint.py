"""Stage checkpoints: one safetensors file per saved step holding the stage's weights, its AdamW
state and its AMAQ gates, with the step and run identity in the metadata; resume reads the latest."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger("tahnode.checkpoint")

NAME = re.compile(r"stage(\d+)-of(\d+)-step(\d+)\.safetensors$")


@dataclass
class Checkpoint:
    path: Path
    stage: int
    num_stages: int
    step: int


class CheckpointStore:
    """A directory of stage checkpoints; keeps the newest `keep` files of each stage."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.dir = Path(directory)
        self.keep = keep

    def list(self, stage: int, num_stages: int) -> list[Checkpoint]:
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = NAME.match(p.name)
            if m and int(m[1]) == stage and int(m[2]) == num_stages:
                found.append(Checkpoint(p, stage, num_stages, int(m[3])))
        return sorted(found, key=lambda c: c.step)

    def find(self, stage: int, num_stages: int, step: int) -> Checkpoint | None:
        return next((c for c in self.list(stage, num_stages) if c.step == step), None)

    def latest(self, stage: int, num_stages: int) -> Checkpoint | None:
        found = self.list(stage, num_stages)
        return found[-1] if found else None

    def save(self, stage: int, num_stages: int, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             run_json: str, extra: dict[str, torch.Tensor] | None = None) -> Path:
        """Write atomically (temp file + rename) and prune old files."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"model/{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        names = {id(p): n for n, p in model.named_parameters()}
        opt_steps = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                name = names[id(p)]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        tensors[f"optim/{name}/{key}"] = state[key].detach().contiguous().cpu()
                if "step" in state:
                    opt_steps[name] = float(state["step"])
        for k, v in (extra or {}).items():
            tensors[f"extra/{k}"] = v.detach().contiguous().cpu()
        meta = {"step": str(step), "stage": str(stage), "num_stages": str(num_stages), "run": run_json, "optim_steps": json.dumps(opt_steps)}
        path = self.dir / f"stage{stage}-of{num_stages}-step{step}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        for old in self.list(stage, num_stages)[: -self.keep]:
            old.path.unlink(missing_ok=True)
        return path


def load(ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_json: str) -> dict[str, torch.Tensor]:
    """Restore weights and optimizer state in place; returns the extra tensors. Refuses a
    checkpoint of another run configuration (model, stages, codecs) with a clear error."""
    try:
        with safe_open(str(ckpt.path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise ValueError(f"checkpoint {ckpt.path} is unreadable: {exc}") from None
    saved = json.loads(meta.get("run", "{}"))
    ours = json.loads(run_json)
    for key in ("model", "stages"):
        if saved.get(key) != ours.get(key):
            raise ValueError(f"checkpoint {ckpt.path} belongs to another run ({key} differs); move it away or use another --checkpoint-dir")
    state = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt.path} does not fit stage {ckpt.stage}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    params = dict(model.named_parameters())
    steps = json.loads(meta.get("optim_steps", "{}"))
    device = next(model.parameters()).device
    for name, p in params.items():
        if f"optim/{name}/exp_avg" in tensors:
            optimizer.state[p] = {
                "step": torch.tensor(steps.get(name, 0.0)),
                "exp_avg": tensors[f"optim/{name}/exp_avg"].to(device),
                "exp_avg_sq": tensors[f"optim/{name}/exp_avg_sq"].to(device),
            }
    return {k[len("extra/"):]: v for k, v in tensors.items() if k.startswith("extra/")}

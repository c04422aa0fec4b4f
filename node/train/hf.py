"""Loading a stage's weights from a local Hugging Face checkpoint directory (Llama, Qwen2):
`*.safetensors` files, with or without their index, only the tensors the stage holds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..config.model import ModelConfig
from .model import StageModel

__all__ = ["load_stage_from_hf", "check_hf_config"]


def _checkpoint_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> the *.safetensors file that holds it, in a HF checkpoint directory."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                where.setdefault(name, file)
    return where


def check_hf_config(model: ModelConfig, directory: str | Path) -> None:
    """Refuse a checkpoint made for another model: its config.json must give exactly the run's
    model (layers, sizes, heads, vocabulary, rope, norm eps, biases, tied head, positions). A
    ValueError names every field that differs, or the field tahnode cannot honour."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"--init-from {directory}: no config.json there (a Hugging Face "
                                "checkpoint directory has one)")
    theirs = ModelConfig.from_hf_config(directory)
    differ = [f"{f.name} is {getattr(theirs, f.name)!r} there but {getattr(model, f.name)!r} in the run"
              for f in dataclasses.fields(ModelConfig) if getattr(theirs, f.name) != getattr(model, f.name)]
    if differ:
        raise ValueError(f"--init-from {directory} holds another model than the run's: {'; '.join(differ)} "
                         f"(start the coordinator with --model {directory} to train that model)")


@torch.no_grad()
def load_stage_from_hf(stage_model: StageModel, directory: str | Path) -> StageModel:
    """Copies this stage's tensors (only those) from a local HF checkpoint directory of
    `*.safetensors` files, with or without `model.safetensors.index.json`; returns the model.

    Raises ValueError naming the tensor for a missing tensor or a shape mismatch, and when the
    checkpoint has q/k/v biases that the config (attention_bias = false) cannot hold. With
    `tie_embeddings` and no `lm_head.weight` in the checkpoint, the head takes the embedding."""
    from safetensors import safe_open

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    where = _checkpoint_index(directory)

    # What to read for each parameter this stage owns (named_parameters lists a tied one once).
    wanted: dict[str, str] = {}
    for name, _ in stage_model.named_parameters():
        source = name
        if (name == "lm_head.weight" and stage_model.cfg.tie_embeddings
                and name not in where):
            source = "model.embed_tokens.weight"
        wanted[name] = source

    if not stage_model.cfg.attention_bias:
        stray = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in stage_model.layer_ids
                 for p in "qkv" if f"model.layers.{i}.self_attn.{p}_proj.bias" in where]
        if stray:
            raise ValueError(f"{directory} has attention biases ({stray[0]}, ...) but the model "
                             "config says attention_bias = false")

    missing = sorted({source for source in wanted.values() if source not in where})
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{directory} lacks tensors that stage {stage_model.stage} needs: "
                         f"{', '.join(missing[:5])}{more}")

    params = dict(stage_model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name, source in wanted.items():
        by_file.setdefault(where[source], []).append(name)
    for file, names in sorted(by_file.items()):
        if not file.is_file():
            raise FileNotFoundError(f"{file} (listed in the checkpoint index) does not exist")
        with safe_open(file, framework="pt") as f:
            for name in names:
                source = wanted[name]
                tensor = f.get_tensor(source)
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"tensor {source} in {file.name} has shape "
                                     f"{tuple(tensor.shape)}, but {name} of this model has "
                                     f"shape {tuple(param.shape)}")
                param.copy_(tensor)
    return stage_model

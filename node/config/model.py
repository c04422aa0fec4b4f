"""The model's shape (`ModelConfig`) and the presets that ship inside the package.

Presets are the TOML files of configs/ (package `tahnode.configs`), found from any install."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from .toml import load_toml

__all__ = ["ModelConfig", "PRESETS", "preset_names"]

PRESETS = importlib.resources.files("tahnode.configs")


def preset_names() -> list[str]:
    """Names of the model presets shipped with tahnode (e.g. llama-tiny)."""
    return sorted(p.name[: -len(".toml")] for p in PRESETS.iterdir() if p.name.endswith(".toml"))


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the whole model; every stage of a swarm is built from the same one."""

    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention); = n_heads for plain MHA
    ffn_dim: int  # SwiGLU inner size
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # lm_head shares the embedding matrix (see StageModel)
    attention_bias: bool = False  # biases on q/k/v projections (Qwen2-style checkpoints)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("tie_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model config: {name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"model config: dim {self.dim} is not divisible by "
                             f"n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model config: n_heads {self.n_heads} is not divisible by "
                             f"n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim = dim / n_heads = {self.head_dim} must be "
                             "even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_dict(cls, table: dict) -> "ModelConfig":
        """Builds a config from a mapping of field names; unknown or missing keys are errors."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - fields)
        if unknown:
            raise ValueError(f"model config: unknown keys {unknown}; known keys: {sorted(fields)}")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING}
        missing = sorted(required - set(table))
        if missing:
            raise ValueError(f"model config: missing keys {missing}")
        return cls(**table)

    @classmethod
    def from_toml(cls, path: str | Path) -> "ModelConfig":
        """Reads the `[model]` table of a TOML file."""
        path = Path(path)
        doc = load_toml(path, "model config", missing=FileNotFoundError)
        if not isinstance(doc.get("model"), dict):
            raise ValueError(f"model config {path} has no [model] table")
        try:
            return cls.from_dict(doc["model"])
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_name(cls, name: str | Path) -> "ModelConfig":
        """A preset shipped with tahnode (configs/<name>.toml, e.g. "llama-tiny"), or a path to a TOML."""
        path = Path(name)
        if path.suffix == ".toml" or path.exists():
            return cls.from_toml(path)
        preset = PRESETS / f"{name}.toml"
        if not preset.is_file():
            raise ValueError(f"unknown model preset {str(name)!r}: known presets are {preset_names()}, "
                             "or pass a path to a .toml file")
        with importlib.resources.as_file(preset) as path:
            return cls.from_toml(path)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "ModelConfig":
        """Reads a Hugging Face `config.json` (a file or the checkpoint directory holding it).

        Llama-2, TinyLlama and Qwen2 configs map directly; what this model cannot express (rope
        scaling as in Llama 3.1, MLP biases, another activation or head_dim) is refused."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        hf = json.loads(path.read_text())
        # transformers >= 5 nests rope settings in rope_parameters; older files use rope_theta
        # and rope_scaling at the top level.
        rope = hf.get("rope_parameters") or {}
        if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError(f"{path}: rope scaling is not supported")
        if hf.get("mlp_bias"):
            raise ValueError(f"{path}: MLP biases are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: activation {hf['hidden_act']!r} is not supported (silu)")
        if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
            raise ValueError(f"{path}: head_dim {hf['head_dim']} other than hidden_size / "
                             "num_attention_heads is not supported")
        n_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            ffn_dim=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
        )

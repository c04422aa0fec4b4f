"""The model's shape (`ModelConfig`) and the presets that ship inside the package.

Presets are the TOML files of configs/ (package `tahnode.configs`), found from any install."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from .toml import load_toml

__all__ = ["ModelConfig", "RopeScaling", "PRESETS", "preset_names"]

PRESETS = importlib.resources.files("tahnode.configs")


def preset_names() -> list[str]:
    """Names of the model presets shipped with tahnode (e.g. llama-tiny)."""
    return sorted(p.name[: -len(".toml")] for p in PRESETS.iterdir() if p.name.endswith(".toml"))


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's scaling of the rotary frequencies (Hugging Face `rope_scaling` with rope_type
    "llama3"): wavelengths longer than original_max_positions / low_freq_factor are slowed by
    `factor`, those shorter than original_max_positions / high_freq_factor kept, a smooth blend
    between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config: rope_scaling.{name} must be a positive number, got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model config: rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"low_freq_factor ({self.low_freq_factor})")

    @classmethod
    def from_dict(cls, table: dict) -> RopeScaling:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(table) != names:
            raise ValueError(f"model config: rope_scaling needs exactly the keys {sorted(names)}, got {sorted(table)}")
        return cls(**table)


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
    rope_scaling: RopeScaling | None = None  # Llama 3's frequency scaling; None = plain RoPE

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
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError("model config: rope_scaling must be a table of "
                             f"{[f.name for f in dataclasses.fields(RopeScaling)]}, got {self.rope_scaling!r}")
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
        if isinstance(table.get("rope_scaling"), dict):
            table = {**table, "rope_scaling": RopeScaling.from_dict(table["rope_scaling"])}
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
        """A preset shipped with tahnode (configs/<name>.toml, e.g. "llama-tiny"), a path to a TOML,
        or a Hugging Face config.json (or the checkpoint directory holding one)."""
        path = Path(name)
        if path.suffix == ".json" or path.is_dir():
            return cls.from_hf_config(path)
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

        Llama-2, Llama-3 (with its rope scaling), TinyLlama and Qwen2 configs map directly; what this
        model cannot express (another rope scaling, MLP biases, another activation or head_dim) is
        refused, naming the field."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        hf = json.loads(path.read_text())
        # transformers >= 5 nests rope settings in rope_parameters; older files use rope_theta
        # and rope_scaling at the top level.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            try:
                scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                      rope["original_max_position_embeddings"])
            except KeyError as e:
                raise ValueError(f"{path}: rope_scaling of type llama3 lacks {e.args[0]}") from None
        elif rope_type != "default":
            raise ValueError(f"{path}: rope_scaling.rope_type {rope_type!r} is not supported (default, llama3)")
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
            rope_scaling=scaling,
        )

    def to_hf_config(self) -> dict:
        """The Hugging Face config.json of this model (LlamaForCausalLM, or Qwen2ForCausalLM when the
        q/k/v projections have biases): from_hf_config reads it back as this config."""
        qwen2 = self.attention_bias
        config = {
            "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_embeddings, "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if qwen2:
            config["use_sliding_window"] = False
        else:
            config.update(attention_bias=False, mlp_bias=False)
        if self.rope_scaling is not None:
            r = self.rope_scaling
            config["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                                      "high_freq_factor": r.high_freq_factor,
                                      "original_max_position_embeddings": r.original_max_positions}
        return config

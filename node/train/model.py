"""A LLaMA-style decoder, cut into pipeline stages by layer count, in plain torch.

RMSNorm, RoPE, SwiGLU MLP and grouped-query attention, with Hugging Face Llama parameter names."""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config.model import ModelConfig, RopeScaling

__all__ = [
    "ModelConfig",
    "RMSNorm",
    "Attention",
    "MLP",
    "DecoderLayer",
    "StageModel",
    "stage_layers",
    "rope_cos_sin",
    "apply_rope",
    "init_weights",
    "build_stage",
    "full_model",
    "param_count",
    "COMPUTE_DTYPES",
]

INIT_STD = 0.02  # std of the normal init of every linear and embedding weight
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # TrainConfig.dtype -> torch


# ------------------------------------------------------------------------------------------------
# Building blocks (each matches transformers' LlamaRMSNorm / LlamaAttention / LlamaMLP)
# ------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back, as in Hugging Face Llama."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, device) -> torch.Tensor:
    """The rotary frequencies, (head_dim/2,) fp32: theta^(-2j/head_dim), then Llama 3's scaling if
    given: wavelengths 2*pi/f longer than original / low_freq_factor divided by `factor`, those
    shorter than original / high_freq_factor kept, and between them a blend whose weight on the
    kept frequency rises linearly with original / wavelength from low to high_freq_factor."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    kept = scaling.original_max_positions / wavelen  # in [low, high] between the two regimes
    smooth = ((kept - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype, scaling: RopeScaling | None = None):
    """cos and sin of the rotary angles, (seq_len, head_dim) each, for positions 0..seq_len-1.

    Frequencies from rope_inv_freq; the angles are repeated over the two halves of the head (the
    HF "rotate_half" layout, not interleaved pairs). Computed in fp32."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    positions = torch.arange(seq_len, device=device).float()
    angles = torch.outer(positions, inv_freq)  # (S, head_dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x: (B, heads, S, head_dim) by the angles in cos, sin: (S, head_dim)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, S, dim) -> (B, S, dim)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Each key/value head serves n_heads / n_kv_heads consecutive query heads.
        groups = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_heads, S, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


# ------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------


def stage_layers(n_layers: int, num_stages: int, stage: int) -> range:
    """Global indices of the decoder layers that `stage` of `num_stages` holds.

    As even as possible; the first n_layers % num_stages stages hold one extra layer
    (6 layers over 4 stages: 2, 2, 1, 1)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {num_stages} stages: "
                         "every stage needs at least one layer")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is out of range for {num_stages} stages "
                         f"(0..{num_stages - 1})")
    base, extra = divmod(n_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class _Backbone(nn.Module):
    """The `model.` prefix of the HF layout: embed_tokens, layers.{i}, norm (each when owned)."""

    def __init__(self, cfg: ModelConfig, layer_ids: range, first: bool, last: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in layer_ids})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if last else None


class StageModel(nn.Module):
    """Stage `stage` of `num_stages`: a contiguous run of decoder layers, plus the embedding on
    the first stage and the final norm and lm head on the last (a 1-stage model holds all).

    `state_dict()` keys are exactly the Hugging Face Llama names with global layer indices
    (`model.layers.{i}.self_attn.q_proj.weight`, ...), so a stage's checkpoint is a slice of a
    whole-model one.

    With `tie_embeddings` the lm_head *is* the embedding, on stage 0: over several stages the last
    stage ends with the final norm and returns hidden states, which the pipeline sends back to stage
    0 for `head` (the ring of RunConfig.ring). The tied weight is one parameter in one place."""

    def __init__(self, cfg: ModelConfig, stage: int, num_stages: int):
        super().__init__()
        self.cfg = cfg
        self.stage, self.num_stages = stage, num_stages
        self.layer_ids = stage_layers(cfg.n_layers, num_stages, stage)
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.ring = cfg.tie_embeddings and num_stages > 1
        self.model = _Backbone(cfg, self.layer_ids, self.is_first, self.is_last)
        holds_head = self.is_first if self.ring else self.is_last
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if holds_head else None
        if self.is_first and cfg.tie_embeddings and holds_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Stage 0: token ids (B, S) int64; later stages: hidden states (B, S, dim).
        Returns hidden states (B, S, dim), or logits (B, S, vocab_size) on the last stage (in a
        ring: its final hidden states, normalized, for stage 0's `head`)."""
        if self.is_first:
            if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"stage 0 takes token ids (B, S) of int64, got {tuple(x.shape)} "
                                 f"{x.dtype}")
            x = self.model.embed_tokens(x)
        elif x.dim() != 3 or x.shape[-1] != self.cfg.dim or not x.is_floating_point():
            raise ValueError(f"stage {self.stage} takes hidden states (B, S, {self.cfg.dim}), "
                             f"got {tuple(x.shape)} {x.dtype}")
        seq_len = x.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len "
                             f"{self.cfg.max_seq_len}")
        cos, sin = rope_cos_sin(seq_len, self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype,
                                self.cfg.rope_scaling)
        for layer in self.model.layers.values():
            x = layer(x, cos, sin)
        if self.is_last:
            x = self.model.norm(x)
            if not self.ring:
                x = self.lm_head(x)
        return x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Stage 0 of a ring: logits (B, S, vocab_size) of the last stage's final hidden states."""
        if not (self.ring and self.is_first):
            raise ValueError(f"stage {self.stage} of {self.num_stages} holds no separate head")
        return self.lm_head(hidden)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of logits (B, S, V) against labels (B, S), in fp32.
        Labels of -100 are ignored (the torch convention)."""
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten().long())


def _param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, parameter name), the same on every machine."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def init_weights(model: StageModel, seed: int) -> None:
    """Initializes every parameter from a generator seeded by (seed, its name).

    The weights therefore do not depend on how the model is partitioned: layer 4 is the same in
    stage 1 of 3 and in a 1-stage model. Linear and embedding weights ~ Normal(0, 0.02), output
    projections (o_proj, down_proj) scaled by 1/sqrt(2 n_layers), norms = 1, biases = 0.
    Values are drawn in float64 (torch's scalar path, not the ISA-specific fp32 one), then cast."""
    out_std = INIT_STD / math.sqrt(2 * model.cfg.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if name.endswith(".bias"):
            param.zero_()
            continue
        # An untied copy of a tied head starts equal to the embedding it stands for.
        seed_name = ("model.embed_tokens.weight"
                     if name == "lm_head.weight" and model.cfg.tie_embeddings else name)
        std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
        gen = torch.Generator().manual_seed(_param_seed(seed, seed_name))
        values = torch.randn(param.shape, generator=gen, dtype=torch.float64) * std
        param.copy_(values)


def build_stage(cfg: ModelConfig, stage: int, num_stages: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> StageModel:
    """Stage `stage` of `num_stages`, randomly initialized from `seed` (on CPU; move it after)."""
    model = StageModel(cfg, stage, num_stages)
    init_weights(model, seed)
    return model.to(dtype)


def full_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> StageModel:
    """The whole model as one stage."""
    return build_stage(cfg, 0, 1, seed, dtype)


def param_count(cfg: ModelConfig, stage: int = 0, num_stages: int = 1) -> int:
    """Number of parameters of a stage (default: the whole model), computed without building it.
    A tied head counts once, with the embedding on stage 0."""
    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    attn = d * d + 2 * d * kv + d * d + (d + 2 * kv if cfg.attention_bias else 0)
    layer = attn + 3 * d * cfg.ffn_dim + 2 * d
    layers = stage_layers(cfg.n_layers, num_stages, stage)
    total = len(layers) * layer
    first, last = stage == 0, stage == num_stages - 1
    if first:
        total += cfg.vocab_size * d
    if last:
        total += d  # final norm
        if not cfg.tie_embeddings:
            total += cfg.vocab_size * d
    return total

"""The machine a daemon runs on: which torch device it uses, how it is named in the swarm, and
how fast it computes one layer (what the coordinator's placement weighs against the links)."""

from __future__ import annotations

import time

import torch

from ..config import RunConfig
from ..train.model import COMPUTE_DTYPES, DecoderLayer, rope_cos_sin

__all__ = ["DeviceUnavailable", "resolve_device", "device_label", "device_memory", "measure_layer_ms"]


class DeviceUnavailable(RuntimeError):
    """The device asked for is not on this machine."""


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceUnavailable("--device cuda asked for, but no CUDA GPU is available")
    return name


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return "cpu"


def device_memory(device: str) -> int:
    """Bytes of memory of a GPU (0 for the CPU)."""
    return torch.cuda.get_device_properties(torch.device(device)).total_memory if device.startswith("cuda") else 0


def measure_layer_ms(run: RunConfig, device: str) -> float:
    """Median forward+backward time of one decoder layer on one micro-batch on this device."""
    cfg, t = run.model, run.train
    dtype = COMPUTE_DTYPES[t.dtype]
    layer = DecoderLayer(cfg).to(device=device, dtype=dtype)
    x = torch.randn(t.batch_size, t.seq_len, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(t.seq_len, cfg.head_dim, cfg.rope_theta, x.device, dtype, cfg.rope_scaling)
    times = []
    for _ in range(4):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer(x, cos, sin).sum().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[1]

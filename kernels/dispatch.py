"""Which implementation serves a tensor: the Triton kernels for CUDA tensors; for CPU tensors a
codec's fast CPU path (<codec>_cpu, the reference's bytes) where it has one, else the pure-torch
reference. TAHNODE_REFERENCE=1 forces the references; tests route CPU tensors through the Triton
kernels under Triton's CPU interpreter with TAHNODE_FORCE_TRITON=1 (and TRITON_INTERPRET=1)."""

from __future__ import annotations

import functools
import importlib
import os

import torch

__all__ = ["use_triton", "triton_available", "implementation"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while importing
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` (the input of encode, or the payload already on the decode device) should go
    to the Triton kernels: a CUDA tensor, or a CPU tensor when TAHNODE_FORCE_TRITON=1 and
    TRITON_INTERPRET=1 are set; never when triton cannot be imported."""
    if t.is_cuda:
        return triton_available()
    forced = os.environ.get("TAHNODE_FORCE_TRITON") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
    return forced and t.device.type == "cpu" and triton_available()


CPU_PATHS = {"tahquant", "tahquant_rice", "pertoken"}  # codecs (and layouts) with a <codec>_cpu module


def implementation(codec: str, t: torch.Tensor):
    """The module serving `t` for `codec`: tahnode.kernels.<codec>_triton, <codec>_cpu or <codec>_ref."""
    if use_triton(t):
        kind = "triton"
    elif codec in CPU_PATHS and t.device.type == "cpu" and os.environ.get("TAHNODE_REFERENCE") != "1":
        kind = "cpu"
    else:
        kind = "ref"
    return importlib.import_module(f"tahnode.kernels.{codec}_{kind}")

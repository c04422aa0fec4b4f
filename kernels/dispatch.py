"""Which implementation serves a tensor: the Triton kernels for CUDA tensors; for CPU tensors a
codec's fast CPU path (the reference's bytes) where it has one, else the pure-torch reference. Each
codec names its modules here (`Paths`), imported as modules are, never by a name built at run time.
TAHNODE_REFERENCE=1 forces the references; tests route CPU tensors through the Triton kernels under
Triton's CPU interpreter with TAHNODE_FORCE_TRITON=1 (and TRITON_INTERPRET=1)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from . import pertoken_cpu, pertoken_ref, tahquant_cpu, tahquant_ref, tahquant_rice_cpu, tahquant_rice_ref

__all__ = ["use_triton", "triton_available", "Paths", "PERTOKEN", "TAHQUANT", "TAHQUANT_PAPER"]


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


@dataclass(frozen=True)
class Paths:
    """One codec's implementations: `ref`, the pure-torch reference (its
    specification); `cpu`, a fast CPU path that gives the reference's bytes (None: the reference
    serves CPU tensors); `triton`, a function that imports its Triton module (called only where the
    kernels serve a tensor: importing it needs triton)."""

    ref: ModuleType
    cpu: ModuleType | None
    triton: Callable[[], ModuleType]

    def serving(self, t: torch.Tensor) -> ModuleType:
        """The module serving `t`: the Triton kernels (use_triton), else the CPU path for a CPU
        tensor unless TAHNODE_REFERENCE=1, else the reference."""
        if use_triton(t):
            return self.triton()
        if self.cpu is not None and t.device.type == "cpu" and os.environ.get("TAHNODE_REFERENCE") != "1":
            return self.cpu
        return self.ref


def _pertoken_triton() -> ModuleType:
    from . import pertoken_triton
    return pertoken_triton


def _tahquant_triton() -> ModuleType:
    from . import tahquant_triton
    return tahquant_triton


def _tahquant_rice_triton() -> ModuleType:
    from . import tahquant_rice_triton
    return tahquant_rice_triton


PERTOKEN = Paths(pertoken_ref, pertoken_cpu, _pertoken_triton)
TAHQUANT_PAPER = Paths(tahquant_ref, tahquant_cpu, _tahquant_triton)                # codec tahquant-paper
TAHQUANT = Paths(tahquant_rice_ref, tahquant_rice_cpu, _tahquant_rice_triton)       # codec tahquant

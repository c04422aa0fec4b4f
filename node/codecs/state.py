"""Per-stream codec state: the context each end of one direction of a link keeps (AQ-SGD's cache),
and the state a sending stage keeps across streams (AMAQ's learned widths), behind hooks.

The pipeline calls the hooks of `CodecState`; it never names a codec."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import amaq_ref, aqsgd_ref

__all__ = ["CodecContext", "CodecState", "AmaqSenderState"]


@dataclass
class CodecContext:
    """Per-stream state of one direction of one link; each end keeps its own, in step.

    sample_ids: dataset ids of the rows (dim 0) of the tensor, needed by aqsgd.
    aqsgd_cache: aqsgd's per-sample cache m(xi), identical on both ends.
    amaq_state: the sender's learnable AMAQ gates (the receiver reads the bits from the message).
    """

    sample_ids: list[int] | None = None
    aqsgd_cache: aqsgd_ref.AqsgdCache = field(default_factory=aqsgd_ref.AqsgdCache)
    amaq_state: amaq_ref.AmaqState | None = None

    @property
    def cache_bytes(self) -> int:
        """Memory this stream's codec state holds per sample (grows with the data set for aqsgd)."""
        return self.aqsgd_cache.nbytes


class CodecState:
    """What a codec keeps on the sending stage across the streams of one direction, with the hooks
    the pipeline calls. This base keeps nothing: every hook is a no-op."""

    def new_context(self) -> CodecContext:
        """The context of a new outgoing stream."""
        return CodecContext()

    def straight_through(self, out: torch.Tensor) -> torch.Tensor:
        """The tensor the backward pass flows through in place of `out` (what the receiver sees)."""
        return out

    def zero_grad(self) -> None:
        """A step (or an attempt of it) starts."""

    def apply_step(self, step: int) -> None:
        """Optimizer step `step` is applied: update what the codec learns."""

    def restart(self) -> None:
        """Back to the initial state (the run rolls back to step 0)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Saved with the stage's checkpoint."""
        return {}

    def load(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Restore from a checkpoint of `step` (the tensors of `tensors()`, perhaps among others)."""


class AmaqSenderState(CodecState):
    """AMAQ's learnable gates Q with their own optimizer; trained through the loss (straight-through
    rounding) plus the bit regularizer, annealed by the step number."""

    def __init__(self, channels: int, params: amaq_ref.AmaqParams, device=None):
        self.gates = amaq_ref.AmaqState(channels, params, device=device)
        self.opt = torch.optim.Adam(self.gates.parameters(), lr=params.q_lr)

    def new_context(self) -> CodecContext:
        return CodecContext(amaq_state=self.gates)

    def straight_through(self, out: torch.Tensor) -> torch.Tensor:
        return amaq_ref.fake_quant(out, self.gates)

    def zero_grad(self) -> None:
        self.gates.zero_grad(set_to_none=True)

    def apply_step(self, step: int) -> None:
        self.gates.regularization().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.gates.step = step + 1

    def restart(self) -> None:
        with torch.no_grad():
            self.gates.gate.zero_()
        self.gates.step = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"amaq_gate": self.gates.gate}

    def load(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        if "amaq_gate" in tensors:
            with torch.no_grad():
                self.gates.gate.copy_(tensors["amaq_gate"].to(self.gates.gate.device))
            self.gates.step = step

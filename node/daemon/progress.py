"""What a daemon prints while it trains: one line per committed step on the last stage (step,
loss, tokens/s, gradient bits per element, megabytes encoded so far)."""

from __future__ import annotations

import sys

from ..net.transport import BACKWARD
from ..pipeline.worker import StageWorker

__all__ = ["Progress"]


class Progress:
    """One line per step on the last stage (rich when attached to a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        from rich.console import Console

        self.console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)

    def __call__(self, worker: StageWorker) -> None:
        if not (self.enabled and worker.computes_loss and worker.stats.losses):
            return
        s = worker.stats
        last = s.losses[-1]
        self.console.print(
            f"step {last.step + 1:>5}/{self.total}  loss {last.loss:.4f}  {s.tokens_per_s():8.0f} tok/s  "
            f"gradients {s.bits_per_element(BACKWARD):.2f} bits/element  encoded "
            f"{sum(s.encoded_bytes.values()) / 2**20:.1f} MB"
        )

"""The optimizer step every stage applies identically: AdamW with linear warm-up and cosine decay,
clipping by the global gradient norm (its square summed over all stages)."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig

__all__ = ["lr_at", "StageOptimizer", "grad_sumsq"]


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    end = train.end_lr
    return end + 0.5 * (train.lr - end) * (1.0 + math.cos(math.pi * progress))


def grad_sumsq(params) -> float:
    """Sum of squared gradients, accumulated in float64."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return total


class StageOptimizer:
    """AdamW over one stage's parameters; `apply(step, total_sumsq)` clips and steps."""

    def __init__(self, params, train: TrainConfig):
        self.params = [p for p in params if p.requires_grad]
        self.train = train
        self.opt = torch.optim.AdamW(self.params, lr=train.lr, betas=(train.beta1, train.beta2),
                                     weight_decay=train.weight_decay)

    def clip_coef(self, total_sumsq: float) -> float:
        if self.train.grad_clip <= 0:
            return 1.0
        norm = math.sqrt(total_sumsq)
        return min(1.0, self.train.grad_clip / (norm + 1e-6))

    @torch.no_grad()
    def apply(self, step: int, total_sumsq: float) -> None:
        coef = self.clip_coef(total_sumsq)
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, self.train)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def at_most(self, step: int) -> None:
        """A stage that returns to committed step `step` (a regroup to an older outer step) has taken at most
        `step` steps of the run: AdamW's step counts above it come down to it (its checkpoints say so, and are
        checked for it). Its moments stay: what it learned since is not a wrong direction, only a repeated one."""
        for state in self.opt.state.values():
            count = state.get("step")
            if count is None or float(count) <= step:
                continue
            if torch.is_tensor(count):
                count.fill_(float(step))
            else:
                state["step"] = float(step)

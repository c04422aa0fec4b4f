"""The outer step that keeps the replicas of a stage in step (DiLoCo's, with plain averaging as its
default): the pseudo-gradient (outer weights - inner weights) and the step from its average.

Each replica keeps the stage's outer weights (`anchor`, float32 on the CPU, as they were after the
last outer step), with momentum the outer momentum, and with error feedback (SparseLoCo's) the
residual: what the group's compressed means have not yet counted of its pseudo-gradients, added to
the next one, so that rounding at few bits per value delays a replica's update rather than losing it.
Its inner AdamW trains the parameters in between.
With outer lr 1 and no momentum the step sets every replica to the mean of their weights."""

from __future__ import annotations

import hashlib

import torch

from ..config.swarm import SwarmConfig

__all__ = ["OuterOptimizer", "state_digest", "DIGEST_BYTES"]

DIGEST_BYTES = 32


def state_digest(step: int, tensors: list[torch.Tensor]) -> bytes:
    """SHA-256 of outer weights (and momentum) of `step`, as float32 bytes: what the replicas of a stage report
    after each outer step, and what a state loaded from a peer must hash to."""
    h = hashlib.sha256(b"tahnode outer state v1\0" + int(step).to_bytes(8, "little"))
    for tensor in tensors:
        data = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data.numpy())  # its buffer: no copy
    return h.digest()


class OuterOptimizer:
    """The outer weights and momentum of one replica of a stage, over its trainable parameters."""

    def __init__(self, params, swarm: SwarmConfig):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.mu = swarm.outer_lr, swarm.outer_momentum
        self.numel = sum(p.numel() for p in self.params)
        self.anchor = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.momentum = torch.zeros(self.numel, dtype=torch.float32) if self.mu else None
        # error feedback: what the group's means have not yet counted of this replica's pseudo-gradients
        self.residual = torch.zeros(self.numel, dtype=torch.float32) if swarm.outer_feedback else None
        self.sent: torch.Tensor | None = None

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """outer - inner weights, flat, float32, on the CPU, plus the residual with error feedback
        (what the replicas average)."""
        delta = torch.cat([(a - p.detach().float().cpu()).reshape(-1) for a, p in zip(self.anchor, self.params)])
        if self.residual is not None:
            delta += self.residual
            self.sent = delta.clone()
        return delta

    @torch.no_grad()
    def feed_back(self, counted: torch.Tensor | None) -> None:
        """After a round with a mean: what it counted of the last pseudo-gradient (GroupMean.counted; None:
        all of it) leaves the rest as the residual for the next round. (A round without a mean is reset():
        the replica steps by its own change, and the residual waits.)"""
        if self.residual is None or self.sent is None:
            return
        if counted is None:
            self.residual.zero_()
        else:
            self.residual.copy_(self.sent - counted)
        self.sent = None

    @torch.no_grad()
    def step(self, averaged: torch.Tensor) -> None:
        """Apply the replicas' mean pseudo-gradient: outer -= lr * (Nesterov's update, or the mean
        itself without momentum); the parameters become the new outer weights."""
        if averaged.numel() != self.numel:
            raise ValueError(f"the averaged pseudo-gradient has {averaged.numel()} values, the stage {self.numel}")
        update = averaged.to(torch.float32)
        if self.momentum is not None:  # each operation rounded on its own (no fused multiply-add): replicas that
            self.momentum.mul_(self.mu).add_(update)  # start equal and take the same mean stay equal to the bit
            update = update + self.momentum * self.mu
        if self.lr != 1.0:  # its own rounding first, then a plain subtraction: the same bits on every machine
            update = update * self.lr
        offset = 0
        for a, p in zip(self.anchor, self.params):
            n = p.numel()
            a.sub_(update[offset:offset + n].view_as(a))
            p.copy_(a)
            offset += n

    @torch.no_grad()
    def reset(self) -> None:
        """Take the parameters as they are as the outer weights (after loading a checkpoint or the
        group's state, or a round without a group: that is where the next pseudo-gradient starts from)."""
        for a, p in zip(self.anchor, self.params):
            a.copy_(p.detach())
        self.sent = None

    def forget_residual(self) -> None:
        """Another replica's outer weights replaced this one's: what its own rounds left uncounted is moot."""
        if self.residual is not None:
            self.residual.zero_()

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the replicas share of it (a checkpoint keeps it, a newcomer is served it): the outer
        weights (flat) and the momentum, if any."""
        out = {"anchor": torch.cat([a.reshape(-1) for a in self.anchor])}
        if self.momentum is not None:
            out["momentum"] = self.momentum.clone()
        return out

    def own_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps besides, of this replica alone (never served to another): the residual."""
        return {"residual": self.residual.clone()} if self.residual is not None else {}

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `tensors()` gave (a missing momentum starts at zero); ValueError if a shape is wrong."""
        anchor = tensors["anchor"]
        if anchor.numel() != self.numel:
            raise ValueError(f"outer weights of {anchor.numel()} values for a stage of {self.numel}")
        offset = 0
        for a in self.anchor:
            a.copy_(anchor[offset:offset + a.numel()].view_as(a))
            offset += a.numel()
        if self.momentum is not None:
            momentum = tensors.get("momentum")
            if momentum is not None and momentum.numel() != self.numel:
                raise ValueError(f"outer momentum of {momentum.numel()} values for a stage of {self.numel}")
            self.momentum.copy_(momentum if momentum is not None else torch.zeros(self.numel))

    @torch.no_grad()
    def load_own(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `own_tensors()` gave (a missing residual is zero); ValueError if its shape is wrong."""
        if self.residual is None:
            return
        residual = tensors.get("residual")
        if residual is not None and residual.numel() != self.numel:
            raise ValueError(f"an error-feedback residual of {residual.numel()} values for a stage of {self.numel}")
        self.residual.copy_(residual.reshape(-1) if residual is not None else torch.zeros(self.numel))

"""What the replicas of a stage average and how, as arithmetic a process can run alone: hivemind's
butterfly all-reduce over compressed pseudo-gradients, by the robust rule the averager's reducer and
senders apply (tahnode.train.clip_rule).

In the butterfly each of the P replicas reduces a P-th of the vector: the others send it their part
compressed (its own stays raw), it averages them by the clip rule (centred on its own part, each other
part's difference clipped) and sends every sender the same average, compressed (so that the replicas
stay equal), and takes it itself as they do; a sender takes it for its part unless it is not finite or
further from its own part than the rule allows (a reducer that lies): then it keeps its own part."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import blockwise
from .clip_rule import CLIP, SenderView, centred_clip, takes

__all__ = ["compress", "GroupMean", "butterfly_mean", "wire_bytes", "reducer_counted"]


def compress(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x` as the receiver decodes it after it crossed the wire at `bits` bits."""
    if bits == 32:
        return x.clone()
    if bits == 16:
        return x.to(torch.float16).to(torch.float32)
    return blockwise.dequantize(blockwise.quantize(x, bits), x.numel())


def reducer_counted(own: torch.Tensor, exact: torch.Tensor, coded: torch.Tensor, senders: int) -> torch.Tensor:
    """What a mean counted of the part its reducer averaged: its own values went in raw, and the
    rounding of the mean it sent back (exact - coded, over `senders` parts) is its to carry."""
    return own - senders * (exact - coded)


def _crossed(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A sender's part as its reducer decodes it; one the codec cannot carry (not finite) arrives
    as NaN, and is refused."""
    try:
        return compress(x, bits)
    except blockwise.BlockwiseError:
        return torch.full_like(x, float("nan"))


def wire_bytes(count: int, bits: int) -> int:
    """Bytes of `count` values at `bits` bits (blockwise codes with their scales and header)."""
    return blockwise.encoded_size(count, bits) if bits in blockwise.BLOCKWISE_BITS else count * bits // 8


@dataclass
class GroupMean:
    """One group's result: each replica's view of the mean, whom each part's reducer clipped or left out,
    what each reducer saw of each sender, and the bytes each replica sent."""

    means: list[torch.Tensor]
    clipped: list[set[int]]  # per part: the senders its reducer clipped or left out (not finite)
    kept: list[set[int]]     # per part: the senders that refused its reducer's average and kept their own
    bytes_sent: list[int]
    # what the mean counted of each replica's vector: its parts as their reducers decoded them, and for the
    # part it reduced its own values less the rounding of that part's mean times the senders in it (the
    # mean moved by what its compression lost); where nothing was counted (left out, or the mean not taken)
    # the vector itself. vector - counted is what error feedback carries into the next round
    counted: list[torch.Tensor]
    views: list[list[SenderView | None]]  # per part (= its reducer): what it saw of each sender


def butterfly_mean(vectors: list[torch.Tensor], bits: int, clip: float = CLIP) -> GroupMean:
    """The mean of the replicas' flat float32 `vectors` as each of them ends up with it."""
    p = len(vectors)
    n = vectors[0].numel()
    bounds = [n * j // p for j in range(p + 1)]
    means = [v.clone() for v in vectors]
    counted = [v.clone() for v in vectors]
    sent = [0] * p
    clipped, kept, views = [], [], []
    for j in range(p):
        lo, hi = bounds[j], bounds[j + 1]
        clipped.append(set())
        kept.append(set())
        views.append([None] * p)
        if hi == lo:
            continue
        received = [vectors[i][lo:hi] if i == j else _crossed(vectors[i][lo:hi], bits) for i in range(p)]
        for i in range(p):
            if i != j:
                sent[i] += wire_bytes(hi - lo, bits)
        usable = [r if bool(torch.isfinite(r).all()) else None for r in received]
        if usable[j] is None:  # a reducer without a finite part of its own averages nothing: all keep theirs
            kept[j] = set(range(p))
            continue
        result = centred_clip(usable, j, clip)
        views[j] = result.views
        clipped[j] = {i for i, view in enumerate(result.views) if view is not None and (view.clipped or view.unusable)}
        exact = result.mean
        mean = _crossed(exact, bits)
        senders = sum(u is not None for u in usable)
        for i in range(p):
            if i != j:
                sent[j] += wire_bytes(hi - lo, bits)
            own = vectors[i][lo:hi]
            if takes(own, mean, p, bits, clip):
                means[i][lo:hi] = mean
                if usable[i] is not None and i != j:
                    counted[i][lo:hi] = received[i]
                elif i == j:
                    counted[i][lo:hi] = reducer_counted(own, exact, mean, senders)
            else:
                kept[j].add(i)
    return GroupMean(means, clipped, kept, sent, counted, views)

"""What the replicas of a stage average and how, as arithmetic a process can run alone: hivemind's
butterfly all-reduce over compressed pseudo-gradients, with the check that refuses a replica's part
that is not finite or far larger than its group's (the rule the averager's reducer applies).

In the butterfly each of the P replicas reduces a P-th of the vector: the others send it their part
compressed (its own stays raw), it averages the parts it admits and sends every sender the same
average, compressed (so that the replicas stay equal), and takes it itself as they do; a sender
takes it for its part unless it is not finite or far larger than its own part (a reducer that
lies): then it keeps its own part."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import blockwise

__all__ = ["admitted", "accepted", "lower_median", "compress", "GroupMean", "butterfly_mean", "wire_bytes",
           "reducer_counted"]


def lower_median(values: list[float]) -> float:
    """The median, the lower of the two middle values for an even count (of two: the smaller)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def admitted(norms: list[float], ratio: float) -> list[bool]:
    """Which senders' parts a reducer averages, its own among them by the same rule: those whose norm
    is finite and at most `ratio` times the lower median of the finite norms, so that one large part
    is refused even in a group of two (the part at the lower median is always in). A reducer that
    took its own part unchecked averaged its own lie, or its own blow-up, into its weights."""
    finite = [n for n in norms if n == n and n != float("inf")]
    reference = lower_median(finite) if finite else 0.0
    return [n == n and n != float("inf") and n <= ratio * max(reference, 1e-30) for n in norms]


def accepted(own: torch.Tensor, averaged: torch.Tensor, ratio: float) -> bool:
    """Whether a sender takes the average a reducer returned for its part: finite, and its norm at
    most `ratio` times its own part's (the mean of honest parts is no larger than the largest)."""
    norm = float(averaged.norm())
    return norm == norm and norm != float("inf") and norm <= ratio * max(float(own.norm()), 1e-30)


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
    """One group's result: each replica's view of the mean, who was refused in which part, and the
    bytes each replica sent."""

    means: list[torch.Tensor]
    refused: list[set[int]]  # per part: the senders its reducer left out
    kept: list[set[int]]     # per part: the senders that refused its reducer's average and kept their own
    bytes_sent: list[int]
    # what the mean counted of each replica's vector: its parts as their reducers decoded them, and for the
    # part it reduced its own values less the rounding of that part's mean times the senders in it (the
    # mean moved by what its compression lost); where nothing was counted (refused, or the mean not taken)
    # the vector itself. vector - counted is what error feedback carries into the next round
    counted: list[torch.Tensor]


def butterfly_mean(vectors: list[torch.Tensor], bits: int, ratio: float) -> GroupMean:
    """The mean of the replicas' flat float32 `vectors` as each of them ends up with it."""
    p = len(vectors)
    n = vectors[0].numel()
    bounds = [n * j // p for j in range(p + 1)]
    means = [v.clone() for v in vectors]
    counted = [v.clone() for v in vectors]
    sent = [0] * p
    refused, kept = [], []
    for j in range(p):
        lo, hi = bounds[j], bounds[j + 1]
        refused.append(set())
        kept.append(set())
        if hi == lo:
            continue
        received = [vectors[i][lo:hi] if i == j else _crossed(vectors[i][lo:hi], bits) for i in range(p)]
        for i in range(p):
            if i != j:
                sent[i] += wire_bytes(hi - lo, bits)
        ok = admitted([float(r.norm()) for r in received], ratio)
        refused[j] = {i for i in range(p) if not ok[i]}
        exact = torch.stack([r for r, keep in zip(received, ok) if keep]).mean(dim=0)
        mean = _crossed(exact, bits)
        for i in range(p):
            if i != j:
                sent[j] += wire_bytes(hi - lo, bits)
            own = vectors[i][lo:hi]
            if accepted(own, mean, ratio):
                means[i][lo:hi] = own + (mean - own)  # as hivemind adds it: the difference to its own part
                if ok[i] and i != j:
                    counted[i][lo:hi] = received[i]
                elif ok[i]:
                    counted[i][lo:hi] = reducer_counted(own, exact, mean, sum(ok))
            else:
                kept[j].add(i)
    return GroupMean(means, refused, kept, sent, counted)

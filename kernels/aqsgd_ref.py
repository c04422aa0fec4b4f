"""`aqsgd` codec specification (AQ-SGD): each sample's activations are sent as a k-bit quantized
delta against a per-sample cache m(xi) kept identically on both ends; a first visit goes in full.

Rows are the samples along dim 0 of x (B, ..., C), keyed by the sample ids of the micro-batch. The
delta uses the `group` quantizer; both ends add the same dequantized delta to m (bit-identical)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import group_ref
from .group_ref import GroupParams
from .quant_ref import check_finite
from .wire import CodecError, PayloadReader, as_bytes, bitmap, from_bytes, read_bitmap

__all__ = ["AqsgdParams", "AqsgdCache", "encode", "decode"]


@dataclass(frozen=True)
class AqsgdParams:
    bits: int = 4          # bits of the quantized delta
    group_size: int = 64   # tile of the delta quantizer (group codec)

    def group(self) -> GroupParams:
        return GroupParams(group_size=self.group_size, bits=self.bits).validate()


@dataclass
class AqsgdCache:
    """m(xi): the last reconstruction of each sample's activations, float32, one per sample id."""

    rows: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows.values())

    def __len__(self) -> int:
        return len(self.rows)


def _check_ids(sample_ids, nrows: int) -> list[int]:
    ids = [int(i) for i in sample_ids]
    if len(ids) != nrows:
        raise CodecError(f"aqsgd: {len(ids)} sample ids for {nrows} rows (dim 0 of the tensor)")
    if len(set(ids)) != len(ids):
        raise CodecError("aqsgd: sample ids within one micro-batch must be distinct")
    return ids


def encode(x: torch.Tensor, sample_ids, cache: AqsgdCache, params: AqsgdParams = AqsgdParams()) -> torch.Tensor:
    """Payload: new-row bitmap (1 = first visit, sent raw), the raw rows in x's dtype, then the
    `group` sections (zero, scale, codes) of the deltas of the cached rows. Updates `cache`."""
    gp = params.group()
    check_finite(x, "aqsgd")
    if x.dim() < 2:
        raise CodecError("aqsgd needs a tensor (B, ..., C) with one sample per row of dim 0")
    ids = _check_ids(sample_ids, x.shape[0])
    rows = x.float()
    new = torch.tensor([i not in cache.rows for i in ids], dtype=torch.bool)
    for i in ids:
        if i in cache.rows and cache.rows[i].shape != x.shape[1:]:
            raise CodecError(f"aqsgd: sample {i} was cached with shape {list(cache.rows[i].shape)}, "
                             f"now {list(x.shape[1:])}")
    sections = [bitmap(new).to(x.device), as_bytes(x[new.to(x.device)])]
    cached = [k for k, i in enumerate(ids) if i in cache.rows]
    if cached:
        m = torch.stack([cache.rows[ids[k]] for k in cached])
        delta = rows[cached] - m
        q, zero, scale = group_ref.quantize_tiles(delta, gp, "aqsgd")
        sections.append(group_ref.tile_sections(q, zero, scale, gp))
        recon = m + group_ref.dequantize_tiles(q, zero, scale, delta.shape, gp)
        for j, k in enumerate(cached):
            cache.rows[ids[k]] = recon[j]
    for k, i in enumerate(ids):
        if bool(new[k]):
            cache.rows[i] = rows[k].clone()
    return torch.cat(sections)


def decode(payload: torch.Tensor, shape, dtype: torch.dtype, sample_ids, cache: AqsgdCache,
           params: AqsgdParams = AqsgdParams()) -> torch.Tensor:
    gp = params.group()
    if len(shape) < 2:
        raise CodecError("aqsgd needs a tensor (B, ..., C) with one sample per row of dim 0")
    ids = _check_ids(sample_ids, shape[0])
    row_shape = tuple(shape[1:])
    itemsize = torch.empty((), dtype=dtype).element_size()
    rd = PayloadReader(payload, "aqsgd")
    new = read_bitmap(rd.take(-(-len(ids) // 8), "new-row bitmap"), len(ids), "new-row")
    n_new = int(new.sum())
    raw = from_bytes(rd.take(n_new * math.prod(row_shape) * itemsize, "raw rows"), dtype)
    cached = [k for k in range(len(ids)) if not bool(new[k])]
    for k in cached:
        if ids[k] not in cache.rows:
            raise CodecError(f"aqsgd: sample {ids[k]} has no cache entry on this end "
                             "(its first visit was not received)")
        if tuple(cache.rows[ids[k]].shape) != row_shape:
            raise CodecError(f"aqsgd: sample {ids[k]} was cached with shape {list(cache.rows[ids[k]].shape)}, "
                             f"message has {list(row_shape)}")
    out = torch.empty(shape, dtype=torch.float32, device=payload.device)
    out[new.to(payload.device)] = raw.reshape(n_new, *row_shape).float()
    if cached:
        dshape = (len(cached), *row_shape)
        q, zero, scale = group_ref.read_tiles(rd, dshape, gp)
        rd.finish()
        m = torch.stack([cache.rows[ids[k]] for k in cached])
        recon = m + group_ref.dequantize_tiles(q, zero, scale, dshape, gp)
        out[cached] = recon
    else:
        rd.finish()
    for k, i in enumerate(ids):
        cache.rows[i] = out[k].clone()
    return out.to(dtype)

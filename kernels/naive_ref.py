"""`naive` codec specification: k-bit symmetric absmax quantization with one fp16 scale per
channel (last dim) over all tokens; the backward (gradient) codec of the paper, k = 6 by default."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bitpack import pack_bits, packed_nbytes, padded_count, unpack_bits
from .quant_ref import absmax_scales, check_finite, dequantize_sym, quantize_sym
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["NaiveParams", "encode", "decode", "payload_nbytes"]


@dataclass(frozen=True)
class NaiveParams:
    bits: int = 6

    def validate(self) -> "NaiveParams":
        if self.bits != int(self.bits) or not 2 <= self.bits <= 8:
            raise CodecError(f"naive: bits must be an integer in [2, 8], got {self.bits}")
        return self

    @property
    def qmax(self) -> int:
        return 2 ** (int(self.bits) - 1) - 1


def payload_nbytes(shape, params: NaiveParams) -> int:
    channels = shape[-1]
    return 2 * channels + packed_nbytes(math.prod(shape), params.bits)


def encode(x: torch.Tensor, params: NaiveParams = NaiveParams()) -> tuple[torch.Tensor, int]:
    """-> (payload, e). Payload: scale fp16[C], then the codes q + qmax of all elements in
    row-major order packed at `bits` (zero-padded to a multiple of 8 codes). The effective scale of
    channel c is fp32(scale[c]) * 2**e; e travels in the header."""
    params.validate()
    check_finite(x, "naive")
    c = x.shape[-1]
    x2 = x.reshape(-1, c).float()
    scale16, e = absmax_scales(x2, params.qmax, "naive")
    codes = quantize_sym(x2, scale16, e, params.qmax).reshape(-1)
    padded = torch.zeros(padded_count(codes.numel()), dtype=torch.uint8, device=x.device)
    padded[: codes.numel()] = codes
    return torch.cat([as_bytes(scale16), pack_bits(padded, params.bits)]), e


def sections(payload: torch.Tensor, shape, params: NaiveParams, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the header and the payload's size; -> (scale fp16 (C,), packed codes). Shared with
    the Triton decoder."""
    params.validate()
    if not -126 <= e <= 127:
        raise CodecError(f"naive: scale exponent {e} out of range [-126, 127]")
    expected = payload_nbytes(shape, params)
    if payload.numel() != expected:
        raise CodecError(f"naive payload has {payload.numel()} bytes, shape {list(shape)} needs {expected}")
    rd = PayloadReader(payload, "naive")
    scale16 = rd.take_array(shape[-1], torch.float16, "scales")
    codes = rd.take(packed_nbytes(math.prod(shape), params.bits), "codes")
    rd.finish()
    return scale16, codes


def decode(payload: torch.Tensor, shape, params: NaiveParams, e: int, dtype: torch.dtype) -> torch.Tensor:
    scale16, packed = sections(payload, shape, params, e)
    c = shape[-1]
    n = math.prod(shape)
    if not (bool(torch.isfinite(scale16).all()) and bool((scale16 >= 0).all())):
        raise CodecError("naive payload is corrupt: negative or non-finite scale")
    codes = unpack_bits(packed, params.bits, padded_count(n))
    if bool((codes[:n] > 2 * params.qmax).any()) or bool(codes[n:].any()):
        raise CodecError("naive payload is corrupt: code out of range or non-zero padding")
    x = dequantize_sym(codes[:n].reshape(-1, c), scale16, e, params.qmax)
    return x.reshape(shape).to(dtype)

"""The Rice coder's block sums on the GPU: sums[b, k], the sum of z >> k over block b's zigzagged
codes, from which the one-program kernel picks k (rice.best_k) and the write kernel finds each block's
first bit. Added by whichever kernel holds the codes: rice_triton's sums kernel, which loads them, or
the kernel that makes them (symtiles_triton's encode for tahquant), so that no pass reads them again."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["zigzag", "add_block_sums"]


@triton.jit
def zigzag(c):
    """Codes less QMAX (int32) -> their zigzagged values: c -> (2c) xor (c >> 31)."""
    return (c << 1) ^ (c >> 31)


@triton.jit
def add_block_sums(z, at, ok, R: tl.constexpr, C: tl.constexpr, KMAX: tl.constexpr):
    """Row at[r] of the sums (int32 pointers (R,)) += the sum of z[r] >> k over z's row r, k = 0..KMAX
    (the row's other entries are left as they are), where ok[r]; z (R, C) int32 below 2^KMAX. One
    atomic addition a row, every k at once. Where z < 32 and C <= 128 (a multiple of 16) the bits are counted
    instead of shifted 6 times: a multiply puts bit b of z at bit 6b, 16 values are summed there
    (counts below 64), then bits 0, 2, 4 and bits 1, 3 over the row in fields 12 bits apart (counts
    of C at most), and the sum of z >> k is that of count_b << (b - k) over b >= k."""
    KS: tl.constexpr = 8 if KMAX < 8 else 16  # columns for k = 0..KMAX
    ks = tl.arange(0, KS)[None, :]
    total = tl.zeros([R, KS], dtype=tl.int32)
    if KMAX <= 5 and C % 16 == 0 and C <= 128:
        spread = tl.sum(tl.reshape((z * 0x108421) & 0x1041041, (R, C // 16, 16)), axis=2)
        even = tl.sum(spread & 0x3F03F03F, axis=1)
        odd = tl.sum((spread >> 6) & 0x3F03F03F, axis=1)
        for b in tl.static_range(KMAX):
            if b % 2 == 0:
                count = (even >> (12 * (b // 2))) & 0xFF
            else:
                count = (odd >> (12 * (b // 2))) & 0xFF
            total += tl.where(ks <= b, count[:, None] << tl.maximum(b - ks, 0), 0)
    else:
        for k in tl.static_range(KMAX + 1):
            total += tl.where(ks == k, tl.sum(z >> k, axis=1)[:, None], 0)
    tl.atomic_add(at[:, None] + ks, total, mask=ok[:, None] & (ks <= KMAX), sem="relaxed")

"""tahnode.kernels.rice in Triton, the kernels rice_triton launches (its docstring tells their
parts): the block sums, the one-program pick of k and the size, the write kernel (low-bit planes and the
unary stream) and decode's zero-bit count and values kernels, with their device helpers."""

from __future__ import annotations

import triton
import triton.language as tl

from .rice_sums_triton import add_block_sums, zigzag
from .symtiles_triton import store_planes
from .triton_util import leading_ones, zero_bits


@triton.jit
def _zigzag(codes_ptr, i, ok, QMAX: tl.constexpr):
    """The zigzagged codes (int32) at indices i (0 where not ok)."""
    return zigzag(tl.load(codes_ptr + i, mask=ok, other=QMAX).to(tl.int32) - QMAX)


@triton.jit
def _sums_kernel(codes_ptr, n, sums_ptr, QMAX: tl.constexpr, KMAX: tl.constexpr, BLOCK: tl.constexpr):
    """sums[program, k] += the sum of z >> k over the program's BLOCK values, k = 0..KMAX (the bit
    length of 2 QMAX: no larger k is picked)."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = tl.zeros([1], dtype=tl.int32)
    add_block_sums(tl.reshape(_zigzag(codes_ptr, i, i < n, QMAX), (1, BLOCK)), sums_ptr + pid * 9 + row, row == 0, 1,
                   BLOCK, KMAX)


@triton.jit
def _taken(codes_ptr, i, ok, QMAX: tl.constexpr, K: tl.constexpr):
    """The unary bits of the values at i, (z >> K) + 1 (int32; 0 where not ok)."""
    return tl.where(ok, (_zigzag(codes_ptr, i, ok, QMAX) >> K) + 1, 0)


@triton.jit
def _pick_kernel(totals_ptr, n, start, capacity, picked_ptr, payload_ptr, KMAX: tl.constexpr):
    """One program: k, the fewest coded bits n*(k + 1) + totals[k] over k = 0..KMAX (totals: the sums
    of z >> k over all values, ends' last row), the smallest k on a tie (rice.shortest_k), to the
    payload's byte 0 and picked[1]; the payload's size in bytes, start + those bits / 8 rounded up, to
    picked[0]. Where the size exceeds `capacity` (codes above 2 QMAX), byte 0 is 255: no write
    kernel's k, so none writes."""
    n64 = n.to(tl.int64)
    best = n64 + tl.load(totals_ptr)
    k = tl.full([], 0, tl.int32)
    for K in tl.static_range(1, KMAX + 1):
        bits = n64 * (K + 1) + tl.load(totals_ptr + K)
        k = tl.where(bits < best, K, k)
        best = tl.minimum(bits, best)
    size = start + (best + 7) // 8
    tl.store(payload_ptr, tl.where(size <= capacity, k, 255).to(tl.uint8))
    tl.store(picked_ptr, size)
    tl.store(picked_ptr + 1, k.to(tl.int64))


@triton.jit
def _write_kernel(codes_ptr, n, sums_ptr, ends_ptr, payload_ptr, start, QMAX: tl.constexpr, K: tl.constexpr,
                  BLOCK: tl.constexpr, PER_LANE: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr, S2: tl.constexpr,
                  S1: tl.constexpr):
    """Program b: values [b*BLOCK, +BLOCK) coded at K into the payload, if K is the k _pick_kernel
    wrote at its byte 0 (else it stores nothing). Their low K bits go to the planes from byte `start`
    on (S<w>: the bit offset of the width-w plane, -1 if absent; the head, bytes [1, start), is the
    caller's), the unary stream n*K/8 bytes after. The block's first bit in it is first_bit =
    b*BLOCK + the sum of z >> K over the blocks before it (ends - sums at K: block_sums).
    A lane holds PER_LANE (8 or more) values in a row and takes them in turn (unrolled, each code
    loaded where it is needed, a lane apart: no layout but one): the sum of their (z >> K) + 1 over
    the lanes before it (a cumulative sum) is its first bit; a value's zero-bit follows its run of
    one-bits. A byte of the unary stream is written once, by the last value whose zero-bit falls in
    it (all its other bits are ones), with the zero-bits of the values before it in that byte; those
    of the lane before (or the block before) can only fall in the lane's first byte (8 or more values
    take 8 or more bits). _write_by_word does that where a lane's bits fit an int64, _write_by_byte
    elsewhere. Positions are int32 from the byte of first_bit on, indices int32 from the block's
    first value (n < 2**31): only addresses are 64-bit. No branch on the picked k: a branch around
    this body took more registers."""
    LANES: tl.constexpr = BLOCK // PER_LANE
    live = tl.load(payload_ptr) == K
    pid = tl.program_id(0)
    first_value = pid.to(tl.int64) * BLOCK
    block_codes = codes_ptr + first_value
    left = tl.minimum(n - first_value, 2 * BLOCK).to(tl.int32)  # values from the block's first on (2 BLOCK at most)
    low_ptr = payload_ptr + start
    if K > 0:
        j = tl.arange(0, BLOCK)
        first = tl.full([1], 0, tl.int64) + first_value
        z = tl.reshape(_zigzag(block_codes, j, tl.where(live, j < left, False), QMAX), (1, BLOCK))
        store_planes(low_ptr, n, z, first, n - first, tl.where(live, first < n, False), 1, BLOCK, S8, S4, S2, S1)
    first_bit = first_value + tl.load(ends_ptr + pid * 9 + K) - tl.load(sums_ptr + pid * 9 + K)
    lane_first = tl.arange(0, LANES) * PER_LANE  # the lane's first value, from the block's first
    total = tl.zeros([LANES], dtype=tl.int32)
    for m in tl.static_range(PER_LANE):  # (a & of a loaded scalar: the interpreter's masks refuse it)
        total += _taken(block_codes, lane_first + m, tl.where(live, lane_first + m < left, False), QMAX, K)
    lane_bit = (first_bit & 7).to(tl.int32) + tl.cumsum(total, axis=0) - total  # from the byte of first_bit on
    unary = low_ptr + n.to(tl.int64) * K // 8 + (first_bit >> 3)
    lowest = tl.maximum(-first_value, -7).to(tl.int32)  # the block before's last 7 values, if any
    if 7 + PER_LANE * ((2 * QMAX >> K) + 1) <= 64:  # a lane's bits, from its first byte on, fit an int64
        _write_by_word(block_codes, unary, lane_first, lane_bit, (first_bit & 7).to(tl.int32), left, live, lowest, QMAX,
                       K, PER_LANE, LANES)
    else:
        _write_by_byte(block_codes, unary, lane_first, lane_bit, left, live, lowest, QMAX, K, PER_LANE, LANES)


@triton.jit
def _write_by_word(block_codes, unary, lane_first, lane_bit, first_bit, left, live, lowest, QMAX: tl.constexpr,
                   K: tl.constexpr, PER_LANE: tl.constexpr, LANES: tl.constexpr):
    """The write kernel's unary stream where a lane's bits, from its first byte on, fit an int64 (qmax
    12 at k >= 2, 8 values a lane): each value sets its zero-bit in the lane's word; the lane writes
    each byte a value of it ends in, but its last when the next lane's first value ends there too
    (that lane writes it). The zero-bits of the lane before in the lane's first byte are those it has
    in its last (one gather), for the block's first lane those of the block before's last 7 values
    (one vector of them). first_bit: the block's, within its byte."""
    lane_byte = lane_bit >> 3
    end = lane_bit - 1 - 8 * lane_byte  # where the value before ends, from the lane's first byte on: -1 to 6
    mine = tl.zeros([LANES], dtype=tl.int64)  # the lane's zero-bits
    for m in tl.static_range(PER_LANE):
        ok = tl.where(live, lane_first + m < left, False)
        end += _taken(block_codes, lane_first + m, ok, QMAX, K)
        mine |= tl.where(ok, tl.full([LANES], 1, tl.int64) << tl.maximum(end, 0).to(tl.int64), 0)
    ok = tl.where(live, lane_first + PER_LANE < left, False)
    later = ~ok | ((end + _taken(block_codes, lane_first + PER_LANE, ok, QMAX, K)) >> 3 != end >> 3)
    last = tl.maximum(end, 0) >> 3
    lane = tl.arange(0, LANES)
    before = tl.gather(((mine >> (8 * last).to(tl.int64)) & 0xFF).to(tl.int32), tl.maximum(lane - 1, 0), 0)
    m = tl.arange(0, 8)  # the block before's values, the last first
    ok = tl.where(live, -1 - m >= lowest, False)
    taken = _taken(block_codes, -1 - m, ok, QMAX, K)
    at = first_bit - 1 - (tl.cumsum(taken, axis=0) - taken)  # where value -1 - m ends (7 take 7 bits or more)
    before = tl.where(lane == 0, tl.sum(tl.where(ok & (at >= 0), 1 << tl.maximum(at, 0), 0), axis=0), before)
    zeros = mine | tl.where((lane_bit & 7) != 0, before, 0).to(tl.int64)
    for x in tl.static_range((6 + PER_LANE * ((2 * QMAX >> K) + 1)) // 8 + 1):
        mask = (((mine >> (8 * x)) & 0xFF) != 0) & ((x < last) | later)
        tl.store(unary + lane_byte + x, (~(zeros >> (8 * x)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _write_by_byte(block_codes, unary, lane_first, lane_bit, left, live, lowest, QMAX: tl.constexpr, K: tl.constexpr,
                   PER_LANE: tl.constexpr, LANES: tl.constexpr):
    """The write kernel's unary stream a byte at a time (any qmax and k): the last value whose zero-bit
    falls in a byte writes it, with the zero-bits of the values before it in that byte, carried from
    one value to the next in the lane; those of the lane before (or the block before), which can only
    fall in the lane's first byte, come from its last 7 codes. Where a code can be longer than a
    byte, each value also writes the bytes inside its run of one-bits (no value ends in them)."""
    INSIDE: tl.constexpr = (2 * QMAX >> K) // 8  # the most whole bytes inside one run of one-bits
    lane_byte = lane_bit >> 3
    # the zero-bits of the values before the lane in its first byte: 7 at most (the lane's first value
    # ends there or later), the last value first
    bits = tl.zeros([LANES], dtype=tl.int32)
    before = lane_bit - 1  # where value lane_first - 1 - m ends
    for m in tl.static_range(7):
        i = lane_first - 1 - m
        ok = tl.where(live, i >= lowest, False)
        bits |= tl.where(ok & (before >= 8 * lane_byte), 1 << (before & 7), 0)
        if m < 6:
            before -= _taken(block_codes, i, ok, QMAX, K)
    end = lane_bit - 1
    byte = lane_byte  # where the value before ends (or the lane's first byte)
    was_ok = lane_first < 0  # whether value m - 1 is in the stream (set at each m, read from m = 1 on)
    for m in tl.static_range(PER_LANE + 1):  # value m - 1's byte is written once value m's end is known
        ok = tl.where(live, lane_first + m < left, False)
        own = _taken(block_codes, lane_first + m, ok, QMAX, K)
        if m > 0:  # value m - 1 ends its byte where value m ends in a later byte, or the stream ends
            tl.store(unary + byte, (~bits & 0xFF).to(tl.uint8), mask=was_ok & (((end + own) >> 3 != byte) | ~ok))
        if m < PER_LANE:
            for b in tl.static_range(INSIDE):  # the bytes after the one the value before ends in
                inside = (end >> 3) + 1 + b
                tl.store(unary + inside, tl.full([LANES], 0xFF, tl.uint8), mask=ok & (inside < (end + own) >> 3))
            end += own
            bits = tl.where(end >> 3 == byte, bits, 0) | (1 << (end & 7))
            byte = end >> 3
            was_ok = ok


@triton.jit
def _zeros_kernel(unary_ptr, nbytes, count_ptr, BLOCK: tl.constexpr):
    """count[b] = the zero-bits of bytes [b*BLOCK, +BLOCK) of the unary stream."""
    pid = tl.program_id(0)
    byte = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(unary_ptr + byte, mask=byte < nbytes, other=0xFF).to(tl.int32)
    tl.store(count_ptr + pid, tl.sum(zero_bits(b), axis=0))


@triton.jit
def _low_bits(low_ptr, plane, first, index, ok, W: tl.constexpr):
    """The width-W plane's values (int32) of the codes at first + index (first: a scalar; index:
    int32, 0 or more, any order)."""
    PER: tl.constexpr = 8 // W
    at = ((first % PER).to(tl.int32) + index).to(tl.uint32)  # unsigned: // and % by PER are a shift and a mask
    b = tl.load(low_ptr + plane + first // PER + at // PER, mask=ok, other=0).to(tl.int32)
    return (b >> ((at % PER) * W).to(tl.int32)) & ((1 << W) - 1)


@triton.jit
def _plane_window(low_ptr, plane, first, rank, n, W: tl.constexpr, PER_LANE: tl.constexpr, WINDOWED: tl.constexpr):
    """Where WINDOWED, the width-W plane's bits (int64) from the byte code first + rank starts in on,
    for the 8 PER_LANE codes from it (8 PER_LANE W + 7 <= 64), and the bit that code starts at in
    them; else zeros."""
    window = tl.zeros_like(rank).to(tl.int64)
    at = tl.zeros_like(rank)
    if WINDOWED:
        PER: tl.constexpr = 8 // W
        at = ((first % PER).to(tl.int32) + rank) * W  # bits from the byte of code `first` on
        byte = first // PER + (at >> 3)
        for m in tl.static_range((8 * PER_LANE * W + 14) // 8):
            window |= tl.load(low_ptr + plane + byte + m, mask=byte + m < n // PER, other=0).to(tl.int64) << (8 * m)
    return window, at & 7


@triton.jit
def _plane_bits(window, off, low_ptr, plane, first, rank, ok, W: tl.constexpr, WINDOWED: tl.constexpr):
    """A code's low bits in the width-W plane (int32): from the lane's window at bit `off`, or loaded."""
    if WINDOWED:
        bits = ((window >> off.to(tl.int64)) & ((1 << W) - 1)).to(tl.int32)
    else:
        bits = _low_bits(low_ptr, plane, first, rank, ok, W)
    return bits


@triton.jit
def _values_kernel(unary_ptr, nbytes, rank_ptr, low_ptr, n, codes_ptr, bad_ptr, QMAX: tl.constexpr, K: tl.constexpr,
                   WINDOWS: tl.constexpr, BLOCK: tl.constexpr, PER_LANE: tl.constexpr, S8: tl.constexpr,
                   S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr):
    """Program b: the zero-bits of bytes [b*BLOCK, +BLOCK), the r-th of the stream (r from rank[b] on)
    ending value r: its high part is the run of one-bits just below it, its low bits code r of the
    planes; code r = unzigzag(z) + QMAX. bad[b] = 1 if one of its values exceeds 2 QMAX. A lane takes
    PER_LANE bytes in a row bit by bit (unrolled), each byte loaded by itself (as one vector they take
    another layout than the codes' stores: a conversion through shared memory at every bit); a
    zero-bit's rank is its lane's (a cumsum over the lanes) plus the zero-bits before it in the lane.
    A valid run is at most R = 2 QMAX >> K. Where R + 1 bits fit the 2 bytes before a lane's first
    (R <= 15), the run below its first bit ends at the highest zero-bit of those bytes as one int32
    word (the float32 exponent), and is carried from bit to bit after (a one-bit adds one, a zero-bit
    ends it); else WINDOWS windows of 32 bits (5 bytes, int64) are searched below each zero-bit. A
    code's low bits come from a window of each plane loaded once a lane, where a lane's codes' bits
    fit an int64 (the 2-bit plane at 2 bytes a lane), else from a load a code. Indices are int32
    from the block's first value on."""
    R: tl.constexpr = 2 * QMAX >> K
    NB: tl.constexpr = (R + 8) // 8 + 1  # the bytes that hold R + 1 bits below any bit, and its own
    LANES: tl.constexpr = BLOCK // PER_LANE
    pid = tl.program_id(0)
    lane_at = pid.to(tl.int64) * BLOCK + tl.arange(0, LANES) * PER_LANE  # the lane's first byte
    count = tl.zeros([LANES], dtype=tl.int32)
    for j in tl.static_range(PER_LANE):
        at = lane_at + j
        count += zero_bits(tl.load(unary_ptr + at, mask=at < nbytes, other=0xFF).to(tl.int32))
    first = tl.load(rank_ptr + pid)  # the rank of the block's first zero-bit
    rank = tl.cumsum(count, axis=0) - count  # of the lane's first zero-bit, from `first` on
    left = tl.minimum(n - first, BLOCK * 8).to(tl.int32)  # values from `first` to the stream's end (those here)
    codes = codes_ptr + first
    bad = tl.zeros([LANES], dtype=tl.int32)
    # the low bits of the lane's codes, a window of each plane where 8 PER_LANE of them fit an int64
    W4: tl.constexpr = S4 >= 0 and 32 * PER_LANE + 7 <= 64
    W2: tl.constexpr = S2 >= 0 and 16 * PER_LANE + 7 <= 64
    W1: tl.constexpr = S1 >= 0 and 8 * PER_LANE + 7 <= 64
    window4, off4 = _plane_window(low_ptr, n // 8 * S4, first, rank, n, 4, PER_LANE, W4)
    window2, off2 = _plane_window(low_ptr, n // 8 * S2, first, rank, n, 2, PER_LANE, W2)
    window1, off1 = _plane_window(low_ptr, n // 8 * S1, first, rank, n, 1, PER_LANE, W1)
    lane_rank = rank
    for j in tl.static_range(PER_LANE):
        at = lane_at + j
        in_stream = at < nbytes
        byte = tl.load(unary_ptr + at, mask=in_stream, other=0xFF).to(tl.int32)
        if NB <= 3 and j == 0:  # the run of one-bits below the lane's first bit, in the NB - 1 bytes before it
            word = tl.zeros([LANES], dtype=tl.int32)  # before the stream: zero-bits
            for m in tl.static_range(1, NB):
                word |= (tl.load(unary_ptr + at - m, mask=in_stream & (at >= m), other=0).to(tl.int32)
                         << (8 * (NB - 1 - m)))
            x = ~word & ((1 << (8 * (NB - 1))) - 1)  # their zero-bits
            highest = (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # exact (x < 2^24); -127 for 0
            run = 8 * (NB - 1) - 1 - highest  # more than R where every bit is one
        for bit in tl.static_range(8):
            one = ((byte >> bit) & 1) != 0
            zero = in_stream & ~one
            if NB <= 3:  # the run carried from bit to bit
                high = run
                run = tl.where(one, run + 1, 0)
            else:
                pos = at * 8 + bit
                high = tl.zeros([LANES], dtype=tl.int32)
                run_on = zero
                for w in tl.static_range(WINDOWS):  # bits [top - 32, top) as one word; before the stream: zero-bits
                    start = pos - 32 * (w + 1)
                    window = tl.zeros([LANES], dtype=tl.int64)
                    for m in tl.static_range(5):
                        byte_at = (start >> 3) + m
                        window |= tl.load(unary_ptr + byte_at, mask=run_on & (byte_at >= 0),
                                          other=0).to(tl.int64) << (8 * m)
                    ones = leading_ones((window >> (start & 7)) & 0xFFFFFFFF).to(tl.int32)
                    high += tl.where(run_on, ones, 0)
                    run_on = run_on & (ones == 32)
            ok = zero & (rank < left)
            z = tl.minimum(high, R + 1) << K  # more than 2 QMAX where the run is longer than R
            if S8 >= 0:
                z |= _low_bits(low_ptr, n // 8 * S8, first, rank, ok, 8) << S8
            d = rank - lane_rank  # the code's place in the lane
            if S4 >= 0:
                z |= _plane_bits(window4, off4 + 4 * d, low_ptr, n // 8 * S4, first, rank, ok, 4, W4) << S4
            if S2 >= 0:
                z |= _plane_bits(window2, off2 + 2 * d, low_ptr, n // 8 * S2, first, rank, ok, 2, W2) << S2
            if S1 >= 0:
                z |= _plane_bits(window1, off1 + d, low_ptr, n // 8 * S1, first, rank, ok, 1, W1) << S1
            bad |= (ok & (z > 2 * QMAX)).to(tl.int32)
            q = (z >> 1) ^ -(z & 1)
            tl.store(codes + rank, (q + QMAX).to(tl.uint8), mask=ok)
            rank += zero.to(tl.int32)
    tl.store(bad_ptr + pid, tl.max(bad, axis=0).to(tl.uint8))

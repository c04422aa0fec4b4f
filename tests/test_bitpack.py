"""Bit packing: the documented plane layout on a worked example, and round trips of every width."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from tahnode.kernels.bitpack import pack_bits, pack_rows, plane_widths, unpack_bits, unpack_rows


def test_plane_decomposition():
    assert [plane_widths(b) for b in range(1, 9)] == [[1], [2], [2, 1], [4], [4, 1], [4, 2], [4, 2, 1], [8]]
    with pytest.raises(ValueError):
        plane_widths(9)


def test_three_bit_codes_are_a_two_bit_plane_then_a_one_bit_plane():
    codes = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.uint8)
    packed = pack_bits(codes, 3).tolist()
    # low two bits 0,1,2,3,0,1,2,3 -> LSB-first pairs: 0b11100100 twice; high bits 0,0,0,0,1,1,1,1
    assert packed == [0b11100100, 0b11100100, 0b11110000]


def test_four_bit_codes_low_nibble_first():
    assert pack_bits(torch.tensor([1, 2, 3, 4, 5, 6, 7, 15], dtype=torch.uint8), 4).tolist() == [0x21, 0x43, 0x65, 0xF7]


@given(bits=st.integers(1, 8), rows=st.integers(1, 4), n8=st.integers(1, 20), seed=st.integers(0, 1000))
def test_roundtrip(bits, rows, n8, seed):
    rng = np.random.default_rng(seed)
    codes = torch.from_numpy(rng.integers(0, 2**bits, size=(rows, 8 * n8), dtype=np.uint8))
    packed = pack_bits(codes, bits)
    assert packed.shape == (rows, n8 * bits)
    assert torch.equal(unpack_bits(packed, bits, 8 * n8), codes)


def test_rows_at_their_own_widths():
    rng = np.random.default_rng(1)
    bits = torch.tensor([3, 4, 4, 3, 8, 1])
    codes = torch.stack([torch.from_numpy(rng.integers(0, 2 ** int(b), size=16, dtype=np.uint8)) for b in bits])
    data = pack_rows(codes, bits)
    assert data.numel() == int(bits.sum()) * 2
    assert torch.equal(data[6:14], pack_bits(codes[1], 4))  # row 1 starts after row 0's 6 bytes
    assert torch.equal(unpack_rows(data, bits, 16), codes)
    with pytest.raises(ValueError):
        unpack_rows(data[:-1], bits, 16)

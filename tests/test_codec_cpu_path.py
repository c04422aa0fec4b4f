"""The fast CPU path of TAH-Quant (kernels/tahquant_cpu.py) against its specification
(kernels/tahquant_ref.py): the same payload bytes, the same decoded values bit for bit, the same
errors on corrupt payloads, for every dtype, awkward shapes, ranking shares and other bit widths;
and the codec registry serves CPU tensors with it unless TAHNODE_REFERENCE=1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tahnode import codecs
from tahnode.kernels import bitpack, bitpack_cpu, dispatch, tahquant_cpu, tahquant_ref
from tahnode.kernels.tahquant_ref import PaperParams as P
from tahnode.kernels.wire import CodecError
from helpers import activations, same_bits

SHAPES = [(1, 1, 64), (2, 5, 100), (3, 128, 64), (1, 1024, 1600), (4, 64, 256), (7, 3), (1, 1, 8)]
PARAMS = [P(), P(rho=0.5), P(group_size=32, bits_high=5, bits_low=2, tau=1.5), P(rho=1.0),
          P(rho=0.0, bits_low=4), P(group_size=8, bits_high=8, bits_low=7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_same_bytes_and_values_as_the_reference(shape, dtype):
    x = activations(shape, dtype, seed=len(shape) + shape[-1])
    for p in PARAMS:
        if p.group_size > 8 and shape[-1] < 8:
            continue
        payload = tahquant_ref.encode(x, p)
        assert torch.equal(tahquant_cpu.encode(x, p), payload), p
        assert same_bits(tahquant_cpu.decode(payload, shape, p, dtype),
                         tahquant_ref.decode(payload, shape, p, dtype)), p


@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 300), st.floats(0.0, 1.0), st.floats(1.0, 4.0),
       st.integers(0, 2**31 - 1))
def test_same_bytes_on_random_shapes_and_parameters(nseq, seq, channels, rho, tau, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(nseq, seq, channels, generator=gen) * torch.exp(2 * torch.randn(nseq, seq, channels, generator=gen))
    x[..., : channels // 7] = 0.0  # exact zeros: empty entropy terms, zero ranges
    p = P(rho=rho, tau=tau)
    payload = tahquant_ref.encode(x, p)
    assert torch.equal(tahquant_cpu.encode(x, p), payload)
    assert same_bits(tahquant_cpu.decode(payload, x.shape, p, torch.float32),
                     tahquant_ref.decode(payload, x.shape, p, torch.float32))


def corruptions(payload: torch.Tensor):
    yield payload[:-1]
    yield torch.cat([payload, torch.zeros(3, dtype=torch.uint8)])
    yield payload[: len(payload) // 3]
    for pos in (0, 1, 5, 20, len(payload) // 2):
        bad = payload.clone()
        bad[pos] ^= 0xFF
        yield bad
    nan = payload.clone()
    nan[16:18] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # an fp16 NaN among the zero-points
    yield nan


def test_the_same_errors_on_corrupt_payloads():
    shape, p = (2, 16, 128), P()
    payload = tahquant_ref.encode(activations(shape, torch.float32), p)
    for bad in corruptions(payload):
        outcomes = []
        for impl in (tahquant_ref, tahquant_cpu):
            try:
                outcomes.append(("ok", impl.decode(bad, shape, p, torch.float32)))
            except CodecError as exc:
                outcomes.append(("error", str(exc)))
        (kind_r, ref), (kind_c, cpu) = outcomes
        assert kind_r == kind_c
        assert ref == cpu if kind_r == "error" else same_bits(ref, cpu)


def test_numpy_row_packing_is_bitpacks():
    gen = torch.Generator().manual_seed(1)
    for n in (8, 64, 256):
        bits = torch.randint(1, 9, (33,), generator=gen)
        codes = (torch.randint(0, 256, (33, n), generator=gen) & ((1 << bits) - 1)[:, None]).to(torch.uint8)
        packed = bitpack.pack_rows(codes, bits)
        assert np.array_equal(bitpack_cpu.pack_rows_np(codes.numpy(), bits.numpy()), packed.numpy())
        assert np.array_equal(bitpack_cpu.unpack_rows_np(packed.numpy(), bits.numpy(), n), codes.numpy())


def test_the_registry_serves_cpu_tensors_with_the_fast_path(monkeypatch):
    x = torch.randn(2, 8, 64)
    assert dispatch.TAHQUANT_PAPER.serving(x) is tahquant_cpu
    monkeypatch.setenv("TAHNODE_REFERENCE", "1")
    assert dispatch.TAHQUANT_PAPER.serving(x) is tahquant_ref
    msg = codecs.get_codec("tahquant-paper").encode(x)
    monkeypatch.delenv("TAHNODE_REFERENCE")
    assert codecs.serialize(codecs.get_codec("tahquant-paper").encode(x)) == codecs.serialize(msg)


def test_tied_maxima_pivot_on_the_first_like_the_reference():
    """tau = 1 flags a tile whose two largest magnitudes are equal: the pivot is the first of them."""
    x = torch.randn(2, 4, 64)
    x[..., 5], x[..., 40] = 9.0, -9.0
    x[1, :, 7] = -9.0
    p = P(tau=1.0)
    assert torch.equal(tahquant_cpu.encode(x, p), tahquant_ref.encode(x, p))


@pytest.mark.parametrize("p", [P(bits_low=4, tau=1e3), P(bits_high=8, bits_low=8, tau=1e3), P(rho=0.0, tau=1e3)],
                         ids=["int4-only", "int8-only", "int3-only"])
def test_the_smallest_payload_decodes_and_one_byte_less_is_refused(p):
    """Every tile at bits_low and none flagged (tau too high): the payload is exactly as small as a
    header allows, with one allocation bit per token (not per tile), so it decodes; a byte less not."""
    x = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(3))
    payload = tahquant_ref.encode(x, p)
    tokens, tiles = 4 * 64, 4 * 64 * 2
    assert payload.numel() == tokens // 8 + tiles // 8 + 4 * tiles + tiles * 64 * p.bits_low // 8
    for decoder in (tahquant_ref.decode, tahquant_cpu.decode):
        y = decoder(payload, x.shape, p, torch.float32)
        assert float((y - x).norm() / x.norm()) < 2.0 ** (2 - p.bits_low)
        with pytest.raises(CodecError, match="truncated"):
            decoder(payload[:-1], x.shape, p, torch.float32)

"""The per-tile symmetric quantizer (kernels/symtiles_ref) and its codecs: `pertoken`, the gradient codec,
and tahquant, TAH-Quant Rice-coded (its rotated tiles). Error bounds (one token 1000x the others), the rotation's
algebra, the kernels' bytes against the references under Triton's interpreter, corrupt payloads."""

from __future__ import annotations

import pytest
import torch

from tahnode import codecs
from tahnode.codecs import CodecError
from tahnode.kernels import dispatch, pertoken_cpu, pertoken_ref, pertoken_triton, symtiles_ref
from tahnode.kernels.tahquant_rice_ref import RiceParams
from helpers import assert_kernel_gives_the_reference, kernel_test_input

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gradient_with_one_large_token(shape=(4, 256, 768), factor=1000.0, seed=0) -> torch.Tensor:
    """Gradient-sized values (std 1e-7) where one token's gradient is `factor` times the others'."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e-7
    g[1, 17] *= factor
    return g


def token_errors(name: str, x: torch.Tensor, **params) -> torch.Tensor:
    y = codecs.decode(codecs.get_codec(name, **params).encode(x))
    x, y = x.double(), y.double()  # the squares of 1e-30 underflow float32
    return ((y - x).norm(dim=-1) / x.norm(dim=-1)).reshape(-1)


def test_pertoken_error_does_not_grow_with_one_large_token():
    """6-bit absmax over 128 Gaussian values: relative error about 0.03 per token, whatever the
    other tokens hold. The per-channel codec (naive) loses every ordinary token: its scales are set
    by the large one, and most codes round to zero."""
    x = gradient_with_one_large_token()
    ours = token_errors("pertoken", x)
    assert float(ours.max()) < 0.045, float(ours.max())
    theirs = token_errors("naive", x, bits=6)
    assert float(theirs.median()) > 0.5, float(theirs.median())
    quiet = gradient_with_one_large_token(factor=1.0)
    assert float(token_errors("pertoken", quiet).max()) < 0.045
    # the per-channel codec is fine without the large token
    assert float(token_errors("naive", quiet, bits=6).max()) < 0.045


def test_pertoken_size_and_range():
    x = gradient_with_one_large_token()
    msg = codecs.get_codec("pertoken").encode(x)
    assert 6.125 < codecs.bits_per_element(msg) < 6.13  # 6 bits + a bf16 scale per 128 channels + the header
    tiny = torch.randn(2, 64, 256) * 1e-30  # far below fp16's range, inside bf16's
    assert float(token_errors("pertoken", tiny).max()) < 0.045
    zeros = codecs.decode(codecs.get_codec("pertoken").encode(torch.full((2, 8, 64), 1e-39)))
    assert torch.equal(zeros, torch.zeros(2, 8, 64))  # absmax / qmax below 2^-126: sent as zeros


def test_fwht_is_sylvester_hadamard_and_rotation_inverts():
    for g in (8, 32, 64, 256):
        y = torch.randn(5, g, generator=torch.Generator().manual_seed(g))
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < g:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        # against the exact product: a float32 matmul's own rounding may differ by more than the butterflies'
        assert torch.allclose(symtiles_ref.fwht(y).double(), y.double() @ h, rtol=1e-6, atol=1e-5)
        assert torch.allclose(symtiles_ref.fwht(symtiles_ref.fwht(y)), g * y, rtol=1e-6, atol=1e-4)
    x = torch.randn(7, 200)
    back = symtiles_ref.unrotate(symtiles_ref.rotate(x, 64), 64, 200)
    assert torch.allclose(back, x, atol=1e-6)
    signs = symtiles_ref.rotation_signs(16)
    assert set(signs.tolist()) == {1.0, -1.0} and torch.equal(signs, symtiles_ref.rotation_signs(256)[:16])
    assert signs.tolist() == symtiles_ref.rotation_signs(16).tolist()  # fixed, not random per call


def test_tahquant_refuses_values_it_cannot_rotate(kernels):
    """A finite value too large to rotate, and a non-finite one, are told apart by tahquant's
    kernels as by the codec on the CPU (the kernel flags both with one check)."""
    from tahnode.kernels import tahquant_rice_triton

    x = torch.zeros(1, 2, 64)
    x[0, 0, 0] = 3e37
    rice = RiceParams(group_size=64, qmax=12)
    with pytest.raises(CodecError, match="too large to rotate"):
        codecs.get_codec("tahquant", group_size=64).encode(x)
    with pytest.raises(CodecError, match="too large to rotate"):
        tahquant_rice_triton.encode(x.to(DEVICE), rice)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.randn(1, 2, 64)  # nothing too large besides
        y[0, 1, 7] = bad
        with pytest.raises(CodecError, match="NaN/Inf"):
            tahquant_rice_triton.encode(y.to(DEVICE), rice)


def test_a_layout_in_a_message_is_an_unknown_parameter_and_a_version_is_the_codecs():
    msg = codecs.get_codec("tahquant").encode(torch.randn(2, 3, 64))
    forged = type(msg)()
    forged.CopyFrom(msg)
    forged.params["layout"] = 3.0
    forged.crc32 = codecs.checksum(forged)
    with pytest.raises(CodecError, match="unknown parameters: layout"):
        codecs.decode(forged)
    forged.CopyFrom(msg)
    forged.version = 4
    forged.crc32 = codecs.checksum(forged)
    with pytest.raises(CodecError, match="version 4 is not supported"):
        codecs.decode(forged)


CASES = [((3, 20), torch.bfloat16, 8, 6), ((2, 5, 40), torch.float32, 32, 6), ((4, 7, 128), torch.float16, 128, 4),
         ((1, 3, 264), torch.bfloat16, 128, 8), ((2, 9, 24), torch.float32, 16, 3),
         ((2, 64, 768), torch.bfloat16, 128, 6)]


@pytest.mark.parametrize("shape,dtype,g,bits", CASES, ids=[f"{c[0]}-{c[1]}-G{c[2]}-b{c[3]}" for c in CASES])
def test_kernels_give_the_references_bytes_and_values(kernels, shape, dtype, g, bits):
    x = kernel_test_input(shape, dtype)
    assert_kernel_gives_the_reference(pertoken_triton, pertoken_ref, x, pertoken_ref.PerTokenParams(bits, g), DEVICE)


@pytest.mark.parametrize("bits", [6, 8])
def test_kernels_round_halfway_quotients_to_even_as_the_reference(kernels, bits):
    """Every quotient halfway between two codes, and one float32 step either side of it, in tiles
    whose scale is exactly 1 (absmax = qmax): the kernels round them as the reference does."""
    qmax = 2 ** (bits - 1) - 1
    half = torch.arange(-qmax, qmax, dtype=torch.float32) + 0.5
    values = torch.cat([half, torch.nextafter(half, half + 1), torch.nextafter(half, half - 1), -half.abs() * 0])
    rows = -(-values.numel() // 127)
    x = torch.zeros(rows * 127)
    x[: values.numel()] = values
    x = torch.cat([torch.full((rows, 1), float(qmax)), x.reshape(rows, 127)], dim=1)  # the tile's absmax: scale 1
    assert_kernel_gives_the_reference(pertoken_triton, pertoken_ref, x, pertoken_ref.PerTokenParams(bits, 128), DEVICE)
    codes = symtiles_ref.quantize(x, symtiles_ref.tile_scales(x, 128, qmax), 128, qmax).int() - qmax
    assert set(codes[x.abs() == 2.5].tolist()) == {-2, 2} and set(codes[x.abs() == 3.5].tolist()) == {-4, 4}


def scales_of_every_size(top: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 values (as float32) from 2^-126 to 2^top: random mantissas every 5 powers of two, and
    every mantissa at both ends, at 2^-60 (triton_util.quotient's bound) and at 2^59."""
    spread = torch.arange(-126, top + 1, 5)
    every = (1 + torch.arange(128) / 128).repeat(6)
    mantissa = torch.cat([1 + torch.randint(0, 128, spread.shape, generator=gen) / 128, every])
    exponents = torch.cat([spread, torch.tensor([-125, -122, -60, 59, top - 1, top]).repeat_interleave(128)])
    return (mantissa.double() * 2.0 ** exponents.double()).float()  # 8 significant bits


@pytest.mark.parametrize("bits", [2, 6, 8])
def test_kernels_round_halfway_quotients_at_any_scale_as_the_reference(kernels, bits):
    """Quotients halfway between two codes and a float32 step above, and tiny ones, in tiles whose
    scales are bf16 values of every size, subnormal inputs among them: pertoken's kernel (a
    reciprocal per scale and a corrected product, triton_util.quotient, in place of a division per
    value) gives the reference's codes: near the bottom of float32's range a scale would leave the
    correction's residual subnormal unless scaled, near the top its reciprocal is subnormal."""
    qmax = 2 ** (bits - 1) - 1
    gen = torch.Generator().manual_seed(bits)
    scale = scales_of_every_size(127 - qmax.bit_length(), gen)  # qmax times the largest scale stays finite
    k = torch.randint(-qmax, qmax, (scale.numel(), 42), generator=gen).double() + 0.5
    half = (k * scale.double()[:, None]).float()
    tiny = (torch.rand(scale.numel(), 42, generator=gen) - 0.5) * scale[:, None] * 2.0 ** -70
    values = torch.cat([half, torch.nextafter(half, half + scale[:, None]), tiny], dim=1)
    x = torch.cat([(qmax * scale)[:, None], values], dim=1)  # the tile's absmax: its scale exactly
    assert torch.equal(symtiles_ref.tile_scales(x, 128, qmax).float().reshape(-1), scale)
    assert_kernel_gives_the_reference(pertoken_triton, pertoken_ref, x, pertoken_ref.PerTokenParams(bits, 128), DEVICE)


@pytest.mark.parametrize("bits", [2, 6, 8])
def test_rotated_kernels_round_halfway_quotients_at_any_scale_as_the_reference(kernels, bits):
    """Layout 3's kernels (rotated tiles) divide by triton_util.quotient too: inputs that rotate to
    quotients halfway between two codes (most of them exactly: the rotation of these sums is exact)
    in tiles whose scales are bf16 values of every size, and tiles of quotients a float32 step
    above halfway and of tiny ones, give the reference's codes, on the grid of `bits`-bit codes."""
    from tahnode.kernels import tahquant_rice_ref, tahquant_rice_triton

    qmax = 2 ** (bits - 1) - 1
    gen = torch.Generator().manual_seed(bits)
    scale = scales_of_every_size(127 - qmax.bit_length() - 8, gen)[:, None]  # the rotation's sums stay finite
    half = ((torch.randint(-qmax, qmax, (scale.numel(), 127), generator=gen).double() + 0.5) * scale.double()).float()
    tiny = (torch.rand(scale.numel(), 64, generator=gen) - 0.5) * scale * 2.0 ** -70
    above = torch.cat([torch.nextafter(half[:, :63], half[:, :63] + scale), tiny], dim=1)
    rotated = torch.cat([torch.cat([qmax * scale, half], dim=1), torch.cat([qmax * scale, above], dim=1)])
    x = symtiles_ref.unrotate(rotated, 128, 128)
    exact = symtiles_ref.rotate(x, 128)[: scale.numel()] == rotated[: scale.numel()]
    assert exact.float().mean() > 0.9, exact.float().mean()
    params = RiceParams(group_size=128, qmax=qmax)
    assert_kernel_gives_the_reference(tahquant_rice_triton, tahquant_rice_ref, x, params, DEVICE)


def corruptions(payload: torch.Tensor, n_scales: int, bits: int) -> list[tuple[str, torch.Tensor]]:
    """(what, payload) pairs a decoder must refuse, with the error it names."""
    out = []
    for what, value in (("negative", -1.0), ("non-finite", float("nan")), ("subnormal", 1e-39)):
        bad = payload.clone()
        bad[:2 * n_scales].view(torch.bfloat16)[1] = value
        out.append(("scale", bad))
    if bits > 1:  # 2*qmax = 2^bits - 2: the all-ones code is out of range
        bad = payload.clone()
        bad[2 * n_scales:] = 0xFF
        out.append(("code out of range", bad))
    return out


def test_corrupt_payloads_are_refused_alike(kernels):
    shape, p = (2, 5, 40), pertoken_ref.PerTokenParams(6, 32)
    payload = pertoken_ref.encode(torch.randn(shape), p)
    for what, bad in corruptions(payload, 2 * 5 * 2, 6):
        with pytest.raises(CodecError, match=what) as want:
            pertoken_ref.decode(bad, shape, p, torch.float32)
        with pytest.raises(CodecError) as got:
            pertoken_triton.decode(bad.to(DEVICE), shape, p, torch.float32)
        assert str(got.value) == str(want.value)
    for n in (payload.numel() - 1, payload.numel() + 1):
        bad = torch.zeros(n, dtype=torch.uint8)
        with pytest.raises(CodecError, match="bytes"):
            pertoken_ref.decode(bad, shape, p, torch.float32)


def test_non_zero_padding_is_refused(kernels):
    shape, p = (3, 5), pertoken_ref.PerTokenParams(6, 8)  # 15 codes: one padding code per plane
    payload = pertoken_ref.encode(torch.randn(shape), p)
    bad = payload.clone()
    bad[2 * 3 + 7] |= 0xF0  # the last byte of the 4-bit plane holds codes 14 and 15 (padding)
    for decode in (pertoken_ref.decode, lambda b, *a: pertoken_triton.decode(b.to(DEVICE), *a)):
        with pytest.raises(CodecError, match="non-zero padding"):
            decode(bad, shape, p, torch.float32)


def test_non_finite_input_is_refused_alike(kernels):
    x = torch.randn(2, 3, 64)
    x[1, 2, 5] = float("inf")
    for encode in (pertoken_ref.encode, lambda t, p: pertoken_triton.encode(t.to(DEVICE), p)):
        with pytest.raises(CodecError, match="NaN/Inf"):
            encode(x, pertoken_ref.PerTokenParams())


@pytest.mark.parametrize("shape,dtype,g,bits", CASES, ids=[f"{c[0]}-{c[1]}-G{c[2]}-b{c[3]}" for c in CASES])
def test_the_cpu_path_gives_the_references_bytes_and_values(shape, dtype, g, bits):
    """pertoken_cpu (the registry's for CPU tensors), whole tiles or not, every width."""
    x = kernel_test_input(shape, dtype)
    assert_kernel_gives_the_reference(pertoken_cpu, pertoken_ref, x, pertoken_ref.PerTokenParams(bits, g), "cpu")


def test_the_cpu_path_refuses_what_the_reference_refuses(monkeypatch):
    shape, p = (2, 5, 40), pertoken_ref.PerTokenParams(6, 32)
    payload = pertoken_ref.encode(torch.randn(shape), p)
    padded = pertoken_ref.encode(torch.randn(3, 5), pertoken_ref.PerTokenParams(6, 8))
    padded[2 * 3 + 7] |= 0xF0  # padding codes 14 and 15 of the 4-bit plane
    cases = [(bad, shape, p) for _, bad in corruptions(payload, 2 * 5 * 2, 6)]
    cases += [(payload[:-1], shape, p), (padded, (3, 5), pertoken_ref.PerTokenParams(6, 8))]
    for bad, shape_, params in cases:
        with pytest.raises(CodecError) as want:
            pertoken_ref.decode(bad, shape_, params, torch.float32)
        with pytest.raises(CodecError) as got:
            pertoken_cpu.decode(bad, shape_, params, torch.float32)
        assert str(got.value) == str(want.value)
    x = torch.randn(2, 3, 64)
    x[1, 2, 5] = float("nan")
    with pytest.raises(CodecError, match="NaN/Inf"):
        pertoken_cpu.encode(x, p)
    monkeypatch.delenv("TAHNODE_FORCE_TRITON", raising=False)
    monkeypatch.delenv("TAHNODE_REFERENCE", raising=False)
    assert dispatch.PERTOKEN.serving(torch.zeros(1)) is pertoken_cpu

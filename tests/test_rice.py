"""Codec tahquant, TAH-Quant Rice-coded: the Rice coder on a worked example and its refusals, the
codec's error against the paper's algorithm (tahquant-paper), its header, and the GPU path's bytes
against the reference under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tahnode import codecs
from tahnode.codecs import CodecError
from tahnode.kernels import (dispatch, rice, rice_cpu, rice_triton, symtiles_ref, symtiles_triton, tahquant_rice_cpu,
                             tahquant_rice_ref, tahquant_rice_triton)
from tahnode.kernels.tahquant_rice_ref import RiceParams
from helpers import assert_kernel_gives_the_reference, kernel_test_input

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RICE = RiceParams(group_size=128)


def test_rice_worked_example():
    """z = 0, 1, 5, 2 at k = 1: low bits 0, 1, 1, 0 (one byte, LSB first: 0b0110); high parts 0, 0, 2,
    1 in unary: 0 | 0 | 110 | 10, then one-bits to the byte's end: 0b10101100."""
    low, unary = rice.encode(torch.tensor([0, 1, 5, 2]), 1)
    assert low.tolist() == [0b0110] and unary.tolist() == [0b10101100]
    assert rice.decode(low, unary, 4, 1, 5, "t").tolist() == [0, 1, 5, 2]


def test_rice_round_trips_and_best_k_is_the_shortest():
    gen = torch.Generator().manual_seed(0)
    for count, zmax in ((1, 0), (7, 3), (100, 24), (1000, 254)):
        z = torch.randint(0, zmax + 1, (count,), generator=gen) if zmax else torch.zeros(count, dtype=torch.int64)
        for k in range(zmax.bit_length() + 1):
            low, unary = rice.encode(z, k)
            assert torch.equal(rice.decode(low, unary, count, k, zmax, "t"), z)
            assert (low.numel(), unary.numel()) == (-(-count // 8) * k, -(-int(((z >> k) + 1).sum()) // 8))
        bits = {k: int(((z >> k) + 1 + k).sum()) for k in range(zmax.bit_length() + 1)}
        assert bits[rice.best_k(z, zmax)] == min(bits.values())


@pytest.mark.parametrize("what,low,unary,match", [
    ("a zero-bit too few", [0b0110], [0b11101100], "bytes of its unary stream"),
    ("a zero-bit too many", [0b0110], [0b10101000], "bytes of its unary stream"),
    ("a byte too many", [0b0110], [0b10101100, 0xFF], "bytes of its unary stream"),
    ("a value above zmax", [0b0110], [0b10011100], "out of range"),
    ("padding in the low bits", [0b10110], [0b10101100], "non-zero padding"),
])
def test_rice_refuses_streams_encode_does_not_write(what, low, unary, match):
    with pytest.raises(CodecError, match=match):
        rice.decode(torch.tensor(low, dtype=torch.uint8), torch.tensor(unary, dtype=torch.uint8), 4, 1, 5, "t")


def test_rice_refuses_a_stream_longer_than_its_values_can_take_before_unpacking_it():
    """A neighbour's payload of a small shape and a huge unary stream must not cost 8 bytes of memory
    per byte it sent: 4 values of at most 5 at k = 1 take at most 4 * 3 bits, 2 bytes."""
    low = torch.tensor([0b0110], dtype=torch.uint8)
    with pytest.raises(CodecError, match="takes? at most 2"):
        rice.decode(low, torch.full((1 << 20,), 0xFF, dtype=torch.uint8), 4, 1, 5, "t")
    assert rice.decode(low, torch.tensor([0b10101100], dtype=torch.uint8), 4, 1, 5, "t").tolist() == [0, 1, 5, 2]


def test_tahquant_has_less_error_than_the_papers_at_its_bits():
    """Gaussian activations with an outlier channel, and heavy-tailed ones (Student t, 4 degrees):
    the Rice-coded grid at qmax 11 sends at most 4.6 bits per element and its error is at least a
    fifth lower than the paper's algorithm's (tahquant-paper)."""
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(4, 64, 256, generator=gen)
    gauss[..., 7] *= 20
    heavy = torch.distributions.StudentT(4.0).sample((4, 64, 256))
    for x in (gauss, heavy):
        measured = {}
        for name, params in (("tahquant-paper", {}), ("tahquant", {"group_size": 128, "qmax": 11})):
            msg = codecs.get_codec(name, **params).encode(x)
            err = float((codecs.decode(msg) - x).norm() / x.norm())
            measured[name] = (codecs.bits_per_element(msg), err)
        bits3, err3 = measured["tahquant"]
        assert bits3 <= 4.6
        assert all(err3 < 0.8 * err for (bits, err) in measured.values() if bits != bits3), measured


def test_the_two_tahquant_codecs_carry_their_own_parameters_only():
    """tahquant's messages are version 3 with group_size and qmax; tahquant-paper's are tahquant
    version 1 with the paper's parameters, as before the two had names (older builds still read them)."""
    msg = codecs.get_codec("tahquant", group_size=128, qmax=11).encode(torch.randn(2, 3, 128))
    assert (msg.codec, msg.version) == ("tahquant", 3) and dict(msg.params) == {"group_size": 128.0, "qmax": 11.0}
    back = codecs.get_codec("tahquant").from_header(dict(msg.params))
    assert back.params == RiceParams(group_size=128, qmax=11)
    old = codecs.get_codec("tahquant-paper").encode(torch.randn(2, 3, 64))
    assert (old.codec, old.version) == ("tahquant", 1)
    assert set(old.params) == {"group_size", "rho", "tau", "bits_high", "bits_low", "alloc"}
    for forge in ({"rho": 0.8}, {"qmax": None}):
        forged = type(msg)()
        forged.CopyFrom(msg)
        for key, value in forge.items():
            if value is None:
                del forged.params[key]
            else:
                forged.params[key] = value
        forged.crc32 = codecs.checksum(forged)
        with pytest.raises(CodecError, match="unknown parameters: rho|lacks parameter 'qmax'"):
            codecs.decode(forged)


def test_tahquant_schedule_runs_on_a_finer_grid():
    """The precision schedule's high phase (Codec.schedule_params) of tahquant is qmax 31, as fine as
    6 bits; tahquant-paper's is every token at 6 bits."""
    high = codecs.CODECS["tahquant"].schedule_params
    codec = codecs.get_codec("tahquant", group_size=128, **high)
    assert codec.params.qmax == 31 and codec.header_params() == {"group_size": 128.0, "qmax": 31.0}
    assert codecs.CODECS["tahquant-paper"].schedule_params == {"bits_high": 6, "bits_low": 6}


def test_tahquant_zero_tokens_and_tiny_values():
    x = torch.randn(3, 8, 200)
    x[1] = 0
    x[2] *= 1e-30
    y = codecs.decode(codecs.get_codec("tahquant").encode(x))
    assert torch.equal(y[1], torch.zeros(8, 200))
    assert float((y[2].double() - x[2].double()).norm() / x[2].double().norm()) < 0.08


CASES = [((3, 20), torch.bfloat16, 8, 12), ((2, 5, 40), torch.float32, 32, 7), ((4, 7, 128), torch.float16, 128, 12),
         ((1, 3, 264), torch.bfloat16, 128, 31), ((2, 64, 768), torch.bfloat16, 128, 127),
         ((2, 9, 24), torch.float32, 16, 1),
         ((3, 5, 96), torch.bfloat16, 128, 12), ((2, 3, 100), torch.float32, 128, 31),
         ((1, 4, 1600), torch.bfloat16, 128, 12)]


@pytest.mark.parametrize("shape,dtype,g,qmax", CASES, ids=[f"{c[0]}-{c[1]}-G{c[2]}-q{c[3]}" for c in CASES])
def test_kernels_give_the_references_bytes_and_values(kernels, shape, dtype, g, qmax):
    x = kernel_test_input(shape, dtype)
    p = RiceParams(group_size=g, qmax=qmax)
    assert_kernel_gives_the_reference(tahquant_rice_triton, tahquant_rice_ref, x, p, DEVICE)


SUMS_CASES = [(128, 12), (32, 7), (16, 1), (8, 12), (256, 12), (128, 31), (64, 127)]


@pytest.mark.parametrize("g,qmax", SUMS_CASES, ids=[f"G{g}-q{q}" for g, q in SUMS_CASES])
def test_the_quantizing_kernel_sums_the_codes_as_the_rice_coder_needs(kernels, monkeypatch, g, qmax):
    """Layout 3's quantizing kernel adds the Rice coder's block sums as it makes the codes (by bit
    counts where z < 32 and G <= 128, by shifts elsewhere): the sum of z >> k over each block's codes,
    k = 0..the bit length of 2 qmax, and 0 beyond; blocks of 256 codes here, several tiles each, and
    a token whose tiles rotate to qmax everywhere (each bit of 2 qmax set in all G codes)."""
    monkeypatch.setattr(rice_triton, "_blocks", lambda: ((256, 4), (256, 4)))
    x = kernel_test_input((5, 33, 3 * g), torch.float32).reshape(-1, 3 * g)
    n, t = x.shape[0], 3
    x[1] = symtiles_ref.unrotate(torch.full((1, t * g), float(qmax)), g, t * g)  # codes all 2 qmax: every count G
    sums = rice_triton.sums_buffer(n * t * g, DEVICE)
    out, width, status = symtiles_triton.launch_encode(x.to(DEVICE), g, 8, True, qmax, sums)
    assert width == t * g and int(status) == 0
    z = tahquant_rice_ref.zigzag(out[2 * n * t:].cpu(), qmax)
    z = torch.nn.functional.pad(z, (0, -(n * width) % 256)).reshape(-1, 256)
    kmax = (2 * qmax).bit_length()
    want = torch.zeros(z.shape[0], 9, dtype=torch.int32)
    for k in range(kmax + 1):
        want[:, k] = (z >> k).sum(1).int()
    assert int(z.max()) >= 2 ** (kmax - 1) and torch.equal(sums[0].cpu(), want)  # (the top bit in use)
    assert torch.equal(sums[0], rice_triton.block_sums(out[2 * n * t:], qmax)[0])  # the Rice coder's own kernel


def test_corrupt_payloads_are_refused_alike(kernels):
    shape, p = (2, 5, 40), RiceParams(group_size=32)
    payload = tahquant_rice_ref.encode(torch.randn(shape), p)
    bad_scale = payload.clone()
    bad_scale[3:5] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)  # scale 1: a bf16 NaN
    bad_k = payload.clone()
    bad_k[0] = 9
    cases = [(bad_scale, "scale"), (bad_k, "Rice parameter 9"), (payload[:-1], "unary stream"),
             (torch.cat([payload, torch.zeros(1, dtype=torch.uint8)]), "unary stream"), (payload[:30], "at least")]
    for bad, match in cases:
        with pytest.raises(CodecError, match=match) as want:
            tahquant_rice_ref.decode(bad, shape, p, torch.float32)
        with pytest.raises(CodecError) as got:
            tahquant_rice_triton.decode(bad.to(DEVICE), shape, p, torch.float32)
        assert str(got.value) == str(want.value)
        with pytest.raises(CodecError) as got:
            tahquant_rice_cpu.decode(bad, shape, p, torch.float32)
        assert str(got.value) == str(want.value)


def _codes(kind: str, n: int, qmax: int, gen: torch.Generator) -> torch.Tensor:
    """Codes q + qmax (uint8) of a few shapes of distribution: Laplace-like small ones, uniform ones,
    and mostly zeros with a few at the grid's ends (k = 0: runs of 2 qmax one-bits across words and blocks)."""
    if kind == "laplace":
        q = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) * 4).round().clamp(-qmax, qmax)
    elif kind == "uniform":
        q = torch.randint(-qmax, qmax + 1, (n,), generator=gen).float()
    else:
        q = torch.zeros(n)
        q[torch.randint(0, n, (n // 50,), generator=gen)] = torch.tensor(float(qmax))
        q[torch.randint(0, n, (n // 50,), generator=gen)] = torch.tensor(float(-qmax))
    return (q + qmax).to(torch.uint8)


@pytest.mark.parametrize("blocks", ["gpu", "interpreter"])
@pytest.mark.parametrize("kind,n,qmax", [("laplace", 20_000, 12), ("uniform", 9_000, 127), ("ends", 24_000, 127),
                                         ("laplace", 140_000, 31), ("ends", 8, 1)])
def test_rice_kernels_give_the_references_bytes(kernels, monkeypatch, blocks, kind, n, qmax):
    """rice_triton's payload (k, head, low bits, unary stream) is the reference's byte for byte, and its
    decode gives the codes back, at the GPU's block sizes (many programs, values and runs across
    their edges) and the interpreter's."""
    if blocks == "gpu":  # small programs, about 0.1 s each in the interpreter: 12,000 values make 12 or more
        monkeypatch.setattr(rice_triton, "interpreting", lambda: False)
        n = min(n, 12_000)
    codes = _codes(kind, n, qmax, torch.Generator().manual_seed(n + qmax))
    z = tahquant_rice_ref.zigzag(codes, qmax)
    k = rice.best_k(z, 2 * qmax)
    low, unary = rice.encode(z, k)
    head = torch.arange(6, dtype=torch.uint8)
    want = torch.cat([torch.tensor([k], dtype=torch.uint8), head, low, unary])
    assert torch.equal(rice_triton.encode(codes.to(DEVICE), qmax, head.to(DEVICE)).cpu(), want)
    assert torch.equal(rice_triton.decode(low.to(DEVICE), unary.to(DEVICE), n, k, qmax, "t").cpu(), codes)


def test_the_block_sums_running_totals_are_a_scan_down_each_column():
    """ends_of scans the (blocks, 9) sums as one 1-D scan (CUB's on a GPU, not a thread per column): the same
    totals as the plain scan down the rows, in int64, past int32's range, for one block or many."""
    g = torch.Generator().manual_seed(0)
    for blocks, high in ((1, 1000), (5, 2**31 - 1), (8192, 5000)):
        sums = torch.randint(0, high, (blocks, 9), dtype=torch.int32, generator=g)
        ends = rice_triton.ends_of(sums)
        assert ends.dtype == torch.int64 and ends.is_contiguous()
        assert torch.equal(ends, torch.cumsum(sums.long(), 0))


def test_rice_kernels_write_the_same_bytes_whatever_k_they_guessed(kernels, monkeypatch):
    """The write kernel runs before k is read on the host, compiled for a guess (the last payload's k
    at that size) and storing nothing unless the device picked that k; a wrong guess costs a second
    launch, at the k picked: one launch when right, two when wrong, the reference's bytes either way."""
    n, qmax = 20_000, 12
    codes = _codes("laplace", n, qmax, torch.Generator().manual_seed(5))
    z = tahquant_rice_ref.zigzag(codes, qmax)
    k = rice.best_k(z, 2 * qmax)
    head = torch.arange(4, dtype=torch.uint8)
    want = torch.cat([torch.tensor([k], dtype=torch.uint8), head, *rice.encode(z, k)])
    launches = []
    real = rice_triton._launch_write_kernel
    monkeypatch.setattr(rice_triton, "_launch_write_kernel", lambda write, at: launches.append(at) or real(write, at))
    for guess in range((2 * qmax).bit_length() + 1):
        launches.clear()
        monkeypatch.setitem(rice_triton._LAST_K, (qmax, n), guess)
        assert torch.equal(rice_triton.encode(codes.to(DEVICE), qmax, head.to(DEVICE)).cpu(), want), guess
        assert launches == ([k] if guess == k else [guess, k])
        assert rice_triton._LAST_K[(qmax, n)] == k  # the next payload's guess
    monkeypatch.setattr(rice_triton, "_launch_write_kernel", real)
    write = rice_triton.launch_write(codes.to(DEVICE), qmax, head.to(DEVICE),
                                     *rice_triton.block_sums(codes.to(DEVICE), qmax))
    write.payload[1:] = 0xAB
    rice_triton._launch_write_kernel(write, (k + 1) % 6)  # compiled for a k not picked: it stores nothing
    assert bool((write.payload[1:] == 0xAB).all()) and int(write.payload[0]) == k


def test_rice_kernels_refuse_codes_above_the_grid_without_writing_past_the_buffer(kernels):
    """The buffer has room for codes up to 2 qmax; larger ones would need more: refused, and no write
    kernel stores (the one-program kernel marks k 255, which none is compiled for)."""
    codes = torch.full((64,), 200, dtype=torch.uint8, device=DEVICE)  # qmax 3: codes at most 6
    sums, ends = rice_triton.block_sums(codes, 3)
    write = rice_triton.launch_write(codes, 3, torch.zeros(2, dtype=torch.uint8, device=DEVICE), sums, ends)
    size, k = write.picked.tolist()
    assert size > write.payload.numel() and int(write.payload[0]) == 255
    with pytest.raises(ValueError, match="above"):
        write.finish(size, k)


def _streams():
    """(low, unary, k, qmax) of 8 values: well-formed ones, streams encode never writes, and random
    one-bit flips of well-formed ones."""
    gen = torch.Generator().manual_seed(3)
    z = torch.tensor([0, 1, 5, 2, 0, 0, 3, 1])
    low1, unary1 = rice.encode(z, 1)
    cases = [(low1, unary1, 1, 3), (low1, unary1[:-1], 1, 3), (low1, torch.cat([unary1, unary1[-1:]]), 1, 3),
             (low1, torch.tensor([0xFF, 0xFF], dtype=torch.uint8), 1, 3),  # no zero-bit at all
             (low1, torch.tensor([0x00, 0xFF], dtype=torch.uint8), 1, 3),  # 8 zero-bits, then a spare byte
             (low1, torch.zeros(0, dtype=torch.uint8), 1, 3),
             (low1[:0], torch.tensor([0x00], dtype=torch.uint8), 0, 1),  # eight zeros: all values 0
             (low1, torch.tensor([0b11111110, 0, 0xFF, 0b11111000], dtype=torch.uint8), 1, 3)]  # a run too long
    long_run = torch.zeros(8, dtype=torch.int64)
    long_run[3] = 254
    cases.append((torch.zeros(0, dtype=torch.uint8), rice.encode(long_run, 0)[1], 0, 127))  # a run over 7 words
    long_run[3] = 255
    cases.append((torch.zeros(0, dtype=torch.uint8), rice.encode(long_run, 0)[1], 0, 127))  # one bit too many
    for _ in range(24):
        unary = unary1.clone()
        flip = int(torch.randint(0, 8 * unary.numel(), (1,), generator=gen))
        unary[flip // 8] ^= 1 << (flip % 8)
        cases.append((low1, unary, 1, 3))
    return cases


def _refuse_what_the_reference_refuses(decode, device: str) -> None:
    """On every stream: the same codes as the reference, or its error with its message."""
    for low, unary, k, qmax in _streams():
        try:
            want = tahquant_rice_ref.unzigzag(rice.decode(low, unary, 8, k, 2 * qmax, "t"), qmax)
        except CodecError as err:
            with pytest.raises(CodecError) as got:
                decode(low.to(device), unary.to(device), 8, k, qmax, "t")
            assert str(got.value) == str(err), (unary.tolist(), k, qmax)
        else:
            assert torch.equal(decode(low.to(device), unary.to(device), 8, k, qmax, "t").cpu(), want)


def test_rice_kernels_refuse_what_the_reference_refuses(kernels):
    _refuse_what_the_reference_refuses(rice_triton.decode, DEVICE)


def test_the_cpu_path_refuses_what_the_reference_refuses():
    _refuse_what_the_reference_refuses(rice_cpu.decode, "cpu")


@pytest.mark.parametrize("kind,n,qmax", [("laplace", 20_000, 12), ("uniform", 9_000, 127), ("ends", 24_000, 127),
                                         ("ends", 8, 1), ("laplace", 0, 12)])
def test_the_cpu_path_gives_the_references_bytes(kind, n, qmax):
    codes = _codes(kind, n, qmax, torch.Generator().manual_seed(n + qmax))
    z = tahquant_rice_ref.zigzag(codes, qmax)
    k = rice.best_k(z, 2 * qmax)
    low, unary = rice.encode(z, k)
    head = torch.arange(6, dtype=torch.uint8)
    assert torch.equal(rice_cpu.encode(codes, qmax, head),
                       torch.cat([torch.tensor([k], dtype=torch.uint8), head, low, unary]))
    assert torch.equal(rice_cpu.decode(low, unary, n, k, qmax, "t"), codes)


@pytest.mark.parametrize("shape,dtype,g,qmax", CASES, ids=[f"{c[0]}-{c[1]}-G{c[2]}-q{c[3]}" for c in CASES])
def test_the_cpu_path_gives_the_references_bytes_and_values(shape, dtype, g, qmax):
    x = kernel_test_input(shape, dtype)
    assert_kernel_gives_the_reference(tahquant_rice_cpu, tahquant_rice_ref, x,
                                      RiceParams(group_size=g, qmax=qmax), "cpu")


def test_the_registry_serves_cpu_tensors_with_the_cpu_path(monkeypatch):
    monkeypatch.delenv("TAHNODE_FORCE_TRITON", raising=False)
    monkeypatch.delenv("TAHNODE_REFERENCE", raising=False)
    assert dispatch.TAHQUANT.serving(torch.zeros(1)) is tahquant_rice_cpu
    monkeypatch.setenv("TAHNODE_REFERENCE", "1")
    assert dispatch.TAHQUANT.serving(torch.zeros(1)) is tahquant_rice_ref


WIDTHS = (64, 96, 192, 576, 768, 1600, 2048, 4096)


def test_tahquant_sends_no_padded_tiles_at_any_width():
    """Issue 43: a width that is not a multiple of the tile was padded to whole tiles of 128 and the
    padding sent (64 channels: 9.1 bits per element); then cut into smaller tiles of each token
    (4.7 at 64, 4.8 at 96: a bf16 scale per 64 or 32 values). Now the channels past a token's whole
    tiles are one stream over the tokens, in tiles of 128 (tahquant_rice_ref.blocks): fewer than
    MIN_TILE padded values in the whole tensor, the error per element no worse than at 768, and at
    most 4.6 bits per element (the whole message) at every width."""
    codec = codecs.get_codec("tahquant", group_size=128, qmax=12)
    bits, errors = {}, {}
    for c in WIDTHS:
        # as many tiles at every width
        x = torch.randn(8 * 128 * 768 // c, c, generator=torch.Generator().manual_seed(c))
        _, _, _, codes = tahquant_rice_ref.shape_of(x.shape, codec.params)
        assert codes - x.numel() < tahquant_rice_ref.MIN_TILE
        msg = codec.encode(x)
        bits[c] = codecs.bits_per_element(msg)
        errors[c] = float(((codecs.decode(msg) - x) ** 2).mean() / (x ** 2).mean())
    assert all(errors[c] <= errors[768] * 1.01 for c in WIDTHS), errors
    assert all(bits[c] <= 4.6 for c in WIDTHS), bits


def test_blocks_put_every_channel_back_and_an_unmarked_message_of_such_a_width_is_refused():
    """The blocks of odd widths and token counts (a stream whose tail is cut in smaller tiles) give
    every value back in its place; a tahquant message of a width that is not a multiple of G says
    `blocks` = 1 (one of whole tiles says nothing, as before), and one without it, as an older build
    sent, is refused instead of misread."""
    from tahnode.proto import tahnode_pb2 as pb

    params = RiceParams(group_size=128, qmax=127)
    for n, c in ((1, 64), (3, 96), (5, 100), (7, 200), (2, 7), (4, 256)):
        x = torch.randn(n, c, generator=torch.Generator().manual_seed(c))
        parts = [values for _, values in tahquant_rice_ref.gather(x, 128)]
        assert torch.equal(tahquant_rice_ref.assemble(parts, n, c, 128), x)  # every value once, in its place
        y = tahquant_rice_ref.decode(tahquant_rice_ref.encode(x, params), x.shape, params, torch.float32)
        assert float((y - x).abs().max()) < 0.03 * float(x.abs().max()), (n, c)
    codec = codecs.get_codec("tahquant", group_size=128, qmax=12)
    assert "blocks" not in codec.encode(torch.randn(2, 256)).params
    msg = codec.encode(torch.randn(2, 96))
    assert msg.params["blocks"] == 1.0
    old = pb.EncodedTensor()
    old.CopyFrom(msg)
    del old.params["blocks"]
    old.crc32 = codecs.checksum(old)
    with pytest.raises(codecs.CodecError, match="blocks"):
        codecs.decode(old)

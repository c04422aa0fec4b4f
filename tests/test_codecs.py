"""Each codec round-trips within its theoretical error bound; TAH-Quant meets its size, SQNR and
outlier-rule figures; the stateful codecs keep both ends in step."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from tahnode import codecs
from tahnode.codecs import CodecContext, CodecError
from tahnode.proto import tahnode_pb2 as pb
from tahnode.tools.codec_eval import sqnr_db
from helpers import bits_lsb_first, outlier_activations

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def roundtrip(name, x, ctx_enc=None, ctx_dec=None, **params):
    msg = codecs.get_codec(name, **params).encode(x, ctx_enc)
    wire = codecs.serialize(msg)
    return codecs.decode(codecs.parse_message(wire), ctx_dec), msg


def f16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.float16).astype(np.float64)


def asym_bound(values: np.ndarray, zero: np.ndarray, scale: np.ndarray, qmax) -> np.ndarray:
    """Largest error a nearest-level quantizer on the grid zero + k*scale, k = 0..qmax, can make
    for each value (values (NT, G); zero, scale, qmax per tile)."""
    top = zero + np.asarray(qmax) * scale
    inside = scale[:, None] / 2
    below = zero[:, None] - values
    above = values - top[:, None]
    return np.maximum(inside, np.maximum(below, above)) + 1e-6 * (np.abs(values) + scale[:, None] + 1e-30)


def sylvester_np(g: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < g:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_none_is_exact(dtype):
    x = torch.randn(3, 5, 70).to(dtype)
    y, msg = roundtrip("none", x)
    assert y.dtype == dtype and torch.equal(y, x)
    assert len(msg.payload) == x.numel() * x.element_size()


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_naive_within_half_a_step_per_channel(bits):
    x = torch.randn(2, 33, 100) * torch.logspace(-6, 1, 100)  # channels spanning 7 decades
    y, msg = roundtrip("naive", x, bits=bits)
    payload = msg.payload
    scale = f16(payload[:200]) * 2.0 ** msg.params["exp"]
    qmax = 2 ** (bits - 1) - 1
    xs = x.reshape(-1, 100).double().numpy()
    err = np.abs(xs - y.reshape(-1, 100).double().numpy())
    overshoot = np.maximum(np.abs(xs) - qmax * scale, 0.0)
    assert np.all(err <= np.maximum(scale / 2, overshoot) + 1e-6 * np.abs(xs) + 1e-30)
    # the shared exponent keeps tiny channels resolved: relative error of the smallest channel
    small = np.abs(xs[:, 0]).max()
    assert err[:, 0].max() <= small / qmax
    assert len(payload) == 200 + math.ceil(x.numel() / 8) * bits


@pytest.mark.parametrize("bits,g", [(4, 64), (2, 32), (8, 128)])
def test_group_within_half_a_step_per_tile(bits, g):
    x = outlier_activations((3, 17, 200), seed=1)  # 200 is not a multiple of g: padded
    y, msg = roundtrip("group", x, bits=bits, group_size=g)
    t = math.ceil(200 / g)
    nt = 3 * 17 * t
    zero, scale = f16(msg.payload[: 2 * nt]), f16(msg.payload[2 * nt : 4 * nt])
    pad = t * g - 200
    xp = np.pad(x.reshape(-1, 200).double().numpy(), ((0, 0), (0, pad))).reshape(nt, g)
    yp = np.pad(y.reshape(-1, 200).double().numpy(), ((0, 0), (0, pad))).reshape(nt, g)
    bound = asym_bound(xp, zero, scale, 2**bits - 1)
    real = (np.arange(t * g) < 200)[None, :].repeat(3 * 17, 0).reshape(nt, g)  # padding is dropped
    assert np.all((np.abs(xp - yp) <= bound)[real])
    assert np.abs(xp - yp)[real].max() > 0


def parse_tahquant(msg, tokens, t, g):
    """Independent reading of the version-1 sections: (low, flags, zero, scale, offset of pivots)."""
    p = msg.payload
    assert msg.params["alloc"] == 0  # one bit width per token
    nt = tokens * t
    off = 0
    low = bits_lsb_first(p[off : off + math.ceil(tokens / 8)], tokens)
    off += math.ceil(tokens / 8)
    flags = bits_lsb_first(p[off : off + math.ceil(nt / 8)], nt)
    off += math.ceil(nt / 8)
    zero = f16(p[off : off + 2 * nt])
    off += 2 * nt
    scale = f16(p[off : off + 2 * nt])
    off += 2 * nt
    return low, flags, zero, scale, off


def tau_rule(tiles: np.ndarray, tau: float) -> tuple[np.ndarray, np.ndarray]:
    mag = np.abs(tiles.astype(np.float32))
    pivot = mag.argmax(-1)
    srt = np.sort(mag, axis=-1)
    flag = (srt[:, -1] > 0) & (srt[:, -1] >= np.float32(tau) * srt[:, -2])
    return flag, pivot


@pytest.mark.parametrize("channels", [256, 200])
def test_tahquant_paper_within_bound_per_tile(channels):
    x = outlier_activations((2, 24, channels), frac=0.03, scale=30.0, seed=2)
    y, msg = roundtrip("tahquant-paper", x)
    g, t = 64, math.ceil(channels / 64)
    tokens = 48
    low, flags, zero, scale, _ = parse_tahquant(msg, tokens, t, g)
    low_tiles = np.repeat(low, t)
    qmax = np.where(low_tiles, 7, 15)
    pad = t * g - channels
    xt = np.pad(x.reshape(tokens, channels).double().numpy(), ((0, 0), (0, pad))).reshape(-1, g)
    yt = np.pad(y.reshape(tokens, channels).double().numpy(), ((0, 0), (0, pad))).reshape(-1, g)
    flag_ref, pivot = tau_rule(xt, 2.0)
    assert np.array_equal(flags, flag_ref)
    # transformed values the quantizer saw: swapped and Hadamard-rotated on flagged tiles
    h = sylvester_np(g) / math.sqrt(g)
    ys = xt.copy()
    rows = np.nonzero(flags)[0]
    ys[rows, 0], ys[rows, pivot[rows]] = xt[rows, pivot[rows]], xt[rows, 0]
    ys[rows] = ys[rows] @ h
    ys = ys.astype(np.float32).astype(np.float64)
    bound = asym_bound(ys, zero, scale, qmax)
    err = np.abs(xt - yt)
    if pad:  # padded channels are dropped by decode; compare the real ones only
        keep = np.ones((tokens, t * g), bool)
        keep[:, channels:] = False
        keep = keep.reshape(-1, g)
    else:
        keep = np.ones_like(err, bool)
    plain = ~flags
    assert np.all((err <= bound)[plain] | ~keep[plain])
    l2_err = np.sqrt((np.where(keep, err, 0.0) ** 2).sum(-1))
    l2_bound = np.sqrt((bound**2).sum(-1)) * (1 + 1e-5)
    assert np.all(l2_err[flags] <= l2_bound[flags])
    assert flags.sum() > 0 and (~flags).sum() > 0


def test_tahquant_paper_headline_figures():
    """Defaults on (4, 512, 4096) Gaussian with 1% outlier channels: <= 4.40 bits/element with every
    header byte, SQNR within 0.5 dB of group-4bit or better while smaller."""
    x = outlier_activations((4, 512, 4096), frac=0.01, scale=20.0, seed=3)
    y, msg = roundtrip("tahquant-paper", x)
    g4, gmsg = roundtrip("group", x, bits=4)
    bpe, bpe_group = codecs.bits_per_element(msg), codecs.bits_per_element(gmsg)
    assert bpe <= 4.40
    assert bpe < bpe_group
    assert sqnr_db(x, y) >= sqnr_db(x, g4) - 0.5
    # 20% of the tokens of each sequence at INT3
    low, flags, *_ = parse_tahquant(msg, 2048, 64, 64)
    assert low.reshape(4, 512).sum(1).tolist() == [512 - round(0.8 * 512)] * 4
    flag_ref, _ = tau_rule(x.reshape(-1, 64).numpy(), 2.0)
    assert np.array_equal(flags, flag_ref)


def test_tahquant_paper_low_bits_go_to_lowest_entropy_tokens():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, 128, generator=gen)
    x[:, ::3, 5] *= 50  # peaky tokens: low entropy
    y, msg = roundtrip("tahquant-paper", x, rho=0.75)
    low, *_ = parse_tahquant(msg, 120, 2, 64)
    a = np.abs(x.double().numpy())
    p = a / a.sum(-1, keepdims=True)
    ent = -(p * np.log(p)).sum(-1)
    for s in range(3):
        chosen = np.nonzero(low.reshape(3, 40)[s])[0]
        assert len(chosen) == 10
        assert set(chosen) == set(np.argsort(ent[s], kind="stable")[:10])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tahquant_paper_restores_pivots_and_token_order_exactly(dtype):
    """One spike per tile at a random position: every tile is flagged, the rotated tile is constant
    (scale 0, zero exact in fp16), so decode must put every spike back in its token and position."""
    gen = torch.Generator().manual_seed(5)
    tokens, channels = 50, 256
    x = torch.zeros(tokens, channels)
    pos = torch.randint(0, 64, (tokens, 4), generator=gen)
    vals = (torch.randint(1, 64, (tokens, 4), generator=gen).float() * 8
            * torch.where(torch.rand(tokens, 4, generator=gen) < 0.5, -1, 1))
    for k in range(4):
        x[torch.arange(tokens), 64 * k + pos[:, k]] = vals[:, k]
    x = x.to(dtype)
    y, msg = roundtrip("tahquant-paper", x)
    _, flags, *_ = parse_tahquant(msg, tokens, 4, 64)
    assert flags.all()
    assert torch.equal(y, x)


@pytest.mark.parametrize("name", ["none", "naive", "group", "tahquant", "tahquant-paper", "amaq"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_codec_keeps_shape_and_dtype(name, dtype):
    x = outlier_activations((2, 9, 96), seed=6).to(dtype)
    y, _ = roundtrip(name, x)
    assert y.shape == x.shape and y.dtype == dtype
    if name != "amaq":  # amaq starts at 8 bits; all are well above 10 dB here
        assert sqnr_db(x.float(), y.float()) > 10


def test_aqsgd_first_visit_exact_then_delta_and_caches_in_step():
    codec = codecs.get_codec("aqsgd")
    enc, dec = CodecContext(sample_ids=[7, 3]), CodecContext(sample_ids=[7, 3])
    x0 = torch.randn(2, 16, 128)
    m0 = codec.encode(x0, enc)
    y0 = codecs.decode(codecs.parse_message(codecs.serialize(m0)), dec)
    assert torch.equal(y0, x0)
    assert enc.aqsgd_cache.nbytes == dec.aqsgd_cache.nbytes == 2 * 16 * 128 * 4
    x1 = x0 + 0.05 * torch.randn_like(x0)
    m1 = codec.encode(x1, enc)
    y1 = codecs.decode(codecs.parse_message(codecs.serialize(m1)), dec)
    assert 8 * len(m1.payload) / x1.numel() < 4.51  # 4 bits + fp16 zero and scale per 64 + the bitmap
    d = x1 - x0  # half a 4-bit step of a tile's delta range, plus fp16 rounding of zero/scale
    assert (y1 - x1).abs().max() <= (d.max() - d.min()) / 30 * 1.05 + 1e-4
    for k in (7, 3):
        assert torch.equal(enc.aqsgd_cache.rows[k], dec.aqsgd_cache.rows[k])
    assert torch.equal(dec.aqsgd_cache.rows[7], y1[0])
    # a mixed micro-batch: sample 9 is new (sent in full), 3 is cached
    enc.sample_ids = dec.sample_ids = [9, 3]
    x2 = torch.randn(2, 16, 128)
    y2 = codecs.decode(codec.encode(x2, enc), dec)
    assert torch.equal(y2[0], x2[0])
    assert len(enc.aqsgd_cache) == len(dec.aqsgd_cache) == 3
    # the receiver never saw sample 11's first visit
    stranger = CodecContext(sample_ids=[3, 9])
    with pytest.raises(CodecError, match="no cache entry"):
        codecs.decode(codec.encode(x2, CodecContext(sample_ids=[3, 9], aqsgd_cache=enc.aqsgd_cache)), stranger)


def test_amaq_schedule_regularizer_and_fake_quant():
    from tahnode.kernels.amaq_ref import AmaqParams, AmaqState, fake_quant

    state = AmaqState(96, AmaqParams(anneal_steps=100))
    assert state.bits().tolist() == [8] * 96
    state.step = 100
    assert state.bits().tolist() == [4] * 96
    assert math.isclose(float(state.regularization().detach()), 0.01 * 0.25, rel_tol=1e-6)
    codec = codecs.get_codec("amaq", anneal_steps=100)
    ctx = CodecContext(amaq_state=state)
    x = outlier_activations((2, 30, 96), seed=7).requires_grad_(True)
    with torch.no_grad():
        state.gate[:48] = 3.0  # half the channels learned more bits
    y = codecs.decode(codec.encode(x, ctx))
    fq = fake_quant(x, state)
    assert torch.equal(fq.detach(), y)
    assert sorted(set(state.bits().tolist())) == [4, 6]
    (fq * torch.randn_like(fq)).sum().backward()
    assert state.gate.grad is not None and state.gate.grad.abs().sum() > 0
    assert x.grad is not None
    reg = state.regularization()
    state.gate.grad = None
    reg.backward()
    assert (state.gate.grad[:48] > 0).all()  # the regularizer pushes bits down


def test_amaq_within_bound_per_channel():
    x = outlier_activations((3, 20, 64), seed=8)
    from tahnode.kernels.amaq_ref import AmaqParams, AmaqState

    state = AmaqState(64, AmaqParams(anneal_steps=0))
    with torch.no_grad():
        state.gate.copy_(torch.linspace(-6, 6, 64))
    y, msg = roundtrip("amaq", x, ctx_enc=CodecContext(amaq_state=state))
    bits = np.frombuffer(msg.payload[:64], np.uint8)
    assert bits.min() == 2 and bits.max() == 6
    zero, scale = f16(msg.payload[64:192]), f16(msg.payload[192:320])
    xc = x.reshape(-1, 64).double().numpy().T
    bound = asym_bound(xc, zero, scale, 2.0 ** bits - 1)
    assert np.all(np.abs(xc - y.reshape(-1, 64).double().numpy().T) <= bound)


def test_same_input_same_bytes_across_runs():
    script = (
        "import hashlib, torch; from tahnode import codecs;"
        "g = torch.Generator().manual_seed(11); x = torch.randn(2, 33, 300, generator=g); x[..., 7] *= 40;"
        "print(hashlib.sha256(b''.join(codecs.serialize(codecs.get_codec(n).encode(x)) for n in "
        "['none','naive','group','tahquant','tahquant-paper','amaq'])).hexdigest())"
    )
    here = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 33, 300, generator=g)
    x[..., 7] *= 40
    names = ["none", "naive", "group", "tahquant", "tahquant-paper", "amaq"]
    local = hashlib.sha256(b"".join(codecs.serialize(codecs.get_codec(n).encode(x)) for n in names)).hexdigest()
    assert here == again == local


@pytest.mark.parametrize("name", ["none", "naive", "group", "tahquant", "tahquant-paper", "amaq", "pertoken"])
def test_an_overlapped_encode_finishes_as_the_message_an_inline_one_writes(name):
    """train.host_copy "overlap" (issue 27): encode_apart(overlap=True) leaves the payload's copy and
    its checksum to finish(), on another thread as a link does; the message and the payload's bytes
    are then an inline encode's, and the wire size the stage counts before finishing
    (PendingPayload.wire_bytes) is the finished message's."""
    import threading

    x = outlier_activations((2, 9, 256), seed=8).to(torch.bfloat16)
    codec = codecs.get_codec(name)
    want = pb.EncodedTensor()
    want_payload = bytes(codec.encode_apart(x, want).finish())
    got = pb.EncodedTensor()
    pending = codec.encode_apart(x, got, overlap=True)
    assert got.crc32 == 0 and pending.nbytes == len(want_payload)  # nothing checksummed yet
    size = pending.wire_bytes  # what the stage counts before the checksum is written
    finished = []
    thread = threading.Thread(target=lambda: finished.append(bytes(pending.finish())))
    thread.start()
    thread.join()
    assert finished == [want_payload] and got == want
    got.payload = want_payload
    assert size == got.ByteSize() or want.crc32 == 0  # a zero checksum is left out of the wire
    assert torch.equal(codecs.decode(got), codecs.decode(codecs.get_codec(name).encode(x)))

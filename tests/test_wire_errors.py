"""Bad input and damaged messages: every codec answers with a CodecError (a ValueError) that
names the problem, and never crashes, hangs or allocates by a forged header (hypothesis fuzzing)."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, strategies as st

from tahnode import codecs
from tahnode.codecs import CodecContext, CodecError

STATELESS = ["none", "naive", "pertoken", "group", "tahquant-paper", "tahquant", "amaq"]
ALL = STATELESS + ["aqsgd"]


def codec_of(spec: str) -> codecs.Codec:
    """A codec from NAME[:k=v,...]."""
    name, _, params = spec.partition(":")
    return codecs.get_codec(name, **codecs.parse_param_args(name, [p for p in params.split(",") if p]))


def ctx():
    return CodecContext(sample_ids=[0, 1])


def sample(name, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 80, generator=gen)
    x[..., 3] *= 30
    return x.to(dtype)


def encoded(name):
    return codec_of(name).encode(sample(name), ctx())


def with_payload(msg, payload: bytes, fix_crc=True):
    out = type(msg)()
    out.CopyFrom(msg)
    out.payload = payload
    if fix_crc:
        out.crc32 = codecs.checksum(out)
    return out


def test_codec_error_is_a_value_error():
    assert issubclass(CodecError, ValueError)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad,match",
                         [(float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"), (-float("inf"), "NaN/Inf")])
def test_non_finite_input_is_refused(name, bad, match):
    x = sample(name)
    x[1, 2, 3] = bad
    with pytest.raises(CodecError, match=match):
        codec_of(name).encode(x, ctx())


@given(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), st.integers(1, 5000), st.data())
def test_the_finite_check_finds_every_bad_value_and_counts_them(dtype, n, data):
    """One reduction (the smallest and largest value) finds a NaN or infinity anywhere: at the ends
    of vectorized blocks, in a strided view; the message counts them all."""
    from tahnode.kernels.quant_ref import check_finite

    x = torch.randn(2 * n, dtype=torch.float32).to(dtype)[::2]
    check_finite(x, "c")  # finite: no error
    where = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True))
    for i in where:
        x[i] = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    with pytest.raises(CodecError, match=f"c: input has {len(where)} NaN/Inf values"):
        check_finite(x, "c")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize(
    "x,match",
    [
        (torch.empty(0, 64), "empty"),
        (torch.empty(2, 0, 8), "empty"),
        (torch.tensor(1.0), "0-d"),
        (torch.ones(2, 4, 64, dtype=torch.int32), "dtype"),
        (torch.ones(2, 4, 64, dtype=torch.float64), "dtype"),
    ],
)
def test_bad_tensors_are_refused(name, x, match):
    with pytest.raises(CodecError, match=match):
        codec_of(name).encode(x, ctx())


@pytest.mark.parametrize("name", ALL)
def test_corruption_is_caught_by_the_checksum(name):
    msg = encoded(name)
    flipped = bytearray(msg.payload)
    flipped[len(flipped) // 2] ^= 0x10
    for payload in (msg.payload[:-3], msg.payload + b"\0\0", bytes(flipped)):
        with pytest.raises(CodecError, match="checksum"):
            codecs.decode(with_payload(msg, payload, fix_crc=False), ctx())


@pytest.mark.parametrize("name", ALL)
def test_truncated_or_extended_payload_is_caught_by_the_layout(name):
    """Even with a matching checksum (a buggy or hostile peer), lengths are checked before use."""
    msg = encoded(name)
    with pytest.raises(CodecError, match="truncated|needs|bytes"):
        codecs.decode(with_payload(msg, msg.payload[:-1]), ctx())
    with pytest.raises(CodecError, match="trailing|needs|bytes"):
        codecs.decode(with_payload(msg, msg.payload + b"\x00"), ctx())


@pytest.mark.parametrize("name", ALL)
def test_shape_that_does_not_match_the_payload(name):
    msg = encoded(name)
    msg.shape[1] = 6
    with pytest.raises(CodecError, match="checksum"):
        codecs.decode(msg, ctx())
    msg.shape[1] = 40  # a consistent checksum: the layout check must catch it
    with pytest.raises(CodecError, match="truncated|needs|bytes"):
        codecs.decode(with_payload(msg, msg.payload), ctx())


@pytest.mark.parametrize("name", ALL)
def test_forged_huge_shape_fails_fast_without_allocating(name):
    msg = encoded(name)
    del msg.shape[:]
    msg.shape.extend([2, 1 << 20, 1 << 9])  # 2**30 elements described by a tiny payload
    msg = with_payload(msg, msg.payload)
    start = time.perf_counter()
    # (tahquant's message of 80 channels says `blocks`, which a width of 512 at G = 64 does not have)
    with pytest.raises(CodecError, match="truncated|needs|bytes|blocks"):
        codecs.decode(msg, ctx())
    assert time.perf_counter() - start < 2.0
    msg.shape[1] = 1 << 40
    with pytest.raises(CodecError, match="2\\*\\*31"):
        codecs.decode(with_payload(msg, msg.payload), ctx())


def test_unknown_codec_version_dtype_and_params():
    msg = encoded("tahquant-paper")
    bad = type(msg)()
    bad.CopyFrom(msg)
    bad.codec = "zstd"
    with pytest.raises(CodecError, match="unknown codec 'zstd'"):
        codecs.decode(bad, ctx())
    bad.CopyFrom(msg)
    bad.version = 7
    with pytest.raises(CodecError, match="version 7 is not supported"):
        codecs.decode(bad, ctx())
    bad.CopyFrom(msg)
    bad.dtype = 0
    with pytest.raises(CodecError, match="dtype"):
        codecs.decode(bad, ctx())
    bad.CopyFrom(msg)
    bad.params["group_size"] = 48
    with pytest.raises(CodecError, match="checksum"):
        codecs.decode(bad, ctx())
    with pytest.raises(CodecError, match="group_size"):
        codecs.decode(with_payload(bad, bad.payload), ctx())
    bad.CopyFrom(msg)
    bad.params["bits_low"] = 3.5
    with pytest.raises(CodecError, match="checksum"):
        codecs.decode(bad, ctx())
    with pytest.raises(CodecError, match="integer"):
        codecs.decode(with_payload(bad, bad.payload), ctx())
    bad.CopyFrom(msg)
    bad.params["colour"] = 1
    with pytest.raises(CodecError, match="checksum"):
        codecs.decode(bad, ctx())
    with pytest.raises(CodecError, match="unknown parameters: colour"):
        codecs.decode(with_payload(bad, bad.payload), ctx())
    with pytest.raises(CodecError, match="unknown codec"):
        codecs.get_codec("zstd")
    with pytest.raises(CodecError, match="unknown parameter"):
        codecs.get_codec("tahquant", colour=1)
    with pytest.raises(CodecError, match="unknown parameter"):
        codecs.get_codec("tahquant", rho=0.8)  # the paper's parameter: tahquant-paper's
    with pytest.raises(CodecError, match="rho"):
        codecs.get_codec("tahquant-paper", rho=1.5)


# the golden vectors of tahquant version 2 (rotated tiles at INT4) and of per-tile allocation (alloc = 1), as a
# build before their retirement sent them (tests/golden/vectors.json then)
LAYOUT_2_MESSAGE = bytes.fromhex(
    "0a087461687175616e7410021a0301040c20022a100a05616c6c6f631100000000000000002a140a09626974735f68696768110000000000"
    "0010402a130a08626974735f6c6f771100000000000008402a150a0a67726f75705f73697a651100000000000020402a0e0a0372686f119a"
    "9999999999e93f2a0e0a037461751100000000000000403230bd3f903e1b3f533e903ef63e41400b3fc3e2d0a73e9c3e9c05bbd4aa232023"
    "20bb215e65033a033ac3e4b3c4958e958e3d5b10f8204001")
ALLOC_1_MESSAGE = bytes.fromhex(
    "0a087461687175616e7410011a0301040c20032a100a05616c6c6f6311000000000000f03f2a140a09626974735f68696768110000000000"
    "0010402a130a08626974735f6c6f771100000000000008402a150a0a67726f75705f73697a651100000000000020402a0e0a0372686f119a"
    "9999999999e93f2a0e0a037461751100000000000000403243222d633468bdf42755b410c0ef31d0c040bf4935f7336431182309346a2e40"
    "36bc2f910002845f04388755f3844f6080f101f101b608aef9f8f8aafb098628d01bffff3d517792ca4001")


def test_retired_version_2_is_refused_as_an_unknown_version_is():
    """tahquant version 2 (rotated tiles at INT4) is retired: an older build's message of it gets the
    CodecError an unknown version gets, from the same check; a codec or a run that asks for a layout,
    any layout, is told that tahquant's layouts are codecs of their own now."""
    from tahnode.config import RunConfig

    old = codecs.parse_message(LAYOUT_2_MESSAGE)
    assert old.codec == "tahquant" and old.version == 2 and codecs.checksum(old) == old.crc32
    unknown = type(old)()
    unknown.CopyFrom(old)
    unknown.version = 7
    unknown.crc32 = codecs.checksum(unknown)
    for msg in (old, unknown):
        with pytest.raises(CodecError, match=f"codec tahquant version {msg.version} is not supported "
                                             f"\\(this build reads version 1, 3\\)"):
            codecs.decode(msg, ctx())
    for layout in (1, 2, 3):
        with pytest.raises(CodecError, match="layout 1 \\(the paper's\\) codec tahquant-paper"):
            codecs.get_codec("tahquant", layout=layout)
        with pytest.raises(CodecError, match="layouts are codecs of their own"):
            RunConfig.build("llama-tiny", None, **{"codec.forward_params": {"layout": layout, "qmax": 12}})
        with pytest.raises(CodecError, match="layout 3 \\(a run's\\) is codec tahquant "):
            codecs.parse_param_args("tahquant-paper", [f"layout={layout}"])


def test_retired_per_tile_allocation_is_refused():
    """alloc = 1 (the paper's per-tile variant) is retired: tahquant-paper's messages carry alloc = 0, as
    before; an older build's message with alloc = 1 is refused, and so is a codec asked for it."""
    old = codecs.parse_message(ALLOC_1_MESSAGE)
    assert old.version == 1 and old.params["alloc"] == 1.0 and codecs.checksum(old) == old.crc32
    with pytest.raises(CodecError, match="alloc must be 0"):
        codecs.decode(old, ctx())
    with pytest.raises(CodecError, match="alloc must be 0"):
        codecs.get_codec("tahquant-paper", alloc=1)
    assert codecs.get_codec("tahquant-paper").encode(sample("tahquant")).params["alloc"] == 0.0


def test_garbage_bytes_are_not_a_message():
    with pytest.raises(CodecError, match="malformed"):
        codecs.parse_message(b"\xff\xff\xff\xff\x0f")


def test_values_beyond_fp16_range_are_refused_with_a_reason():
    x = torch.ones(2, 64) * 1e6
    with pytest.raises(CodecError, match="fp16 range"):
        codecs.get_codec("tahquant-paper").encode(x)
    rotated = codecs.decode(codecs.get_codec("tahquant").encode(x))  # its bf16 scales cope
    assert float((rotated - x).norm() / x.norm()) < 0.15
    y = codecs.decode(codecs.get_codec("naive", bits=8).encode(x))  # naive's scales cope
    assert torch.allclose(y, x, rtol=1 / 254)


# --- fuzzing -----------------------------------------------------------------------------------
MESSAGES = {name: encoded(name) for name in ALL}


def decode_or_codec_error(msg):
    """The only allowed outcomes: a tensor of the header's shape, or a CodecError."""
    try:
        out = codecs.decode(msg, ctx())
    except CodecError:
        return None
    assert list(out.shape) == list(msg.shape)
    return out


@given(name=st.sampled_from(ALL), data=st.data())
def test_fuzz_payload_mutations(name, data):
    msg = MESSAGES[name]
    payload = bytearray(msg.payload)
    op = data.draw(st.sampled_from(["flip", "cut", "extend", "splice"]))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "cut":
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    elif op == "extend":
        payload += data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(0, len(payload)))
        payload[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    decode_or_codec_error(with_payload(msg, bytes(payload)))


@given(name=st.sampled_from(ALL), data=st.data())
def test_fuzz_serialized_message_mutations(name, data):
    wire = bytearray(codecs.serialize(MESSAGES[name]))
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, min(len(wire) - 1, 200)))  # the header lives at the front
        wire[i] = data.draw(st.integers(0, 255))
    try:
        msg = codecs.parse_message(bytes(wire))
    except CodecError:
        return
    if codecs.checksum(msg) != msg.crc32:
        with pytest.raises(CodecError):
            codecs.decode(msg, ctx())
        msg.crc32 = codecs.checksum(msg)  # and as if a peer had sealed the damaged header
    decode_or_codec_error(msg)


@given(
    name=st.sampled_from(STATELESS),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=3).flatmap(
        lambda lead: st.integers(1, 300).map(lambda c: (*lead, c))
    ),
    seed=st.integers(0, 2**16),
)
def test_property_roundtrip_any_shape(name, dtype, shape, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    msg = codec_of(name).encode(x)
    assert codecs.serialize(msg) == codecs.serialize(codec_of(name).encode(x))  # deterministic
    y = codecs.decode(codecs.parse_message(codecs.serialize(msg)))
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.float() - x.float()).abs().max()
    # coarse, holds for every codec at its defaults (the last term: fp16 or bf16 rounding of zero/scale,
    # then the decoded value's own rounding to dtype)
    rounding = 1 / 256 + torch.finfo(dtype).eps / 2
    assert err <= (x.float().max() - x.float().min()) / 2 + x.float().abs().max() * rounding

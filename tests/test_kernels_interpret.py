"""The Triton kernels against their specifications: tahquant_triton vs tahquant_ref, byte for byte,
under Triton's CPU interpreter (or on the GPU when one is present and TRITON_INTERPRET is unset);
and the registry's dispatch to them (naive, a baseline, is served by its reference everywhere).

TAH-Quant's one allowed difference is the Hadamard rounding (the kernel's fp32 tl.dot vs the
reference's float64 product rounded once; docs/wire-format.md). It can only touch flagged tiles, and
is bounded here exactly:
  * allocation bitmap, flag bitmap and pivots: identical; unflagged tiles: identical bytes;
  * flagged tiles whose fp16 zero or scale differs: at most ZS_RATE of the flagged tiles (+2);
  * on the other flagged tiles a code differs by at most 1, in at most CODE_RATE of all codes (+1);
  * decode: unflagged tiles identical; a flagged tile's values within the fp32 summation bound
    G * 2^-24 * sum|y| / sqrt(G) + 2^-23 |x| (+ one ulp of a 16-bit output dtype).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest normally did this)

pytest.importorskip("triton")

from tahnode import codecs  # noqa: E402
from tahnode.kernels import dispatch, naive_ref, tahquant_ref, tahquant_triton  # noqa: E402
from tahnode.kernels.bitpack import packed_nbytes, padded_count, unpack_bits, unpack_rows  # noqa: E402
from tahnode.kernels.tahquant_ref import Layout, PaperParams as P  # noqa: E402
from tahnode.kernels.wire import CodecError  # noqa: E402
from helpers import activations  # noqa: E402

pytestmark = pytest.mark.gpu  # on a GPU machine these run on CUDA tensors (`pytest -m gpu`)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ZS_RATE = 1e-2    # flagged tiles whose fp16 zero-point or scale may differ (fp32 min/range moved by an ulp)
CODE_RATE = 1e-4  # codes that may differ (by 1) on flagged tiles whose zero-point and scale agree


def sections(payload: torch.Tensor, shape, p: P) -> dict:
    """The version-1 sections of a tahquant payload, unpacked (codes as (NT, G))."""
    payload = payload.cpu()
    lay = Layout.of(tuple(shape), p.group_size)
    nt = lay.tiles
    pos = 0

    def take(n):
        nonlocal pos
        pos += n
        return payload[pos - n : pos]

    alloc = unpack_bits(take(-(-lay.tokens // 8)), 1, padded_count(lay.tokens))[: lay.tokens].bool()
    flag = unpack_bits(take(-(-nt // 8)), 1, padded_count(nt))[:nt].bool()
    zero = take(2 * nt).clone().view(torch.int16)  # bit patterns: -0.0 != +0.0
    scale = take(2 * nt).clone().view(torch.int16)
    nf = int(flag.sum())
    piv = unpack_bits(take(packed_nbytes(nf, p.pivot_bits)), p.pivot_bits, padded_count(nf))
    low = alloc.repeat_interleave(lay.tiles_per_token)
    codes = unpack_rows(payload[pos:], tahquant_ref.tile_bits(low, p), p.group_size)
    return dict(alloc=alloc, flag=flag, zero=zero, scale=scale, piv=piv, codes=codes)


def check_payload(pk: torch.Tensor, pr: torch.Tensor, shape, p: P) -> dict:
    """Assert the kernel payload pk equals the reference payload pr up to the bounded Hadamard
    rounding (module docstring); returns the counts."""
    assert pk.dtype == torch.uint8 and pk.dim() == 1
    assert pk.numel() == pr.numel(), (pk.numel(), pr.numel())
    sk, sr = sections(pk, shape, p), sections(pr, shape, p)
    for key in ("alloc", "flag", "piv"):
        assert torch.equal(sk[key], sr[key]), key
    flag = sr["flag"]
    zs = (sk["zero"] != sr["zero"]) | (sk["scale"] != sr["scale"])
    assert not zs[~flag].any(), "zero/scale differ on an unflagged tile"
    assert torch.equal(sk["codes"][~flag], sr["codes"][~flag]), "codes differ on an unflagged tile"
    n_flag, n_zs = int(flag.sum()), int(zs.sum())
    assert n_zs <= 2 + ZS_RATE * n_flag, (n_zs, n_flag)
    same = flag & ~zs
    d = (sk["codes"][same].int() - sr["codes"][same].int()).abs()
    n_codes = int(d.gt(0).sum())
    assert d.numel() == 0 or int(d.max()) <= 1
    assert n_codes <= 1 + CODE_RATE * sr["codes"].numel(), (n_codes, sr["codes"].numel())
    if n_zs == 0 and n_codes == 0:
        assert torch.equal(pk.cpu(), pr)
    return dict(flagged=n_flag, zs=n_zs, codes=n_codes)


def check_decode(dk: torch.Tensor, dr: torch.Tensor, payload: torch.Tensor, shape, p: P) -> None:
    """Kernel decode dk vs reference decode dr of the same payload: equal off the flagged tiles,
    within the fp32 Hadamard summation bound on them."""
    assert dk.shape == dr.shape and dk.dtype == dr.dtype
    dk, dr = dk.cpu(), dr
    g = p.group_size
    lay = Layout.of(tuple(shape), g)
    s = sections(payload, shape, p)
    zero = s["zero"].view(torch.float16).double()
    scale = s["scale"].view(torch.float16).double()
    y = s["codes"].double() * scale[:, None] + zero[:, None]                  # (NT, G), exact
    l1 = y.abs().sum(-1) / math.sqrt(g)                                         # per tile

    def tiled(v):  # per-tile values -> (tokens, C)
        return (v.reshape(lay.tokens, lay.tiles_per_token, 1).expand(-1, -1, g)
                .reshape(lay.tokens, -1)[:, : lay.channels])

    flagged = tiled(s["flag"])
    a, b = dk.reshape(lay.tokens, -1).double(), dr.reshape(lay.tokens, -1).double()
    assert torch.equal(a[~flagged], b[~flagged]), "decode differs on an unflagged tile"
    bound = g * 2.0**-24 * tiled(l1) + 2.0**-23 * b.abs()
    if dr.dtype != torch.float32:
        bound = bound + torch.finfo(dr.dtype).eps * b.abs() + 2.0**-24
    err = (a - b).abs()
    assert bool((err[flagged] <= bound[flagged]).all()), float((err - bound)[flagged].max())


def run_case(x: torch.Tensor, p: P) -> dict:
    shape = tuple(x.shape)
    pk = tahquant_triton.encode(x.to(DEVICE), p)
    pr = tahquant_ref.encode(x, p)
    stats = check_payload(pk, pr, shape, p)
    dk = tahquant_triton.decode(pr.to(DEVICE), shape, p, x.dtype)
    check_decode(dk, tahquant_ref.decode(pr, shape, p, x.dtype), pr, shape, p)
    # the kernel's own payload is a valid payload for the reference decoder, and decodes alike
    dk2 = tahquant_triton.decode(pk, shape, p, x.dtype)
    check_decode(dk2, tahquant_ref.decode(pk.cpu(), shape, p, x.dtype), pk, shape, p)
    return stats


CASES = [
    ((3, 50, 64), F32, P()),
    ((2, 37, 96), BF16, P()),                                      # C not a multiple of G
    ((1, 300, 512), F16, P()),
    ((2, 20, 4096), BF16, P()),
    ((1, 5, 8192), F32, P()),                                      # wide, few tokens
    ((2, 2048, 40), F16, P()),                                     # B*S = 4096 tokens, C < G
    ((2, 40, 100), F32, P(group_size=32)),
    ((3, 30, 384), BF16, P(group_size=128)),
    ((1, 17, 300), F16, P(group_size=128)),
    ((2, 16, 200), F32, P(group_size=8, bits_high=8, bits_low=5)),  # no tl.dot (G < 16); 8-bit plane
    ((1, 24, 512), F32, P(group_size=256, bits_high=7, bits_low=6)),  # 4+2+1 planes, chunked Hadamard
    ((4, 9, 48), F32, P(group_size=16, bits_high=2, bits_low=2, rho=0.5)),
    ((1000,), F32, P()),                                           # 1-D: a single token
    ((2, 3, 10, 64), BF16, P(rho=1.0)),                            # 4-D, everything INT4
    ((5, 33, 128), F16, P(rho=0.0, tau=1.5)),                      # everything INT3
    ((4, 64, 128), F32, P(bits_low=4, tau=1e3)),                   # INT4 only, no outlier tile: the smallest payload
]


@pytest.mark.parametrize("shape,dtype,params", CASES, ids=lambda v: str(v) if not isinstance(v, P) else "")
def test_tahquant_matches_reference(shape, dtype, params):
    run_case(activations(shape, dtype, seed=sum(shape)), params)


def test_tahquant_rounding_differences_are_rare():
    """fp32 inputs with spikes in most tiles: many flagged tiles with inexact fp32 sums, so the
    Hadamard rounding is exercised; the totals stay within the documented rates."""
    tot = dict(flagged=0, zs=0, codes=0)
    for g in (8, 32, 64, 128):
        st = run_case(activations((2, 64, 1024), F32, seed=g, spikes=0.9), P(group_size=g))
        for k in tot:
            tot[k] += st[k]
    assert tot["flagged"] > 5000
    assert tot["zs"] <= ZS_RATE / 2 * tot["flagged"]


def test_tahquant_gpu_launch_configuration(monkeypatch):
    """The block shapes the kernels get on a GPU (ROWS tokens x one tile column), in the interpreter."""
    monkeypatch.setattr(tahquant_triton, "_interpreting", lambda: False)
    run_case(activations((2, 40, 192), BF16, seed=3), P())
    run_case(activations((1, 20, 320), F32, seed=4), P(group_size=128))


# torch ops that only allocate or make views: no kernel runs for them on a GPU
_NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "slice", "as_strided", "alias", "detach", "lift_fresh",
              "_reshape_alias", "select", "expand", "t", "transpose", "unsqueeze", "squeeze", "permute", "reshape",
              "_to_copy", "copy_", "_local_scalar_dense"}  # the last three: the one read back to the host


def launches(module, fn):
    """(the module's kernels launched by fn(), torch ops that run a kernel outside those launches,
    fn's result): wraps every `*_kernel` of the module and watches torch's dispatcher (the
    interpreter's own tensor copies inside a launch do not count)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    launched, ops, inside = [], [], [False]

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(self.name)
                inside[0] = True
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    inside[0] = False
            return launch

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and name not in _NO_KERNEL:
                ops.append(name)
            return func(*args, **(kwargs or {}))

    mp = pytest.MonkeyPatch()
    try:
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            mp.setattr(module, name, Counted(name, getattr(module, name)))
        with Ops():
            result = fn()
    finally:
        mp.undo()
    return launched, ops, result


def test_kernel_paths_are_a_few_launches():
    """The GPU paths are a few launches, because launch overhead (not bytes) would dominate
    otherwise: tahquant encode = six kernels and one torch scan, decode = two
    kernels and one scan."""
    x = activations((2, 64, 256), BF16, seed=13).to(DEVICE)
    shape, p = tuple(x.shape), P()
    kernels, ops, payload = launches(tahquant_triton, lambda: tahquant_triton.encode(x, p))
    assert kernels == ["_stats_kernel", "_cut_kernel", "_refine_kernel", "_alloc_kernel", "_encode_kernel",
                       "_assemble_kernel"]
    assert ops == ["cumsum"]
    kernels, ops, y = launches(tahquant_triton, lambda: tahquant_triton.decode(payload, shape, p, BF16))
    assert kernels == ["_bitcount_kernel", "_decode_kernel"] and ops == ["cumsum"]
    check_payload(payload, tahquant_ref.encode(x.cpu(), p), shape, p)
    check_decode(y, tahquant_ref.decode(payload.cpu(), shape, p, BF16), payload, shape, p)


def test_tahquant_noncontiguous_input():
    x = activations((37, 2, 96), F16, seed=5).transpose(0, 1)
    assert not x.is_contiguous()
    run_case(x, P())


def test_tahquant_ties_zero_rows_and_duplicates():
    """Equal entropies (all-zero tokens, duplicated tokens, power-of-two scaled copies) rank by index."""
    x = activations((2, 80, 64), F32, seed=6, spikes=0.0)
    x[:, 10:20] = 0.0
    x[:, 30:50] = x[:, 30:31]
    x[:, 50:60] = x[:, 5:6] * torch.tensor([0.25, 0.5, 2.0, 4.0, 8.0, 1.0, 16.0, 0.125, 32.0, 64.0])[:, None]
    run_case(x, P())


def _near_tie_tokens(n_tokens, n_close, seed):
    """Tokens with spread-out entropies, except n_close scaled copies (entropies equal up to
    rounding) of the token at the 20% quantile, i.e. right at the INT3/INT4 cut."""
    gen = torch.Generator().manual_seed(seed)
    sharp = torch.linspace(0.2, 3.0, n_tokens)[:, None]
    x = torch.randn(n_tokens, 32, generator=gen) * torch.exp(sharp * torch.randn(n_tokens, 32, generator=gen))
    ent = tahquant_ref.token_entropy(x)
    pivot = int(torch.argsort(ent)[int(0.2 * n_tokens)])
    idx = torch.randperm(n_tokens, generator=gen)[:n_close]
    x[idx] = x[pivot] * (1.0 + 0.01 * torch.arange(1, n_close + 1, dtype=torch.float32))[:, None]
    return x[None]


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_tahquant_allocation_near_ties_and_fallback(monkeypatch, path):
    """A cluster of near-equal entropies at the cut is settled in float64: by the refine kernel
    (sequences of up to SEQ_MAX tokens) or inside rank_low's window (longer ones, here forced). A
    cluster larger than NSLOT, or than the window, makes encode rank everything exactly. Every way
    gives the reference's bytes."""
    if path == "torch":
        monkeypatch.setattr(tahquant_triton, "SEQ_MAX", 0)
    calls = []
    real = tahquant_triton._exact_allocation
    monkeypatch.setattr(tahquant_triton, "_exact_allocation", lambda *a: calls.append(1) or real(*a))
    run_case(_near_tie_tokens(1000, 12, seed=7), P())
    assert calls == []
    run_case(_near_tie_tokens(1000, 400, seed=8), P())
    assert calls == [1]


def _cluster_at_cut(n_tokens, n_low, width, seed):
    """(n_tokens, 32) tokens with spread-out entropies, except that ranks [n_low - width // 2,
    n_low + width // 2] hold scaled copies of the token of rank n_low - 1 (entropies equal up to
    rounding): the INT3/INT4 cut runs through the cluster."""
    gen = torch.Generator().manual_seed(seed)
    sharp = torch.linspace(0.2, 3.0, n_tokens)[:, None]
    x = torch.randn(n_tokens, 32, generator=gen) * torch.exp(sharp * torch.randn(n_tokens, 32, generator=gen))
    order = torch.argsort(tahquant_ref.token_entropy(x))
    pivot = order[n_low - 1]
    victims = order[n_low - width // 2 : n_low + width // 2 + 1]
    victims = victims[victims != pivot]
    x[victims] = x[pivot] * (1.0 + 1e-3 * torch.arange(1, len(victims) + 1, dtype=torch.float32))[:, None]
    return x


def test_kernel_allocation_settles_uncertain_tokens():
    """The cut kernel's uncertain tokens (fp32 entropies within twice the error bound of the cut)
    are there, fewer than NSLOT, and the refine and alloc kernels rank them like the reference."""
    n_low = 300 - round(0.8 * 300)
    for seed in range(4):
        x = torch.stack([_cluster_at_cut(300, n_low, 4 + 6 * seed, seed=20 + 2 * seed + q) for q in range(2)])
        lay, p = Layout.of(tuple(x.shape), 64), P()
        x2 = x.reshape(lay.tokens, lay.channels).to(DEVICE)
        status = torch.zeros(4, dtype=torch.int32, device=DEVICE)
        e32, _, _ = tahquant_triton._stats(x2, lay, p, status)
        low, off = tahquant_triton._kernel_allocation(x2, lay, p, e32, n_low, status)
        expected = tahquant_ref.low_bit_mask(tahquant_ref.token_entropy(x), 0.8)
        assert int(status[0]) & 4 == 0
        assert torch.equal(low.cpu().bool().reshape(2, 300), expected), seed
        # the cluster sits at the cut: the fp32 entropies leave the side of several tokens uncertain
        e = e32.cpu().double().reshape(2, 300)
        cut = e.sort(-1).values[:, n_low - 1 : n_low + 1]
        slack = tahquant_triton.entropy_slack(32)
        uncertain = (e >= cut[:, 1:] - 2 * slack) & (e <= cut[:, :1] + 2 * slack)
        assert (uncertain.sum(-1) >= 3).all(), uncertain.sum(-1)
        sizes = torch.where(low.cpu().bool(), 3, 4).long() * 64 // 8  # one tile of 64 (32 channels, padded)
        assert torch.equal(off.cpu(), torch.cumsum(sizes, 0) - sizes)


def test_rank_low_matches_low_bit_mask():
    """rank_low from perturbed entropies equals low_bit_mask of the exact ones whenever it says ok."""
    gen = torch.Generator().manual_seed(9)
    n_ok = 0
    for trial in range(40):
        nseq, n = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 600, (1,), generator=gen))
        exact = torch.randn(nseq, n, generator=gen, dtype=torch.float64) * (10.0 ** -int(trial % 5))
        if trial % 3 == 0:
            exact = exact.round(decimals=2)  # exact ties
        slack = 1e-4
        approx = (exact + (torch.rand(nseq, n, generator=gen, dtype=torch.float64) * 2 - 1) * slack).float()
        slack32 = slack + float(exact.abs().max()) * 2.0**-23
        rho = [0.8, 0.5, 0.0, 1.0, 0.33][trial % 5]
        mask, ok = tahquant_triton.rank_low(approx, rho, slack32, lambda win: torch.gather(exact, 1, win))
        if bool(ok):
            n_ok += 1
            assert torch.equal(mask, tahquant_ref.low_bit_mask(exact, rho)), trial
    assert n_ok >= 10


def test_entropy_slack_bounds_the_kernel():
    """|fp32 kernel entropy - float64 reference entropy| <= entropy_slack, per token."""
    x = activations((3, 40, 1000), F32, seed=10, spikes=0.0) * torch.logspace(-20, 20, 40)[None, :, None]
    x2 = x.reshape(-1, 1000)
    lay, status = Layout(1, x2.shape[0], 1000, 64), torch.zeros(4, dtype=torch.int32, device=DEVICE)
    e32 = tahquant_triton._stats(x2.to(DEVICE), lay, P(), status)[0].cpu().double()
    exact = tahquant_ref.token_entropy(x2)
    assert float((e32 - exact).abs().max()) <= tahquant_triton.entropy_slack(1000)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's fp16 cast of 1e6
def test_tahquant_encode_errors_match_reference():
    x = activations((2, 8, 64), F32)
    x[1, 3, 5] = float("nan")
    for bad in (x, torch.full((2, 8, 64), 1e6)):
        with pytest.raises(CodecError) as ref:
            tahquant_ref.encode(bad, P())
        with pytest.raises(CodecError) as ker:
            tahquant_triton.encode(bad.to(DEVICE), P())
        assert str(ker.value) == str(ref.value)


def _corruptions(payload: torch.Tensor, shape, p: P):
    lay = Layout.of(shape, p.group_size)
    nt = lay.tiles
    a_len, f_len = -(-lay.tokens // 8), -(-nt // 8)
    s = sections(payload, shape, p)
    nf = int(s["flag"].sum())
    piv_at = a_len + f_len + 4 * nt
    out = {
        "truncated": payload[:-1],
        "trailing": torch.cat([payload, torch.zeros(1, dtype=torch.uint8)]),
        "tiny": payload[:10],
        "empty": payload[:0],
        "alloc padding": _set(payload, a_len - 1, 0x80),
        "flag padding": _set(payload, a_len + f_len - 1, 0x80),
        "nan zero": _set(payload, a_len + f_len + 1, 0x7E),
        "negative scale": _set(payload, a_len + f_len + 2 * nt + 1, 0x80 | int(payload[a_len + f_len + 2 * nt + 1])),
        "pivot padding": _set(payload, piv_at + packed_nbytes(nf, p.pivot_bits) - 1, 0xFF),
        "one more flag": _set(payload, a_len, int(payload[a_len]) ^ 1),
        "one more low token": _set(payload, 0, int(payload[0]) ^ 1),
    }
    return out


def _set(payload, i, value):
    q = payload.clone()
    q[i] = value
    return q


def test_tahquant_corrupt_payloads_raise_like_reference():
    shape, p = (1, 13, 96), P()  # 13 tokens, 26 tiles: padding bits in both bitmaps
    x = activations(shape, F32, seed=11)
    payload = tahquant_ref.encode(x, p)
    assert int(sections(payload, shape, p)["flag"].sum()) % 8
    for name, bad in _corruptions(payload, shape, p).items():
        try:
            tahquant_ref.decode(bad, shape, p, F32)
            ref_error = None
        except CodecError as exc:
            ref_error = str(exc)
        if ref_error is None:  # still well-formed (a flipped flag can keep every length): must decode alike
            dk = tahquant_triton.decode(bad.to(DEVICE), shape, p, F32)
            assert dk.shape == shape, name
            continue
        with pytest.raises(CodecError) as ker:
            tahquant_triton.decode(bad.to(DEVICE), shape, p, F32)
        assert str(ker.value) == ref_error, name
    with pytest.raises(CodecError):
        tahquant_triton.decode(payload.to(DEVICE), (1, 14, 96), p, F32)  # header shape disagrees


def test_dispatch(monkeypatch):
    """The registry sends CUDA tensors, or CPU tensors with TAHNODE_FORCE_TRITON=1 under the
    interpreter, to the kernels; everything else to the references. (The variable is set only
    inside this test: the rest of the suite keeps the references.)"""
    cpu = torch.zeros(2)
    monkeypatch.delenv("TAHNODE_FORCE_TRITON", raising=False)
    assert not dispatch.use_triton(cpu)
    monkeypatch.setenv("TAHNODE_FORCE_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(cpu)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert not dispatch.use_triton(cpu)
    monkeypatch.undo()

    if DEVICE == "cpu":
        monkeypatch.setenv("TAHNODE_FORCE_TRITON", "1")
    used = []
    for fn in ("encode", "decode"):
        real = getattr(tahquant_triton, fn)
        monkeypatch.setattr(tahquant_triton, fn, lambda *a, _r=real, _n=fn: used.append(_n) or _r(*a))
    x = activations((2, 9, 80), BF16, seed=12)
    for name in ("tahquant-paper", "naive"):
        codec = codecs.get_codec(name)
        msg = codec.encode(x.to(DEVICE))
        y = codecs.decode(codecs.parse_message(codecs.serialize(msg)), device=DEVICE)
        assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == DEVICE
        payload = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8)
        if name == "naive":
            ref, e = naive_ref.encode(x, naive_ref.NaiveParams())
            assert torch.equal(payload, ref) and msg.params["exp"] == e
        else:
            check_payload(payload, tahquant_ref.encode(x, P()), x.shape, P())
    assert sorted(set(used)) == ["decode", "encode"]  # tahquant-paper's kernels; naive's reference, on the CPU

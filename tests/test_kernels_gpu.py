"""The codecs on a CUDA GPU (`pytest -m gpu`; skipped without one): the Triton kernels against their
specifications at the sizes real stages send, in every dtype, and every codec's messages made and
read on the GPU against the same messages made and read on the CPU.

TAH-Quant's bounded Hadamard rounding difference (docs/wire-format.md) is checked as in
test_kernels_interpret; everything else must be equal byte for byte and bit for bit."""

from __future__ import annotations

import pytest
import torch

from tahnode import codecs
from tahnode.codecs import CodecContext
from tahnode.kernels import pertoken_ref, pertoken_triton, tahquant_ref, tahquant_triton
from tahnode.kernels import tahquant_rice_ref, tahquant_rice_triton
from tahnode.kernels.tahquant_ref import PaperParams as P
from helpers import activations, same_bits
from test_kernels_interpret import check_decode, check_payload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STAGE_SHAPES = [(1, 1024, 1600), (4, 2048, 4096), (8, 4096, 8192)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", STAGE_SHAPES, ids=[str(s) for s in STAGE_SHAPES])
def test_kernels_match_the_references_at_stage_sizes(shape, dtype):
    x = activations(shape, dtype, seed=shape[-1])  # made on the CPU: the reference reads it there
    xg = x.cuda()
    p = P()
    pr = tahquant_ref.encode(x, p)
    stats = check_payload(tahquant_triton.encode(xg, p), pr, shape, p)
    assert stats["flagged"] > 0  # the outlier path (pivot swap + Hadamard) ran
    check_decode(tahquant_triton.decode(pr.cuda(), shape, p, dtype), tahquant_ref.decode(pr, shape, p, dtype), pr,
                 shape, p)
    del pr
    for kernel, ref, params in ((pertoken_triton, pertoken_ref, pertoken_ref.PerTokenParams()),
                                (tahquant_rice_triton, tahquant_rice_ref, tahquant_rice_ref.RiceParams())):
        pr = ref.encode(x, params)
        assert torch.equal(kernel.encode(xg, params).cpu(), pr), kernel.__name__
        assert same_bits(kernel.decode(pr.cuda(), shape, params, dtype).cpu(),
                         ref.decode(pr, shape, params, dtype)), kernel.__name__
        del pr
    torch.cuda.empty_cache()


def contexts(codec, dim: int, device: str, ids: list[int]) -> tuple[CodecContext, CodecContext]:
    """A sender's context (with the codec's sender state on `device`) and a receiver's."""
    send = codec.sender_state(dim, torch.device(device)).new_context()
    send.sample_ids = ids
    return send, CodecContext(sample_ids=ids)


@pytest.mark.parametrize("name", sorted(codecs.CODECS))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_every_codec_sends_the_same_bytes_from_the_gpu(name, dtype):
    """Two messages per stream (aqsgd's second one is a delta against its cache), made from a CUDA
    tensor and from the same tensor on the CPU: the same payload, and each side's decode of the
    other's message gives the same values."""
    shape, ids = (4, 256, 1024), [3, 1, 4, 5]
    codec = codecs.get_codec(name)
    on = {dev: contexts(codec, shape[-1], dev, ids) for dev in ("cpu", "cuda")}
    for k in range(2):
        x = activations(shape, dtype, seed=k + 7)
        msgs = {dev: codec.encode(x.to(dev), on[dev][0]) for dev in ("cpu", "cuda")}
        pg, pc = (torch.frombuffer(bytearray(msgs[d].payload), dtype=torch.uint8) for d in ("cuda", "cpu"))
        if name == "tahquant-paper":
            check_payload(pg, pc, shape, codec.params)
        else:
            assert torch.equal(pg, pc), (name, k)
        got = {dev: codecs.decode(msgs["cpu"], on[dev][1], dev) for dev in ("cpu", "cuda")}
        assert got["cuda"].is_cuda and got["cuda"].dtype == dtype
        if name == "tahquant-paper":
            check_decode(got["cuda"], got["cpu"], pc, shape, codec.params)
        else:
            assert same_bits(got["cuda"], got["cpu"]), (name, k)


@pytest.mark.parametrize("name,params",
                         [("none", {}), ("pertoken", {}), ("tahquant", {})], ids=["none", "pertoken", "tahquant"])
def test_an_overlapped_encode_copies_on_the_side_stream_and_finishes_as_encode_apart(name, params):
    """train.host_copy "overlap" on a GPU: the payload's copy to pinned memory runs on a side stream
    (an event marks it done) and, finished on another thread, gives encode_apart's message and bytes,
    though the compute stream has meanwhile freed the encoded tensor and written new tensors of its
    size (the copy's source is not reused before it has been read)."""
    import threading

    from tahnode.proto import tahnode_pb2 as pb

    codec = codecs.get_codec(name, **params)
    x = activations((4, 2048, 4096), torch.bfloat16, seed=9).cuda()
    want = pb.EncodedTensor()
    want_payload = bytes(codec.encode_apart(x, want).finish())
    got = pb.EncodedTensor()
    pending = codec.encode_apart(x * 1, got, overlap=True)  # a temporary: freed at once, its memory up for reuse
    assert isinstance(pending.done, torch.cuda.Event) and pending.host.is_pinned()
    noise = [torch.full_like(x, float(k)) for k in range(4)]  # the compute stream goes on
    finished = []
    thread = threading.Thread(target=lambda: finished.append(bytes(pending.finish())))
    thread.start()
    thread.join()
    assert finished == [want_payload] and got == want
    del noise

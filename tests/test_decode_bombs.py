"""Issue 39 finding 3, the Rice decode bomb: a receiver decodes only what its run sends (the codec,
wire version and parameters of its direction, the precision schedule's included), so a peer cannot
pick the grid that sizes a decode; and a unary stream whose zero-bits are not one per value is
refused before it is unpacked (8 bits to a byte, then an index per zero-bit). And the data plane
takes only the fast MAC and checksum, not the ones an older sender (or a token holder) picks."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from tahnode.codecs import CodecContext, CodecError, get_codec
from tahnode.kernels import rice, rice_cpu
from tahnode.net.transport import BACKWARD, FORWARD
from tahnode.proto import tahnode_pb2 as pb
from test_pipeline_inproc import build_run, codec_streams

X = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))


def micro_batch(msg: pb.EncodedTensor) -> pb.MicroBatch:
    return pb.MicroBatch(tensor=msg, sample_ids=[0, 1])


def test_a_receiver_decodes_its_runs_codec_and_parameters_only():
    run = build_run(4)  # the default pair: tahquant forward (and its schedule's finer grid), pertoken back
    receiver, forward = codec_streams(run, 1), run.codec.forward_codec_params
    assert run.codec.forward == "tahquant" and run.codec.scheduled
    own = get_codec(run.codec.forward, **forward)
    fine = get_codec(run.codec.forward, **{**forward, **run.codec.high_params})
    for codec in (own, fine):  # both grids the run sends decode
        back = receiver.decode(FORWARD, 1, micro_batch(codec.encode(X)), torch.float32)
        assert float((back - X).norm() / X.norm()) < 0.1
    peers = [get_codec(run.codec.forward, **{**forward, **params}) for params in ({"qmax": 127}, {"group_size": 64})]
    for codec in peers + [get_codec("tahquant-paper")]:  # a grid or a codec the peer chose: refused, not decoded
        with pytest.raises(CodecError, match="this run sends 'tahquant' version 3"):
            receiver.decode(FORWARD, 1, micro_batch(codec.encode(X)), torch.float32)
    back_codec = get_codec(run.codec.backward, **run.codec.backward_params)
    other_bits = {**run.codec.backward_params, "bits": 8}
    sender = codec_streams(run, 1)
    msg, _, _ = sender.encode_gradient(X, [0, 1])
    assert back_codec.sent(msg)
    with pytest.raises(CodecError, match="this run sends"):
        codec_streams(run, 0).decode(BACKWARD, 1, micro_batch(get_codec(run.codec.backward, **other_bits).encode(X)),
                                     torch.float32)


def test_a_unary_stream_with_other_than_one_zero_bit_a_value_is_refused_before_it_is_unpacked():
    count, k, qmax = 1 << 16, 0, 12
    longest = -(-count * ((2 * qmax >> k) + 1) // 8)  # the longest stream count values of the run's grid take
    unary = torch.zeros(longest, dtype=torch.uint8)   # every bit a zero: 8 ends a byte
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="do not end"):
            rice_cpu.decode(torch.empty(0, dtype=torch.uint8), unary, count, k, qmax, "tahquant")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * longest, peak  # before: unpacked to 8 bytes a byte, and an int64 index per zero-bit (72x)
    with pytest.raises(CodecError, match="do not end"):  # the reference refuses it alike
        rice.decode(torch.empty(0, dtype=torch.uint8), unary, count, k, 2 * qmax, "tahquant")
    honest = np.full(count // 8, 0b10101010, np.uint8)  # one zero-bit and one one-bit a value: still decodes
    assert rice_cpu.decode(torch.empty(0, dtype=torch.uint8), torch.from_numpy(honest), count // 2, 0, qmax,
                           "tahquant").numel() == count // 2


def test_the_data_plane_takes_the_fast_checks_only():
    """Issue 39 (low): the sender picked its MAC and checksum, and HMAC-SHA256 and zlib's CRC-32 cost
    the receiver several times the CPU of keyed BLAKE3 and CRC-32C: a stage refuses them."""
    from tahnode.codecs.host import checksum
    from tahnode.net.auth import BadMac, Sealer, SwarmKey
    from tahnode.net.identity import NodeKey

    run = build_run(4)
    msg = get_codec("none").encode(X)
    msg.checksum = pb.CRC32
    msg.crc32 = checksum(msg)
    with pytest.raises(CodecError, match="CRC-32C"):
        codec_streams(run, 1).decode(FORWARD, 1, micro_batch(msg), torch.float32)
    key, identity = SwarmKey("t"), NodeKey.generate()
    frame = Sealer(key, "a", "run", identity=identity).frame("b", 1, 0, 1, [b"data"]).head
    frame.data = b"data"
    frame.mac_kind, frame.mac = pb.HMAC_SHA256, key.frame_mac(frame, kind=pb.HMAC_SHA256)
    assert key.verify_frame(frame)  # a valid MAC of the other kind
    with pytest.raises(BadMac, match="HMAC-SHA256"):
        Sealer(key, "b", "run").check_frame(frame, first=True, signed_by=identity.public)



def test_an_aqsgd_stream_caches_no_more_samples_than_its_sender_can_have_sent():
    """Issue 39, low: a receiver's AQ-SGD cache grew by every made-up sample id a neighbour sent, for
    good and with no offence. A stream now caches at most the samples of the steps up to the
    message's (a whole run's at most); a message beyond that is refused (a CodecError: the worker
    refuses the micro-batch and counts it against its sender) and caches nothing."""
    run = build_run(4, **{"codec.forward": "aqsgd"})
    per_step = run.train.batch_size * run.train.micro_batches
    codec, receiver = get_codec("aqsgd"), codec_streams(run, 1)
    x = torch.randn(per_step, 8, run.model.dim, generator=torch.Generator().manual_seed(1))

    def send(first_id: int, step: int) -> None:
        ids = list(range(first_id, first_id + per_step))
        mb = pb.MicroBatch(tensor=codec.encode(x, CodecContext(sample_ids=ids)), sample_ids=ids, step=step)
        assert receiver.decode(FORWARD, 1, mb, torch.float32).shape == x.shape

    send(0, step=0)
    cache = receiver.receiving[FORWARD][1].aqsgd_cache
    with pytest.raises(CodecError, match=f"its sender can have sent {per_step}$"):
        send(1000, step=0)  # a second step's worth of samples in step 0
    assert len(cache) == per_step  # nothing of the refused message was cached
    send(1000, step=1)
    send(2000, step=3)
    send(3000, step=10**6)  # a step beyond the run's: room for a whole run's samples, no more
    assert len(cache) == 4 * per_step == run.train.steps * per_step
    with pytest.raises(CodecError, match=f"its sender can have sent {4 * per_step}$"):
        send(4000, step=10**6)
    send(0, step=10**6)  # samples it has cached already: deltas, no new rows
    assert len(cache) == 4 * per_step

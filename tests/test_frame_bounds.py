"""What a received frame may pin (issue 39, finding 2): a frame's data is a view of the whole message
that came off the wire, so the whole message counts against the stream's envelope cap, a frame
carries no unknown fields and nothing beyond its data but a small head, and every frame's count
agrees with its envelope's first. A neighbour padding its frames holds no more than the cap."""

from __future__ import annotations

import gc
import tracemalloc

import grpc
import pytest
from google.protobuf.message import DecodeError

from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.framing import CHUNK_BYTES, FrameError, FrameTooLarge, Reassembler, frames_of
from tahnode.net.identity import NodeKey
from tahnode.net.wire_frame import DATA_KEY, ReceivedFrame
from tahnode.net.body import varint
from tahnode.proto import tahnode_pb2 as pb
from servers import NODE, PEER, Servers
from test_replay import RPCS, refused_with, send

CAP = 4 * CHUNK_BYTES  # the stream's envelope cap in these tests
PAD_TO = 4 << 20       # each padded frame's size on the wire, as gRPC's message limit allows
UNKNOWN = 15           # a field number Frame does not have
LARGE_HEAD = 1 << 16   # more than a frame's fields but its data take (tahnode.net.wire_frame.FRAME_HEAD_BYTES)


def unknown_field(n: int) -> bytes:
    """An unknown length-delimited field of `n` bytes in all."""
    key = varint(UNKNOWN << 3 | 2)
    body = n - len(key) - len(varint(n))
    return key + varint(body) + bytes(body)


def earlier_data_field(n: int) -> bytes:
    """A data field before the real one: protobuf keeps the last, the MAC covers only that."""
    body = n - len(DATA_KEY) - len(varint(n))
    return DATA_KEY + varint(body) + bytes(body)


def attack(sender: Sealer, pad, frames: int = 60):
    """The neighbour's stream: frame 0 of a 2-frame envelope, then frames that say 10^9, each with
    1 byte of data padded to PAD_TO bytes on the wire. Made one at a time: nothing here holds them."""
    seq = sender.counter.next()
    yield sender.frame(NODE, seq, 0, 2, b"x").SerializeToString()
    for index in range(1, frames):
        raw = sender.frame(NODE, seq, index, 10**9, b"x").SerializeToString()
        yield pad(PAD_TO - len(raw)) + raw


@pytest.fixture
def pair():
    key, peer = SwarmKey("frames"), NodeKey.generate()
    return Sealer(key, PEER, "run", peer), Reassembler(Sealer(key, NODE, "run"), CAP, {PEER: peer.public})


def receive(asm: Reassembler, wire) -> tuple[type | None, int]:
    """Feed the stream as a server does (parse, then reassemble) until it is refused: the refusal's
    class (None if none) and the peak of the memory traced meanwhile above what it started at."""
    gc.collect()
    tracemalloc.start()
    base, refused = tracemalloc.get_traced_memory()[0], None
    try:
        for raw in wire:
            try:
                asm.add(ReceivedFrame.FromString(raw))
            except (DecodeError, FrameError) as exc:
                refused = type(exc)
                break
            finally:
                del raw
        return refused, tracemalloc.get_traced_memory()[1] - base
    finally:
        asm.reset()
        tracemalloc.stop()


@pytest.mark.parametrize("pad", [unknown_field, earlier_data_field])
def test_padded_frames_pin_no_more_than_the_cap(pair, pad):
    """Before, each 1-byte frame held its 4 MiB message and counted 1 byte: 60 frames held 236 MiB
    and the envelope never completed."""
    sender, asm = pair
    refused, peak = receive(asm, attack(sender, pad))
    assert peak < CAP + 2 * PAD_TO, peak  # the message being parsed, the cap at most: not 60 frames' worth
    assert refused is not None


def test_every_frame_of_an_envelope_counts_as_its_first(pair):
    sender, asm = pair
    seq = sender.counter.next()
    assert asm.add(ReceivedFrame.FromString(sender.frame(NODE, seq, 0, 2, b"x").SerializeToString())) is None
    with pytest.raises(FrameError, match="count"):
        asm.add(ReceivedFrame.FromString(sender.frame(NODE, seq, 1, 10**9, b"x").SerializeToString()))


def test_the_whole_message_counts_against_the_cap(pair):
    """An envelope of exactly the cap's bytes is more than the cap on the wire (its frames' heads)."""
    sender, asm = pair
    wire = [f.SerializeToString() for f in frames_of(sender, NODE, bytes(CAP))]
    with pytest.raises(FrameTooLarge):
        for raw in wire:
            asm.add(ReceivedFrame.FromString(raw))
    assert asm.add(ReceivedFrame.FromString(next(frames_of(sender, NODE, bytes(100))).SerializeToString())) is not None


def test_a_received_frame_is_its_wire_bytes_and_no_more():
    frame = pb.Frame(sender="a", seq=3, index=1, count=2, mac=b"m" * 32, run="r", data=b"hello")
    raw = frame.SerializeToString()
    got = ReceivedFrame.FromString(raw)
    assert bytes(got.data) == b"hello" and got.wire_bytes == len(raw) and got.head.sender == "a"
    for bad in (raw + unknown_field(8), unknown_field(8) + raw,
                raw + b"\x28\x05",  # data (5) as a varint: unknown to protobuf
                earlier_data_field(LARGE_HEAD) + raw, pb.Frame(sender="s" * LARGE_HEAD).SerializeToString()):
        with pytest.raises(DecodeError):
            ReceivedFrame.FromString(bad)


@pytest.fixture
def servers(tmp_path):
    s = Servers(tmp_path)
    s.transport.set_envelope_cap(CAP)
    yield s
    s.stop()


@pytest.mark.parametrize("pad", [unknown_field, earlier_data_field])
def test_a_daemon_refuses_padded_frames_and_serves_on(servers, pad):
    sender = servers.sealer(PEER)
    wire = list(attack(sender, pad, frames=4))
    assert refused_with(servers, "Forward", wire) == grpc.StatusCode.INVALID_ARGUMENT
    fits = list(frames_of(sender, NODE, pb.Envelope(shutdown=pb.Shutdown(step=1)).SerializeToString()))
    send(servers, RPCS["Forward"], [f.SerializeToString() for f in fits])  # the daemon serves on

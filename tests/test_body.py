"""An envelope's body with its payload kept apart (tahnode.net.body) and frames whose data is not
copied (tahnode.net.wire_frame): the bytes mean to protobuf exactly what a plain envelope means, the
receiver finds the payload in place, and anything else still parses the plain way."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from tahnode.net.body import Body, body_of, open_body, payload_field_bytes
from tahnode.net.framing import FrameError, open_envelope
from tahnode.net.wire_frame import OutgoingFrame, PaddedFrame, ReceivedFrame
from tahnode.proto import tahnode_pb2 as pb


def micro_batch(step: int, index: int, ids: list[int], payload: bytes = b"") -> pb.Envelope:
    env = pb.Envelope()
    mb = env.micro_batch
    mb.step, mb.index = step, index
    mb.sample_ids.extend(ids)
    mb.tensor.codec, mb.tensor.crc32 = "none", 7
    mb.tensor.shape.extend([2, 3])
    mb.tensor.payload = payload
    return env


@settings(max_examples=60, deadline=None)
@given(step=st.integers(0, 2**40), index=st.integers(0, 99), ids=st.lists(st.integers(0, 2**33), max_size=5),
       payload=st.binary(max_size=3000))
def test_a_body_with_its_payload_apart_is_the_same_envelope_and_opens_in_place(step, index, ids, payload):
    head = micro_batch(step, index, ids)
    body = body_of(head, memoryview(payload))
    whole = micro_batch(step, index, ids, payload)
    assert pb.Envelope.FromString(body.joined()) == whole  # what any protobuf parser (an older node) reads
    env, apart = open_body(body.joined())
    assert apart is not None and bytes(apart) == payload and env == head
    assert len(body) == len(body.joined())


def test_a_plain_envelope_opens_the_plain_way_and_the_payload_stays_in_it():
    whole = micro_batch(3, 1, [5, 6], b"\x01" * 100)
    env, apart = open_body(bytearray(whole.SerializeToString()))
    assert apart is None and env == whole
    step_end = pb.Envelope(step_end=pb.StepEnd(step=4))
    assert open_body(bytearray(step_end.SerializeToString())) == (step_end, None)


def test_a_payload_tail_after_another_body_kind_means_what_protobuf_says():
    """A tail naming the micro-batch after a head of another kind switches the oneof (protobuf's
    rule): the receiver then parses the plain way and sees the same."""
    body = body_of(pb.Envelope(step_end=pb.StepEnd(step=4)), b"abc").joined()
    env, apart = open_body(body)
    assert apart is None and env == pb.Envelope.FromString(bytes(body))
    assert env.WhichOneof("body") == "micro_batch" and env.micro_batch.tensor.payload == b"abc"


BODY = bytes(body_of(micro_batch(1, 0, [1]), b"x" * 300).joined())


@pytest.mark.parametrize("bad", [BODY[:-1], BODY[:-290], b"\xff" * 7],
                         ids=["last byte cut", "payload cut", "no varint end"])
def test_a_malformed_body_is_refused(bad):
    with pytest.raises(FrameError, match="malformed envelope"):
        open_envelope(bytearray(bad))


def test_an_empty_body_is_refused():
    with pytest.raises(FrameError, match="empty envelope"):
        open_envelope(bytearray())


def test_the_body_is_cut_into_chunks_of_views():
    payload = bytes(range(256)) * 40
    body = body_of(micro_batch(1, 0, [1]), payload)
    chunks = list(body.chunks(1000))
    assert [sum(len(p) for p in c) for c in chunks[:-1]] == [1000] * (len(chunks) - 1)
    assert b"".join(b"".join(c) for c in chunks) == bytes(body.joined())
    assert any(p.obj is payload for c in chunks for p in c)  # views of the payload itself, not copies
    assert list(Body((b"",)).chunks(8)) == [[]]


def test_a_frame_written_from_views_is_a_frame_and_reads_back_as_a_view():
    head = pb.Frame(sender="a", seq=9, index=1, count=3, mac=b"m" * 32, recipient="b", run="r", signature=b"s")
    out = OutgoingFrame(head, [b"hello ", memoryview(b"world")])
    raw = out.SerializeToString()
    plain = pb.Frame.FromString(raw)
    assert plain.data == b"hello world" and plain.sender == "a" and plain.seq == 9 and plain.signature == b"s"
    got = ReceivedFrame.FromString(raw)
    assert isinstance(got.data, memoryview) and got.data.obj is raw and bytes(got.data) == b"hello world"
    assert got.head == pb.Frame(sender="a", seq=9, index=1, count=3, mac=b"m" * 32, recipient="b", run="r",
                                signature=b"s")
    out.mac = b""  # writes reach the head, as on a Frame
    assert pb.Frame.FromString(out.SerializeToString()).mac == b""


def test_a_received_frame_keeps_protobufs_meaning_for_odd_encodings():
    """Within its bounds (no unknown fields, a small head: tests/test_frame_bounds.py)."""
    twice = pb.Frame(sender="a", data=b"first").SerializeToString() + pb.Frame(data=b"last").SerializeToString()
    got = ReceivedFrame.FromString(twice)
    assert bytes(got.data) == b"last" == pb.Frame.FromString(twice).data and got.sender == "a"
    assert bytes(ReceivedFrame.FromString(pb.Frame(sender="a").SerializeToString()).data) == b""
    with pytest.raises(DecodeError):
        ReceivedFrame.FromString(b"\x2a\x10abc")  # a data field longer than the bytes
    grouped = pb.Frame(data=b"d").SerializeToString() + b"\x6b\x6c"  # an empty group (field 13): unknown to a Frame
    with pytest.raises(PaddedFrame):
        ReceivedFrame.FromString(grouped)


def test_the_size_of_a_payload_kept_apart_is_the_size_it_adds_to_its_message():
    for n in (0, 1, 127, 128, 70_000):
        msg = pb.EncodedTensor(codec="none", crc32=1)
        assert (msg.ByteSize() + payload_field_bytes(n)
                == pb.EncodedTensor(codec="none", crc32=1, payload=b"x" * n).ByteSize())


def test_the_body_bytes_are_as_docs_wire_format_gives_them():
    body = body_of(pb.Envelope(micro_batch=pb.MicroBatch(step=1)), b"ab")
    assert bytes(body.joined()) == bytes.fromhex("0a020801" "0a06" "2a04" "3202" "6162")


def test_bytes_of_many_tiny_fields_go_to_protobufs_parser():
    """A neighbour cannot make the receiver scan a body or a frame field by field in Python: past a
    few dozen fields, protobuf's own parser reads it (the same meaning, at C speed)."""
    many = pb.Envelope(micro_batch=pb.MicroBatch(step=1)).SerializeToString() * 10_000  # 40 kB of 4-byte fields
    env, apart = open_body(bytearray(many) + body_of(pb.Envelope(), b"xy").joined())
    assert apart is None and env.micro_batch.step == 1 and env.micro_batch.tensor.payload == b"xy"
    frame = pb.Frame(sender="a").SerializeToString() * 1000 + pb.Frame(data=b"d").SerializeToString()
    got = ReceivedFrame.FromString(frame)
    assert got.sender == "a" and bytes(got.data) == b"d"

"""Golden vectors (tests/golden/vectors.json): this build must produce exactly the recorded bytes
for the recorded inputs, and decode the recorded bytes to exactly the recorded tensors; and decode
the messages of senders before CRC-32C (tests/golden/vectors-crc32.json) as they did."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tahnode import codecs
from tahnode.codecs import CodecContext
from tahnode.proto import tahnode_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import make_vectors  # noqa: E402

VECTORS = json.loads((Path(__file__).parent / "golden" / "vectors.json").read_text())
CRC32_VECTORS = json.loads((Path(__file__).parent / "golden" / "vectors-crc32.json").read_text())


def test_every_codec_has_a_vector():
    assert {v["codec"] for v in VECTORS} == set(codecs.CODECS)


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_encode_gives_the_recorded_bytes(vec):
    x = make_vectors.make_input(vec["shape"], vec["dtype"], vec["seed"], vec["outlier"])
    assert x.contiguous().view(torch.uint8).numpy().tobytes().hex() == vec["input_hex"]
    assert [m.hex() for m in make_vectors.messages(vec)] == vec["messages_hex"]


def test_the_vectors_carry_crc32c_and_the_older_ones_crc32_of_the_same_payloads():
    newer = {v["name"]: v for v in VECTORS}  # and vectors of what came after CRC-32C (tahquant's version 3)
    for old in CRC32_VECTORS:
        new = newer[old["name"]]
        assert new["decoded_hex"] == old["decoded_hex"]
        for a, b in zip(new["messages_hex"], old["messages_hex"], strict=True):
            ma, mb = codecs.parse_message(bytes.fromhex(a)), codecs.parse_message(bytes.fromhex(b))
            assert ((ma.checksum, mb.checksum) == (pb.CRC32C, pb.CRC32) and ma.payload == mb.payload
                    and ma.crc32 != mb.crc32)


@pytest.mark.parametrize("vec", VECTORS + CRC32_VECTORS,
                         ids=[v["name"] for v in VECTORS] + [f"{v['name']}-crc32" for v in CRC32_VECTORS])
def test_decode_gives_the_recorded_tensor(vec):
    ctx = CodecContext(sample_ids=vec.get("sample_ids"))
    for wire, want in zip(vec["messages_hex"], vec["decoded_hex"]):
        out = codecs.decode(codecs.parse_message(bytes.fromhex(wire)), ctx)
        assert out.contiguous().view(torch.uint8).numpy().tobytes().hex() == want

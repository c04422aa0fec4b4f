"""Golden vectors (tests/golden/vectors.json): this build must produce exactly the recorded bytes
for the recorded inputs, and decode the recorded bytes to exactly the recorded tensors."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tahnode import codecs
from tahnode.codecs import CodecContext

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import make_vectors  # noqa: E402

VECTORS = json.loads((Path(__file__).parent / "golden" / "vectors.json").read_text())


def test_every_codec_has_a_vector():
    assert {v["codec"] for v in VECTORS} == set(codecs.CODECS)


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_encode_gives_the_recorded_bytes(vec):
    x = make_vectors.make_input(vec["shape"], vec["dtype"], vec["seed"], vec["outlier"])
    assert x.contiguous().view(torch.uint8).numpy().tobytes().hex() == vec["input_hex"]
    assert [m.hex() for m in make_vectors.messages(vec)] == vec["messages_hex"]


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_decode_gives_the_recorded_tensor(vec):
    ctx = CodecContext(sample_ids=vec.get("sample_ids"))
    for wire, want in zip(vec["messages_hex"], vec["decoded_hex"]):
        out = codecs.decode(codecs.parse_message(bytes.fromhex(wire)), ctx)
        assert out.contiguous().view(torch.uint8).numpy().tobytes().hex() == want

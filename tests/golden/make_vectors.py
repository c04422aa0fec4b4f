"""Golden vectors of the wire format: small inputs and the exact bytes of their messages.

`python tests/golden/make_vectors.py` rewrites vectors.json; do that only with a version bump of
the codec whose layout changed or a new checksum (docs/wire-format.md), never to make a failing
test pass. vectors-crc32.json keeps the messages of senders before CRC-32C (decoded, never rewritten)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tahnode import codecs
from tahnode.codecs import CodecContext
from tahnode.kernels.amaq_ref import AmaqParams, AmaqState

HERE = Path(__file__).resolve().parent
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_input(shape, dtype: str, seed: int, outlier: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x.reshape(-1, shape[-1])[::3, 1] *= outlier  # a strong channel: tiles that meet the tau rule
    return x.to(DTYPE_NAMES[dtype])


# "codec": the user's name (get_codec); the messages carry its wire name and version (tahquant-paper: tahquant v1)
CASES = [
    dict(name="none-fp32", codec="none", params={}, shape=[2, 3], dtype="float32", seed=1, outlier=1.0),
    dict(name="naive-6bit", codec="naive", params={"bits": 6}, shape=[3, 8], dtype="float32", seed=2, outlier=1.0),
    dict(name="group-4bit-g8", codec="group", params={"bits": 4, "group_size": 8}, shape=[2, 16], dtype="float32",
         seed=3, outlier=1.0),
    dict(name="tahquant-g8-fp16", codec="tahquant-paper", params={"group_size": 8}, shape=[1, 5, 16], dtype="float16",
         seed=4, outlier=12.0),
    dict(name="pertoken-6bit-g8-bf16-short-tile", codec="pertoken", params={"bits": 6, "group_size": 8}, shape=[3, 20],
         dtype="bfloat16", seed=8, outlier=1000.0),
    dict(name="pertoken-4bit-g16-fp32", codec="pertoken", params={"bits": 4, "group_size": 16}, shape=[2, 2, 32],
         dtype="float32", seed=9, outlier=1.0),
    dict(name="tahquant-rice-g8-fp16-blocks", codec="tahquant", params={"group_size": 8, "qmax": 12},
         shape=[1, 4, 12], dtype="float16", seed=12, outlier=12.0),
    dict(name="tahquant-rice-g32-bf16-k0", codec="tahquant", params={"group_size": 32, "qmax": 1},
         shape=[2, 3, 64], dtype="bfloat16", seed=13, outlier=12.0),
    dict(name="tahquant-rice-g128-w96-bf16-blocks", codec="tahquant", params={"group_size": 128, "qmax": 12},
         shape=[2, 3, 96], dtype="bfloat16", seed=14, outlier=12.0),
    dict(name="amaq-learned", codec="amaq", params={"anneal_steps": 0}, shape=[2, 4, 8], dtype="float32", seed=6,
         outlier=1.0, gates=[-6.0, -2.0, 0.0, 0.5, 1.0, 2.0, 4.0, 6.0]),
    dict(name="aqsgd-two-visits", codec="aqsgd", params={"bits": 4, "group_size": 8}, shape=[2, 2, 8], dtype="float32",
         seed=7, outlier=1.0, sample_ids=[5, 2]),
]


def messages(case: dict) -> list[bytes]:
    """The wire bytes of the case's message(s), encoded by this build."""
    codec = codecs.get_codec(case["codec"], **case["params"])
    x = make_input(case["shape"], case["dtype"], case["seed"], case["outlier"])
    ctx = CodecContext(sample_ids=case.get("sample_ids"))
    if "gates" in case:
        ctx.amaq_state = AmaqState(case["shape"][-1], AmaqParams(**case["params"]))
        with torch.no_grad():
            ctx.amaq_state.gate.copy_(torch.tensor(case["gates"]))
    out = [codecs.serialize(codec.encode(x, ctx))]
    if case["codec"] == "aqsgd":  # second visit: the delta against the cache
        out.append(codecs.serialize(codec.encode(x * 1.1 + 0.05, ctx)))
    return out


def main() -> None:
    vectors = []
    for case in CASES:
        x = make_input(case["shape"], case["dtype"], case["seed"], case["outlier"])
        entry = {**case, "input_hex": x.contiguous().view(torch.uint8).numpy().tobytes().hex()}
        entry["messages_hex"] = [m.hex() for m in messages(case)]
        ctx = CodecContext(sample_ids=case.get("sample_ids"))
        entry["decoded_hex"] = [
            codecs.decode(codecs.parse_message(bytes.fromhex(m)), ctx)
            .contiguous().view(torch.uint8).numpy().tobytes().hex()
            for m in entry["messages_hex"]
        ]
        vectors.append(entry)
    (HERE / "vectors.json").write_text(json.dumps(vectors, indent=1) + "\n")
    print(f"wrote {len(vectors)} vectors to {HERE / 'vectors.json'}")


if __name__ == "__main__":
    main()

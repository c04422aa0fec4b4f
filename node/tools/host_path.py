"""A message's whole host path, as a stage sends and receives it: tensor -> codec message ->
envelope -> sealed frames (HMAC and signature), and frames -> envelope -> decoded tensor.

`tahnode bench kernels` times it beside `x.clone()` and a raw copy of the tensor to pinned host
memory: the honest limit of a message is one copy of its compressed bytes over PCIe (issue 27)."""

from __future__ import annotations

import torch

from ..codecs import decode, get_codec
from ..codecs.base import receive_buffer
from ..net.auth import Sealer, SwarmKey
from ..net.body import Body, body_of
from ..net.framing import Reassembler, frames_of, open_envelope
from ..net.identity import NodeKey
from ..net.wire_frame import ReceivedFrame
from ..proto import tahnode_pb2 as pb

__all__ = ["HostPath", "CODECS"]

CODECS = ("none", "naive", "tahquant-paper", "tahquant", "pertoken")  # the codecs whose host path the benches measure


class HostPath:
    """Two ends of one link in this process: `send` is what the sending stage does with a tensor up
    to the frames it hands to gRPC, `receive` what the receiving stage does with them."""

    def __init__(self, codec: str, **params):
        key, identity = SwarmKey("host-path"), NodeKey.generate()
        self.codec = get_codec(codec, **params)
        self.sender = Sealer(key, "a", run="bench", identity=identity)
        self.receiver = Sealer(key, "b", run="bench")
        self.public = identity.public

    def send(self, x: torch.Tensor) -> list[bytes]:
        """The wire bytes of each frame of `x`'s envelope, as gRPC writes them."""
        env = pb.Envelope()
        env.micro_batch.step = 1
        payload = self.codec.encode_apart(x, env.micro_batch.tensor).finish()  # as the stage does (Worker._message)
        return self.frames(body_of(env, payload))

    def frames(self, body: Body) -> list[bytes]:
        return [frame.SerializeToString() for frame in frames_of(self.sender, "b", body)]

    def message(self, wire, allocate=bytearray) -> tuple[pb.EncodedTensor, memoryview | None]:
        """The codec message the frames' wire bytes carry, and its payload where it travelled apart:
        each frame parsed and checked, the envelope reassembled (into `allocate(n)`) and parsed."""
        asm = Reassembler(self.receiver, peer_keys={"a": self.public}, allocate=allocate)
        for data in wire:
            body = asm.add(ReceivedFrame.FromString(data))
        env, payload = open_envelope(body)
        return env.micro_batch.tensor, payload

    def receive(self, wire: list[bytes], device: torch.device | str) -> torch.Tensor:
        """The tensor on `device`, received as a stage on that device receives it; each list of
        frames is received once (a second time is a replay)."""
        msg, payload = self.message(wire, receive_buffer(device))
        return decode(msg, device=device, payload=payload)

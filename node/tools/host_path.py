"""A message's whole host path, as a stage sends and receives it: tensor -> codec message ->
envelope -> sealed frames (HMAC and signature), and frames -> envelope -> decoded tensor.

`tahnode bench kernels` times it beside `x.clone()` and a raw copy of the tensor to pinned host
memory: the honest limit of a message is one copy of its compressed bytes over PCIe (issue 27)."""

from __future__ import annotations

import torch

from ..codecs import decode, get_codec
from ..net.auth import Sealer, SwarmKey
from ..net.framing import Reassembler, frames_of, parse_envelope
from ..net.identity import NodeKey
from ..proto import tahnode_pb2 as pb

__all__ = ["HostPath", "CODECS"]

CODECS = ("none", "naive", "tahquant", "pertoken")  # the codecs whose host path the benchmarks measure


class HostPath:
    """Two ends of one link in this process: `send` is what the sending stage does with a tensor up
    to the frames it hands to gRPC, `receive` what the receiving stage does with them."""

    def __init__(self, codec: str, **params):
        key, identity = SwarmKey("host-path"), NodeKey.generate()
        self.codec = get_codec(codec, **params)
        self.sender = Sealer(key, "a", run="bench", identity=identity)
        self.receiver = Sealer(key, "b", run="bench")
        self.public = identity.public

    def send(self, x: torch.Tensor) -> list[pb.Frame]:
        env = pb.Envelope()
        env.micro_batch.step = 1
        self.codec.encode(x, out=env.micro_batch.tensor)  # in place, as the stage does (Worker._message)
        return self.frames(env)

    def frames(self, env: pb.Envelope) -> list[pb.Frame]:
        return list(frames_of(self.sender, "b", env.SerializeToString()))

    def message(self, frames) -> pb.EncodedTensor:
        """The codec message the frames carry: reassembled, checked, the envelope parsed."""
        asm = Reassembler(self.receiver, peer_keys={"a": self.public})
        for frame in frames:
            data = asm.add(frame)
        return parse_envelope(data).micro_batch.tensor

    def receive(self, frames: list[pb.Frame], device: torch.device | str) -> torch.Tensor:
        """The tensor on `device`; each list of frames is received once (a second time is a replay)."""
        return decode(self.message(frames), device=device)

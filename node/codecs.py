"""The codec registry: one interface, encode(tensor, ctx) -> EncodedTensor and
decode(EncodedTensor, ctx) -> tensor, for every codec; it validates and dispatches only.

The byte layouts and the arithmetic are specified in tahnode.kernels.<codec>_ref (pure torch,
CPU or GPU); CUDA tensors go to the Triton kernels where a codec has them."""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tahnode.kernels import aqsgd_ref, amaq_ref, group_ref, naive_ref, tahquant_ref
from tahnode.kernels.dispatch import implementation
from tahnode.kernels.quant_ref import check_finite
from tahnode.kernels.wire import CodecError, from_bytes
from tahnode.proto import tahnode_pb2 as pb

__all__ = [
    "CodecError",
    "CodecContext",
    "Codec",
    "CODECS",
    "get_codec",
    "parse_param_args",
    "decode",
    "serialize",
    "parse_message",
    "bits_per_element",
    "checksum",
]

MAX_NDIM = 8
MAX_ELEMENTS = 1 << 31  # refuse headers that would describe more than 2**31 elements

DTYPES = {torch.float32: pb.FLOAT32, torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


@dataclass
class CodecContext:
    """Per-stream state of one direction of one link; each end keeps its own, in step.

    sample_ids: dataset ids of the rows (dim 0) of the tensor, needed by aqsgd.
    aqsgd_cache: aqsgd's per-sample cache m(xi), identical on both ends.
    amaq_state: the sender's learnable AMAQ gates (the receiver reads the bits from the message).
    """

    sample_ids: list[int] | None = None
    aqsgd_cache: aqsgd_ref.AqsgdCache = field(default_factory=aqsgd_ref.AqsgdCache)
    amaq_state: amaq_ref.AmaqState | None = None


class Codec:
    """Base class: subclasses set name, version, Params and implement the payload functions."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    Params: ClassVar[type]

    def __init__(self, **params: Any):
        try:
            self.params = self.Params(**params)
        except TypeError as exc:
            known = ", ".join(f.name for f in dataclasses.fields(self.Params)) or "none"
            raise CodecError(f"{self.name}: unknown parameter ({exc}); known parameters: {known}") from None
        if hasattr(self.params, "validate"):
            self.params.validate()

    # -- subclasses -------------------------------------------------------------------------
    def encode_payload(self, x: torch.Tensor, ctx: CodecContext) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def decode_payload(self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, header: dict[str, float], ctx: CodecContext) -> torch.Tensor:
        raise NotImplementedError

    # -- the interface ----------------------------------------------------------------------
    def header_params(self) -> dict[str, float]:
        return {f.name: float(getattr(self.params, f.name)) for f in dataclasses.fields(self.params)}

    def encode(self, x: torch.Tensor, ctx: CodecContext | None = None) -> pb.EncodedTensor:
        ctx = ctx if ctx is not None else CodecContext()
        _check_input(x, self.name)
        payload, extra = self.encode_payload(x, ctx)
        data = payload.cpu().numpy().tobytes()
        msg = pb.EncodedTensor(codec=self.name, version=self.version, shape=list(x.shape), dtype=DTYPES[x.dtype], payload=data)
        for key, value in {**self.header_params(), **extra}.items():
            msg.params[key] = value
        msg.crc32 = checksum(msg)
        return msg

    def decode(self, msg: pb.EncodedTensor, ctx: CodecContext | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        ctx = ctx if ctx is not None else CodecContext()
        if msg.codec != self.name:
            raise CodecError(f"message was encoded with codec {msg.codec!r}, not {self.name!r}")
        if msg.version != self.version:
            raise CodecError(f"codec {self.name} version {msg.version} is not supported (this build reads version {self.version})")
        shape, dtype = _check_header(msg)
        if checksum(msg) != msg.crc32:
            raise CodecError(f"{self.name} message checksum mismatch: the message was corrupted in transit")
        payload = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8) if msg.payload else torch.empty(0, dtype=torch.uint8)
        return self.decode_payload(payload.to(device), shape, dtype, dict(msg.params), ctx)

    @classmethod
    def from_header(cls, header: dict[str, float], extra: tuple[str, ...] = ()) -> "Codec":
        """The codec instance a message's params describe (unknown or non-integral values rejected)."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls.Params):
            if f.name not in header:
                raise CodecError(f"{cls.name} header lacks parameter {f.name!r}")
            value = header[f.name]
            if f.type in ("int", int):
                if not math.isfinite(value) or value != int(value):
                    raise CodecError(f"{cls.name} header parameter {f.name}={value} must be an integer")
                value = int(value)
            kwargs[f.name] = value
        unknown = set(header) - set(kwargs) - set(extra)
        if unknown:
            raise CodecError(f"{cls.name} header has unknown parameters: {', '.join(sorted(unknown))}")
        return cls(**kwargs)


def checksum(msg: pb.EncodedTensor) -> int:
    """CRC-32 (zlib) of the canonical header followed by the payload (docs/wire-format.md): codec
    name, 0, version u32, dtype u32, ndim u32, dims u64, then each param sorted by key as
    key, 0, value f64; all little-endian."""
    head = bytearray(msg.codec.encode() + b"\0")
    head += struct.pack("<III", msg.version, msg.dtype, len(msg.shape))
    head += struct.pack(f"<{len(msg.shape)}Q", *msg.shape)
    for key in sorted(msg.params):
        head += key.encode() + b"\0" + struct.pack("<d", msg.params[key])
    return zlib.crc32(msg.payload, zlib.crc32(bytes(head)))


def _check_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise CodecError(f"{name}: dtype {x.dtype} is not supported (float32, float16, bfloat16)")
    if x.dim() == 0 or x.numel() == 0:
        raise CodecError(f"{name}: cannot encode an empty or 0-d tensor (shape {list(x.shape)})")
    if x.dim() > MAX_NDIM or x.numel() > MAX_ELEMENTS:
        raise CodecError(f"{name}: tensor of shape {list(x.shape)} is too large to encode")


def _check_header(msg: pb.EncodedTensor) -> tuple[tuple[int, ...], torch.dtype]:
    shape = tuple(int(d) for d in msg.shape)
    if not 1 <= len(shape) <= MAX_NDIM:
        raise CodecError(f"{msg.codec}: shape {list(shape)} must have 1..{MAX_NDIM} dims")
    if any(d < 1 for d in shape):
        raise CodecError(f"{msg.codec}: shape {list(shape)} has an empty dimension")
    if math.prod(shape) > MAX_ELEMENTS:
        raise CodecError(f"{msg.codec}: shape {list(shape)} describes more than 2**31 elements")
    if msg.dtype not in TORCH_DTYPES:
        raise CodecError(f"{msg.codec}: unknown or missing dtype {msg.dtype}")
    return shape, TORCH_DTYPES[msg.dtype]


CODECS: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    CODECS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class NoParams:
    pass


@register
class NoneCodec(Codec):
    """The uncompressed baseline: the tensor's own bytes, row-major, little-endian."""

    name = "none"
    Params = NoParams

    def encode_payload(self, x, ctx):
        check_finite(x, self.name)  # a NaN activation means a diverged run: say so at the source
        return x.detach().contiguous().reshape(-1).view(torch.uint8), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if payload.numel() != expected:
            raise CodecError(f"none payload has {payload.numel()} bytes, shape {list(shape)} of {dtype} needs {expected}")
        return from_bytes(payload, dtype).reshape(shape)


@register
class NaiveCodec(Codec):
    """k-bit symmetric absmax, one fp16 scale per channel (with a shared power-of-two exponent)."""

    name = "naive"
    Params = naive_ref.NaiveParams

    def encode_payload(self, x, ctx):
        payload, e = implementation("naive", x).encode(x.detach(), self.params)
        return payload, {"exp": float(e)}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        params = self.from_header(header, extra=("exp",)).params
        e = header.get("exp", math.nan)
        if not math.isfinite(e) or e != int(e):
            raise CodecError(f"naive header has an invalid scale exponent {e}")
        return implementation("naive", payload).decode(payload, shape, params, int(e), dtype)


@register
class GroupCodec(Codec):
    """k-bit asymmetric min-max per tile of G channels, fp16 zero-point and scale."""

    name = "group"
    Params = group_ref.GroupParams

    def encode_payload(self, x, ctx):
        return group_ref.encode(x.detach(), self.params), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        return group_ref.decode(payload, shape, self.from_header(header).params, dtype)


@register
class TahQuantCodec(Codec):
    """TAH-Quant: entropy-guided INT3/INT4 per token, adaptive pivot swap + Hadamard per tile."""

    name = "tahquant"
    Params = tahquant_ref.TahQuantParams

    def encode_payload(self, x, ctx):
        return implementation("tahquant", x).encode(x.detach(), self.params), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        return implementation("tahquant", payload).decode(payload, shape, self.from_header(header).params, dtype)


@register
class AqsgdCodec(Codec):
    """AQ-SGD: quantized delta against a per-sample cache kept on both ends (ctx.aqsgd_cache)."""

    name = "aqsgd"
    Params = aqsgd_ref.AqsgdParams

    def _ids(self, n: int, ctx: CodecContext) -> list[int]:
        if ctx.sample_ids is None:
            raise CodecError("aqsgd needs the sample ids of the rows in the codec context")
        return list(ctx.sample_ids)

    def encode_payload(self, x, ctx):
        return aqsgd_ref.encode(x.detach(), self._ids(x.shape[0], ctx), ctx.aqsgd_cache, self.params), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        params = self.from_header(header).params
        return aqsgd_ref.decode(payload, shape, dtype, self._ids(shape[0], ctx), ctx.aqsgd_cache, params)


@register
class AmaqCodec(Codec):
    """AMAQ: per-channel learned integer bit widths (the sender's ctx.amaq_state), min-max per channel."""

    name = "amaq"
    Params = amaq_ref.AmaqParams

    def state_for(self, channels: int, ctx: CodecContext, device=None) -> amaq_ref.AmaqState:
        """The sender's gates, created on first use (Q = 0)."""
        if ctx.amaq_state is None:
            ctx.amaq_state = amaq_ref.AmaqState(channels, self.params, device=device)
        if ctx.amaq_state.gate.numel() != channels:
            raise CodecError(f"amaq: state has {ctx.amaq_state.gate.numel()} channels, tensor has {channels}")
        return ctx.amaq_state

    def encode_payload(self, x, ctx):
        state = self.state_for(x.shape[-1], ctx, x.device)
        return amaq_ref.encode(x.detach(), state.bits()), {"step": float(state.step)}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        return amaq_ref.decode(payload, shape, dtype)


def get_codec(name: str, **params: Any) -> Codec:
    """A codec by registry name, with parameters overriding its defaults."""
    if name not in CODECS:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(CODECS))}")
    return CODECS[name](**params)


def parse_param_args(name: str, items: list[str]) -> dict[str, Any]:
    """Parse `k=v` strings into typed parameters of codec `name` (for the CLI and TOML configs)."""
    if name not in CODECS:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(CODECS))}")
    fields = {f.name: f for f in dataclasses.fields(CODECS[name].Params)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CodecError(f"codec parameter {item!r} is not of the form key=value")
        if key not in fields:
            raise CodecError(f"{name} has no parameter {key!r}; known: {', '.join(fields) or 'none'}")
        kind = fields[key].type
        try:
            out[key] = int(raw) if kind in ("int", int) else float(raw)
        except ValueError:
            raise CodecError(f"{name} parameter {key}={raw!r} is not a number") from None
    return out


def serialize(msg: pb.EncodedTensor) -> bytes:
    """Deterministic wire bytes of a message (map entries sorted by key)."""
    return msg.SerializeToString(deterministic=True)


def parse_message(data: bytes) -> pb.EncodedTensor:
    """Parse wire bytes into an EncodedTensor, turning protobuf's errors into CodecError."""
    msg = pb.EncodedTensor()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # google.protobuf.message.DecodeError is not a ValueError
        raise CodecError(f"malformed EncodedTensor message: {exc}") from None
    return msg


def decode(msg: pb.EncodedTensor, ctx: CodecContext | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decode any message with the codec it names (its parameters come from its header)."""
    if msg.codec not in CODECS:
        raise CodecError(f"unknown codec {msg.codec!r} in message; known codecs: {', '.join(sorted(CODECS))}")
    return _bare(CODECS[msg.codec]).decode(msg, ctx, device)


def _bare(cls: type[Codec]) -> Codec:
    """An instance whose parameters come from the message header (decode never uses self.params)."""
    inst = cls.__new__(cls)
    inst.params = None
    return inst


def bits_per_element(msg: pb.EncodedTensor) -> float:
    """Wire size of the whole serialized message, header included, per tensor element."""
    return 8.0 * len(serialize(msg)) / math.prod(msg.shape)

"""The codec interface and its registry: encode(tensor, ctx) -> EncodedTensor and
decode(EncodedTensor, ctx) -> tensor for every codec; the wire header is validated here.

The byte layouts and the arithmetic are specified in tahnode.kernels.<codec>_ref (pure torch);
tahnode.codecs.builtin registers the eight codecs, which dispatch CUDA tensors to Triton kernels. A codec
has a user's name (`name`: configs, flags) and a wire identity (`wire_name`, `version`: what its messages say)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import torch

from ..kernels.wire import CodecError
from ..proto import tahnode_pb2 as pb
from ..proto.parse import parse
from .host import PendingPayload, checksum, copy_to_host
from .state import CodecContext, CodecState

__all__ = [
    "CodecError",
    "CodecContext",
    "CodecState",
    "Codec",
    "register",
    "CODECS",
    "WIRE",
    "wire_class",
    "get_codec",
    "parse_param_args",
    "decode",
    "serialize",
    "parse_message",
    "bits_per_element",
    "checksum",
    "payload_tensor",
]

MAX_NDIM = 8
MAX_ELEMENTS = 1 << 31  # refuse headers that would describe more than 2**31 elements

DTYPES = {torch.float32: pb.FLOAT32, torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


class Codec:
    """Base class: subclasses set name, Params (whose defaults are a run's), version (and wire_name
    where it is not name) and implement the payload functions. Every parameter travels in a message."""

    name: ClassVar[str]       # the user's name: the registry's, configs', flags'
    wire_name: ClassVar[str]  # the name its messages carry: name unless the class sets it (register)
    version: ClassVar[int] = 1  # its messages' version: (wire_name, version) picks the decoder
    Params: ClassVar[type]
    # the parameters a run's precision schedule sends with by default (codec.forward_high_params
    # unset): its first and last steps at these, e.g. 8 bits; {} for none
    schedule_params: ClassVar[dict[str, float]] = {}
    # parameters of older builds that are gone, with what to write instead (refused with that advice)
    gone_params: ClassVar[dict[str, str]] = {}
    keeps_stream_state: ClassVar[bool] = False  # both ends update per-stream state on every message
    # per-group fp16 zero/scale and no shared exponent: values around 1e-7 and below underflow, so
    # the pipeline scales gradients by a power of two before encoding (tahnode.pipeline.streams)
    needs_prescale: ClassVar[bool] = False
    # a codec with only its pure-torch reference computes on the CPU whatever the tensor's device:
    # torch's CUDA arithmetic (fused multiply-adds) makes other bytes than the specification's
    on_cpu: ClassVar[bool] = False

    def __init__(self, **params: Any):
        self.refuse_gone(params)
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

    def decode_payload(self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                       header: dict[str, float], ctx: CodecContext) -> torch.Tensor:
        raise NotImplementedError

    def sender_state(self, channels: int, device: torch.device | str = "cpu") -> CodecState:
        """What the sending stage keeps across the streams of one direction (base: nothing)."""
        return CodecState()

    @classmethod
    def refuse_gone(cls, names) -> None:
        """A CodecError saying what to write instead where `names` has a parameter that is gone."""
        gone = sorted(set(names) & set(cls.gone_params))
        if gone:
            raise CodecError(f"{cls.name} has no parameter {gone[0]!r} any more: {cls.gone_params[gone[0]]}")

    # -- the interface ----------------------------------------------------------------------
    def header_params(self) -> dict[str, float]:
        return {f.name: float(getattr(self.params, f.name)) for f in dataclasses.fields(self.params)}

    def sent(self, msg: pb.EncodedTensor) -> bool:
        """Whether `msg` is what this codec, with these parameters, sends: its wire name, version and
        every parameter. A receiver decodes only its run's own (finding 3 of issue 39: a peer's grid
        or group size sets how much a decoder unpacks before anything else is checked)."""
        return msg.codec == self.wire_name and msg.version == self.version and all(
            msg.params.get(name) == value for name, value in self.header_params().items())

    def encode(self, x: torch.Tensor, ctx: CodecContext | None = None,
               out: pb.EncodedTensor | None = None) -> pb.EncodedTensor:
        """`x` encoded as one whole message, into `out` if given (e.g. the tensor field of the
        envelope that will carry it: nesting a finished message in another copies its payload)."""
        msg = out if out is not None else pb.EncodedTensor()
        msg.payload = self.encode_apart(x, msg, ctx).finish().tobytes()
        return msg

    def encode_apart(self, x: torch.Tensor, out: pb.EncodedTensor, ctx: CodecContext | None = None,
                     overlap: bool = False) -> PendingPayload:
        """`x` encoded into `out` but for its payload, which comes back pending: its finish() gives
        the payload's bytes on the host, where the transport writes them to the wire from
        (tahnode.net.body), and writes the checksum. With `overlap`, the payload's copy to the host
        runs on a side stream beside the next compute (finish() on a thread that may wait)."""
        payload, extra = self._payload(x, ctx)
        return self.pending(x, payload, extra, out, overlap)

    def _payload(self, x: torch.Tensor, ctx: CodecContext | None) -> tuple[torch.Tensor, dict[str, float]]:
        _check_input(x, self.name)
        return self.encode_payload(x.cpu() if self.on_cpu else x, ctx if ctx is not None else CodecContext())

    def pending(self, x: torch.Tensor, payload: torch.Tensor, extra: dict[str, float], out: pb.EncodedTensor,
                overlap: bool = False) -> PendingPayload:
        """Every field of `x`'s message but the payload and its checksum, written into `out`, and the
        payload on its way to the host (a CPU payload uncopied; a CUDA payload's one copy, waited for
        unless `overlap`). Where a message's host path starts (tahnode.tools.bench_copies counts what follows)."""
        out.codec, out.version, out.dtype = self.wire_name, self.version, DTYPES[x.dtype]
        out.shape[:] = list(x.shape)
        out.checksum = pb.CRC32C
        for key, value in {**self.header_params(), **extra}.items():
            out.params[key] = value
        host, done = copy_to_host(payload)
        if done is not None and not overlap:
            done.synchronize()
            done = None
        return PendingPayload(out, host, done)

    def decode(self, msg: pb.EncodedTensor, ctx: CodecContext | None = None, device: torch.device | str = "cpu",
               payload=None) -> torch.Tensor:
        """`payload`: the message's payload where it travelled apart from it (a writable buffer;
        tahnode.net.body), else None (the message's own)."""
        ctx = ctx if ctx is not None else CodecContext()
        cls = wire_class(msg)
        if cls is not type(self):
            raise CodecError(f"a message of codec {msg.codec!r} version {msg.version} is {cls.name}'s, "
                             f"not {self.name}'s")
        shape, dtype = _check_header(msg)
        if checksum(msg, payload) != msg.crc32:
            raise CodecError(f"{self.name} message checksum mismatch: the message was corrupted in transit")
        header = dict(msg.params)
        payload = payload_tensor(msg, payload, receive_buffer("cpu" if self.on_cpu else device))
        if self.on_cpu:
            return self.decode_payload(payload, shape, dtype, header, ctx).to(device)
        return self.decode_payload(payload.to(device), shape, dtype, header, ctx)

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


def pinned_buffer(n: int):
    """n bytes of page-locked host memory as a writable buffer (a numpy view): where a received
    payload waits for its copy to the GPU, which then runs at PCIe speed, while one from pageable
    memory is staged by the driver (on the H100 of docs/benchmarks-log.md a 64 MiB pageable copy took
    42 ms, a pinned one 1.2 ms). torch's caching host allocator takes the block back for the next
    message once nothing refers to it. Needs CUDA."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()


def receive_buffer(device: torch.device | str) -> Callable[[int], Any]:
    """Where a payload bound for `device` is received: pinned_buffer for a GPU, else a bytearray."""
    return pinned_buffer if torch.device(device).type == "cuda" else bytearray


def copy_into(data, allocate: Callable[[int], Any] = bytearray):
    """`data` (bytes-like) copied once into a new writable buffer, `allocate(n)`: what a receiver
    holds of a payload (receive_buffer)."""
    if allocate is bytearray:
        return bytearray(data)
    out = allocate(memoryview(data).nbytes)
    memoryview(out).cast("B")[:] = memoryview(data).cast("B")
    return out


def payload_tensor(msg: pb.EncodedTensor, payload=None, allocate: Callable[[int], Any] = bytearray) -> torch.Tensor:
    """A received message's payload as a writable uint8 tensor on the host (where its host path ends
    and decoding starts): `payload` in place (a writable buffer kept apart from the message), or a
    copy of the message's own into `allocate(n)` (pinned_buffer for a GPU)."""
    if payload is None:
        payload = copy_into(msg.payload, allocate)
    return (torch.frombuffer(payload, dtype=torch.uint8) if memoryview(payload).nbytes
            else torch.empty(0, dtype=torch.uint8))


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


CODECS: dict[str, type[Codec]] = {}  # by the user's name
WIRE: dict[tuple[str, int], type[Codec]] = {}  # by what a message says: (codec, version)


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec known by its name and its messages by their wire name and version."""
    cls.wire_name = cls.__dict__.get("wire_name", cls.name)
    CODECS[cls.name] = cls
    WIRE[(cls.wire_name, cls.version)] = cls
    return cls


def wire_class(msg: pb.EncodedTensor) -> type[Codec]:
    """The codec whose messages `msg` is of, by its codec name and version."""
    if (msg.codec, msg.version) in WIRE:
        return WIRE[(msg.codec, msg.version)]
    versions = sorted(v for name, v in WIRE if name == msg.codec)
    if not versions:
        known = ", ".join(sorted({name for name, _ in WIRE}))
        raise CodecError(f"unknown codec {msg.codec!r} in message; known codecs: {known}")
    raise CodecError(f"codec {msg.codec} version {msg.version} is not supported "
                     f"(this build reads version {', '.join(map(str, versions))})")


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
    CODECS[name].refuse_gone(item.partition("=")[0] for item in items)
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
    return parse(pb.EncodedTensor, data, CodecError, "EncodedTensor message")


def decode(msg: pb.EncodedTensor, ctx: CodecContext | None = None, device: torch.device | str = "cpu",
           payload=None) -> torch.Tensor:
    """Decode any message with the codec it names (its parameters come from its header); `payload`:
    as Codec.decode."""
    return _bare(wire_class(msg)).decode(msg, ctx, device, payload)


def _bare(cls: type[Codec]) -> Codec:
    """An instance whose parameters come from the message header (decode never uses self.params)."""
    inst = cls.__new__(cls)
    inst.params = None
    return inst


def bits_per_element(msg: pb.EncodedTensor) -> float:
    """Wire size of the whole serialized message, header included, per tensor element."""
    return 8.0 * len(serialize(msg)) / math.prod(msg.shape)

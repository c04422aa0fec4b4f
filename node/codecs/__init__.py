"""The codecs: one interface (`encode`, `decode`), a registry by name, and the per-stream state a
codec keeps behind hooks. The arithmetic is specified in tahnode.kernels (pure torch + Triton)."""

from . import builtin  # noqa: F401  (registers the eight codecs)
from .base import (CODECS, WIRE, Codec, CodecError, bits_per_element, checksum, decode, get_codec, parse_message,
                   parse_param_args, payload_tensor, register, serialize, wire_class)
from .host import PendingPayload
from .state import CodecContext, CodecState

__all__ = ["CODECS", "WIRE", "Codec", "CodecContext", "CodecError", "CodecState", "PendingPayload", "bits_per_element",
           "checksum", "decode", "get_codec", "parse_message", "parse_param_args", "payload_tensor", "register",
           "serialize", "wire_class"]

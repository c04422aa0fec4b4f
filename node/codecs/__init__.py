"""The codecs: one interface (`encode`, `decode`), a registry by name, and the per-stream state a
codec keeps behind hooks. The arithmetic is specified in tahnode.kernels (pure torch + Triton)."""

from . import builtin  # noqa: F401  (registers the six codecs)
from .base import (CODECS, Codec, CodecError, bits_per_element, checksum, decode, get_codec, parse_message,
                   parse_param_args, payload_tensor, register, serialize)
from .host import PendingPayload
from .state import CodecContext, CodecState

__all__ = ["CODECS", "Codec", "CodecContext", "CodecError", "CodecState", "PendingPayload", "bits_per_element",
           "checksum", "decode", "get_codec", "parse_message", "parse_param_args", "payload_tensor", "register",
           "serialize"]

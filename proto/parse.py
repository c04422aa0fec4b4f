"""Parsing untrusted bytes into one of tahnode's protobuf messages, with protobuf's own errors
(google.protobuf.message.DecodeError is not a ValueError) turned into the caller's error class."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["parse"]

M = TypeVar("M")


def parse(message_type: type[M], data: bytes, error: type[Exception], what: str) -> M:
    """`message_type` parsed from `data`; raises `error("malformed <what>: ...")` if it is not one."""
    msg = message_type()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeWarning-derived errors, ...
        raise error(f"malformed {what}: {exc}") from None
    return msg

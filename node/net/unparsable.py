"""A gRPC server interceptor that answers a request which does not parse as its message type with
INVALID_ARGUMENT and a clear text (gRPC itself would log an error and answer UNKNOWN)."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

__all__ = ["RefuseUnparsable"]


class _Unparsable:
    """What the guarded deserializer returns for bytes that are not a message of the type."""

    def __init__(self, type_name: str, reason: str):
        self.type_name, self.reason = type_name, reason


def _guarded(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, ValueError) as exc:
            owner = getattr(deserializer, "__self__", None)
            descriptor = getattr(owner, "DESCRIPTOR", None)
            return _Unparsable(descriptor.name if descriptor is not None else getattr(owner, "__name__", "request"),
                               str(exc))

    return parse


async def _refuse(context, bad: _Unparsable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request does not parse as a {bad.type_name} message: {bad.reason}")


def _unary_request(behavior):
    async def handle(request, context):
        if isinstance(request, _Unparsable):
            await _refuse(context, request)
        return await behavior(request, context)

    return handle


def _unary_request_streaming_reply(behavior):
    async def handle(request, context):
        if isinstance(request, _Unparsable):
            await _refuse(context, request)
        async for reply in behavior(request, context):
            yield reply

    return handle


def _checked_stream(requests, context):
    async def stream():
        async for request in requests:
            if isinstance(request, _Unparsable):
                await _refuse(context, request)
            yield request

    return stream()


def _streaming_request(behavior):
    async def handle(requests, context):
        return await behavior(_checked_stream(requests, context), context)

    return handle


class RefuseUnparsable(grpc.aio.ServerInterceptor):
    """Wraps every method's deserializer: unparsable bytes reach no servicer code."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming and handler.response_streaming:
            return handler  # no bidirectional methods here
        kw = {"request_deserializer": _guarded(handler.request_deserializer),
              "response_serializer": handler.response_serializer}
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_streaming_request(handler.stream_unary), **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_unary_request_streaming_reply(handler.unary_stream), **kw)
        return grpc.unary_unary_rpc_method_handler(_unary_request(handler.unary_unary), **kw)

"""The gRPC transport between two transports in one process (real gRPC on loopback): a flush at
the end of a run returns only once the peer has read every envelope, so closing right after it
loses nothing, even when the peer is slow to take them in."""

from __future__ import annotations

import asyncio

from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.grpc_transport import GrpcTransport
from tahnode.net.identity import NodeKey
from tahnode.net.transport import FORWARD
from tahnode.proto import tahnode_pb2 as pb


def test_flush_then_close_loses_nothing_a_slow_peer_has_not_read_yet():
    key = SwarmKey("test-token")
    count, size = 40, 200_000

    async def scenario() -> list[int]:
        a, b = NodeKey.generate(), NodeKey.generate()
        sender, receiver = GrpcTransport(Sealer(key, "a", identity=a), "127.0.0.1:0"), GrpcTransport(Sealer(key, "b", identity=b), "127.0.0.1:0")
        receiver.peer_keys["a"] = a.public  # "a" is its neighbour: its frames are signed by this key
        receiver.inbox = asyncio.Queue(maxsize=1)  # the peer takes envelopes in one by one: gRPC buffers the rest
        await receiver.start()
        await sender.start()
        sender.set_peer(FORWARD, "b", receiver.address)
        got: list[int] = []

        async def slow_reader() -> None:
            while True:
                item = await receiver.inbox.get()
                if item.envelope is not None:
                    got.append(item.envelope.micro_batch.index)
                await asyncio.sleep(0.005)

        reader = asyncio.create_task(slow_reader())
        for k in range(count):
            # bulk, so that frames queue in gRPC's buffers while the peer is slow
            env = pb.Envelope(micro_batch=pb.MicroBatch(index=k, tensor=pb.EncodedTensor(payload=bytes(size))))
            await sender.send(FORWARD, env, sender.generation(FORWARD))
        await sender.flush(30.0)
        await sender.close()
        await asyncio.sleep(0.5)
        reader.cancel()
        await receiver.close()
        return got

    assert asyncio.run(scenario()) == list(range(count))

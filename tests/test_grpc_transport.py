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


def linked_pair(key: SwarmKey) -> tuple[GrpcTransport, GrpcTransport, NodeKey]:
    """A sender "a" and a receiver "b" on loopback (not started), the receiver taking "a"'s frames; b's key."""
    a, b = NodeKey.generate(), NodeKey.generate()
    sender, receiver = (GrpcTransport(Sealer(key, "a", identity=a), "127.0.0.1:0"),
                        GrpcTransport(Sealer(key, "b", identity=b), "127.0.0.1:0"))
    receiver.peer_keys["a"] = a.public  # "a" is its neighbour: its frames are signed by this key
    return sender, receiver, b


async def received_indices(receiver: GrpcTransport, count: int) -> list[int]:
    """The micro-batch indices of the next `count` envelopes the receiver gets (10 s each at most)."""
    got: list[int] = []
    while len(got) < count:
        item = await asyncio.wait_for(receiver.inbox.get(), 10)
        if item.envelope is not None:
            got.append(item.envelope.micro_batch.index)
    return got


def test_flush_then_close_loses_nothing_a_slow_peer_has_not_read_yet():
    key = SwarmKey("test-token")
    count, size = 40, 200_000

    async def scenario() -> list[int]:
        sender, receiver, _ = linked_pair(key)
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


def test_received_envelopes_wait_in_their_stream_once_the_inbox_holds_its_byte_budget():
    """The inbox holds at most INBOX_ENVELOPES of the run's largest envelopes in bytes: a peer
    that sends faster than the stage takes them up waits (gRPC's flow control), and everything
    arrives in order once the stage catches up."""
    from tahnode.net.links import INBOX_ENVELOPES
    from tahnode.pipeline.schedule import InboxOrder

    key, size, count = SwarmKey("test-token"), 250_000, 10

    async def scenario() -> tuple[int, int, list[int]]:
        sender, receiver, _ = linked_pair(key)
        receiver.set_envelope_cap(300_000)  # a budget of 4 x 300 kB: four envelopes of 250 kB, not five
        await receiver.start()
        await sender.start()
        sender.set_peer(FORWARD, "b", receiver.address)
        for k in range(count):
            await sender.send(FORWARD, pb.Envelope(micro_batch=pb.MicroBatch(
                index=k, tensor=pb.EncodedTensor(payload=bytes(size)))), sender.generation(FORWARD))
        await asyncio.sleep(2.0)
        queued = sum(1 for item in list(receiver.inbox._queue) if item.envelope is not None)
        held = receiver.inbox_bytes.held
        order, got = InboxOrder(receiver.inbox, receiver.inbox_bytes), []
        while len(got) < count:
            item = await asyncio.wait_for(order.next(), 10)
            if item.envelope is not None:
                got.append(item.envelope.micro_batch.index)
        await sender.close()
        await receiver.close()
        return queued, held, got

    queued, held, got = asyncio.run(scenario())
    assert queued == INBOX_ENVELOPES and held <= INBOX_ENVELOPES * 300_000
    assert got == list(range(count))


def test_after_a_flush_the_links_can_be_reset_and_used_for_a_new_stage():
    """A node that lost its stage flushed and ended its links; holding a stage again, it resets
    them: the new links reach the new peers, the former neighbours' keys and what the old holder
    had received but not handled are forgotten."""
    key = SwarmKey("test-token")

    async def scenario() -> tuple[list[int], bool]:
        sender, receiver, b = linked_pair(key)
        await receiver.start()
        await sender.start()
        sender.set_peer(FORWARD, "b", receiver.address, b.public)

        async def send(index: int) -> None:
            await sender.send(FORWARD, pb.Envelope(micro_batch=pb.MicroBatch(index=index)), sender.generation(FORWARD))

        await send(1)
        await sender.flush(10.0)  # the stage stopped: its links ended
        await sender.inbox_bytes.reserve(1234)  # taken up by the old holder's inbox order, never handled
        sender.reset_links()
        forgot = "b" not in sender.peer_keys and sender.inbox_bytes.held == 0
        sender.set_peer(FORWARD, "b", receiver.address, b.public)
        await send(2)
        got = await received_indices(receiver, 2)
        await sender.close()
        await receiver.close()
        return got, forgot

    assert asyncio.run(scenario()) == ([1, 2], True)


def test_a_link_pointed_away_and_back_delivers_the_first_envelope_of_its_new_stream():
    """A stream cancelled while it waited for an envelope (its peer was unnamed for a while: the
    coordinator declared it failed, then it rejoined) gives up its wait: it took the new stream's first
    envelope off the queue and dropped it, and a ring's stage 0 waited for that micro-batch until its
    stall timeout. A micro-batch for a link with no peer waits until one is named."""
    key = SwarmKey("test-token")

    async def scenario() -> tuple[list[int], bool, bool]:
        sender, receiver, _ = linked_pair(key)
        await receiver.start()
        await sender.start()
        sender.set_peer(FORWARD, "b", receiver.address)
        await asyncio.sleep(0.5)  # the stream is open, waiting for an envelope
        sender.set_peer(FORWARD, "", "")  # the peer is failed: no one to send to
        unnamed = await sender.wait_for_peer(FORWARD, 0.2)
        later = asyncio.ensure_future(sender.wait_for_peer(FORWARD, 5.0))
        await asyncio.sleep(0.2)
        sender.set_peer(FORWARD, "b", receiver.address)  # it rejoined
        named = await later
        for k in range(3):
            env = pb.Envelope(micro_batch=pb.MicroBatch(index=k, tensor=pb.EncodedTensor(payload=bytes(1000))))
            await sender.send(FORWARD, env, sender.generation(FORWARD))
        got = await received_indices(receiver, 3)
        await sender.close()
        await receiver.close()
        return got, unnamed, named

    got, unnamed, named = asyncio.run(scenario())
    assert got == [0, 1, 2] and not unnamed and named

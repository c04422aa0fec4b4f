"""A neighbour that holds the swarm token and lies (issue 26, the data plane): every value it sends
is checked where it enters, and nothing it sends ends a stage. In-process pipelines: a gradient norm
that is not a number (finding 1), activations too large to be real (2), a message in another codec
and a stale one with a forged header (7), an envelope from the wrong side (10); each stage keeps
training, and where a replay absorbs the attack the losses still equal single-process training."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from tahnode.codecs import checksum, get_codec
from tahnode.net.body import Body
from tahnode.net.transport import BACKWARD, FORWARD, Inbound
from tahnode.proto import tahnode_pb2 as pb
from tahnode.train.local import train_local
from test_pipeline_inproc import NONE, Swarm, build_run, dataset, train  # noqa: F401  (dataset is a fixture)


def tamper(swarm: Swarm, stage: int, change) -> list:
    """Stage `stage` sends its first envelope that `change(direction, envelope)` alters (returns an
    envelope for) altered; everything else goes as is (the replayed step too)."""
    original, changed = swarm.transports[stage].send, []

    async def send(direction, envelope, generation):
        whole = envelope.envelope() if isinstance(envelope, Body) else envelope  # a micro-batch travels as its body
        altered = None if changed else change(direction, whole)
        if altered is not None:
            changed.append(altered)
            envelope = altered
        return await original(direction, envelope, generation)

    swarm.transports[stage].send = send
    return changed


def copy(envelope: pb.Envelope) -> pb.Envelope:
    out = pb.Envelope()
    out.CopyFrom(envelope)
    return out


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan, 1e300])
def test_a_gradient_norm_that_is_not_a_number_is_refused_and_the_step_replayed(dataset, value):
    """Finding 1: n2 sends its last gradient of step 2 with grad_sumsq = -1 (the commit raised
    ValueError and the daemon exited), inf (every update zeroed by clipping), NaN (clipping off)."""
    run = build_run(5, **NONE)
    swarm = Swarm(run, dataset)

    def lie(direction, env):
        mb = env.micro_batch
        if (direction == BACKWARD and env.WhichOneof("body") == "micro_batch" and "grad_sumsq" in mb.extras
                and mb.step == 2):
            bad = copy(env)
            bad.micro_batch.extras["grad_sumsq"] = value
            return bad

    changed = tamper(swarm, 2, lie)
    asyncio.run(train(swarm, 5))
    assert len(changed) == 1
    assert swarm.workers[1].stats.offences.get("n2", 0) >= 1
    assert swarm.workers[0].stats.replays >= 1
    assert swarm.steps() == list(range(5)) and all(w.committed == 5 for w in swarm.workers)


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan, 0.0])
def test_a_step_end_with_a_false_norm_commits_with_what_the_stage_knows(dataset, value):
    """n1 passes step 2's StepEnd on with a false global norm: below what n2 itself sent back (0 is
    less than n2's own gradient), negative, inf or NaN. n2 commits in step with the others, clipping
    by the norm it knows, and counts the lie against n1."""
    run = build_run(5, **NONE)
    swarm = Swarm(run, dataset)

    def lie(direction, env):
        if direction == FORWARD and env.WhichOneof("body") == "step_end" and env.step_end.step == 2:
            bad = copy(env)
            bad.step_end.grad_sumsq = value
            return bad

    tamper(swarm, 1, lie)
    asyncio.run(train(swarm, 5))
    assert swarm.workers[2].stats.offences == {"n1": 1}
    assert all(w.committed == 5 for w in swarm.workers) and swarm.steps() == list(range(5))
    assert all(math.isfinite(x) for x in swarm.losses())
    for p in swarm.workers[2].model.parameters():
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("value", [3e38, 1e30, 2e6])
def test_finite_but_huge_activations_are_refused(dataset, value):
    """Finding 2: 3e38 is finite; the next stage's own output overflowed and its encode raised, which
    ended the daemon; 1e30 was accepted. Values beyond train.max_abs_value (1e6) are refused."""
    run = build_run(5, **NONE)
    swarm = Swarm(run, dataset)

    def lie(direction, env):
        mb = env.micro_batch
        if direction == FORWARD and env.WhichOneof("body") == "micro_batch" and mb.step == 1 and mb.index == 0:
            x = torch.frombuffer(bytearray(mb.tensor.payload), dtype=torch.float32).clone()
            x[7] = value
            bad = copy(env)
            bad.micro_batch.tensor.payload = x.numpy().tobytes()
            bad.micro_batch.tensor.crc32 = checksum(bad.micro_batch.tensor)
            return bad

    changed = tamper(swarm, 0, lie)
    asyncio.run(train(swarm, 5))
    assert len(changed) == 1
    assert swarm.workers[1].stats.offences == {"n0": 1}
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def _train_with_overflows(run, dataset, attempts: int) -> tuple["Swarm", list[int]]:
    """Train `run` in process with stage 1's output inf on the first `attempts` attempts of step 1
    (every micro-batch of the first ones, the first of the last): the swarm, and the attempts that
    overflowed."""
    swarm = Swarm(run, dataset)

    async def scenario():
        await swarm.start()
        stage1, hits = swarm.workers[1], []
        forward = stage1.model.forward

        def overflow(x):
            out = forward(x)
            if stage1.state.step == 1 and len(hits) < attempts:  # the last attempt's first micro-batch only
                if stage1.state.attempt not in hits:
                    hits.append(stage1.state.attempt)
                return out * math.inf
            return out

        stage1.model.forward = overflow
        try:
            await asyncio.wait_for(asyncio.gather(*(w.run(run.train.steps) for w in swarm.workers)), 120)
        finally:
            await swarm.close()
        return hits

    return swarm, asyncio.run(scenario())


def test_a_stage_whose_own_output_overflows_replays_instead_of_exiting(dataset):
    """A diverged model (its own output not finite) is a diverged step: replayed with a log line,
    no peer blamed, the daemon alive. Here stage 1's output is inf on step 1's first attempt."""
    run = build_run(4, **NONE)
    swarm, hits = _train_with_overflows(run, dataset, attempts=1)
    assert len(hits) == 1
    assert swarm.workers[0].stats.replays == 1 and not any(w.stats.offences for w in swarm.workers)
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def test_a_step_that_diverges_again_and_again_is_retried_ever_more_slowly(dataset, monkeypatch, caplog):
    """A model that diverged replayed its step about 20 times a second for ever. Now after
    DIVERGED_TRIES attempts in a row each next one waits twice as long (up to DIVERGED_WAIT_MAX_S,
    shortened here) with an error line that says what to do; a later stage's divergence reaches stage
    0 as such (SyncAck.diverged). Here stage 1's output is inf on the first 5 attempts of step 1."""
    from tahnode.pipeline import driver

    monkeypatch.setattr(driver, "DIVERGED_WAIT_MAX_S", 0.01)
    run = build_run(3, **NONE)
    with caplog.at_level("ERROR", logger="tahnode.pipeline"):
        swarm, hits = _train_with_overflows(run, dataset, attempts=5)
    assert len(hits) == 5
    waits = [r.getMessage() for r in caplog.records if "the next attempt in" in r.getMessage()]
    assert len(waits) == 5 - driver.DIVERGED_TRIES + 1 and "step 1 diverged 3 times in a row" in waits[0]
    assert swarm.workers[0].stats.replays == 5 and not any(w.stats.offences for w in swarm.workers)
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def test_the_count_of_a_diverged_step_and_what_follows_it():
    from tahnode.pipeline.state import AfterDivergence, Divergence

    d = Divergence(tries=3, wait_max_s=5.0)
    assert [d.failed(7, regroup_possible=True) for _ in range(3)][-1] == AfterDivergence(regroup=True)
    assert [d.failed(7, True).wait for _ in range(4)] == [2.0, 4.0, 5.0, 5.0]  # one regroup per step
    d.committed(5)  # the steps retrained after the regroup: the count goes on
    assert d.failed(7, True).wait == 5.0
    d.committed(8)  # the step that diverged committed at last
    assert [d.failed(9, False) for _ in range(4)] == [AfterDivergence(), AfterDivergence(), AfterDivergence(wait=1.0),
                                                      AfterDivergence(wait=2.0)]
    assert d.failed(10, False) == AfterDivergence()  # another step: a count of its own


@pytest.mark.parametrize("forward",
                         [{"codec.forward": "group"},
                          {"codec.forward": "tahquant-paper"}],
                         ids=["group", "tahquant-paper"])
def test_an_output_past_fp16_but_within_the_admitted_range_is_sent_not_replayed_for_ever(dataset, forward):
    """Issue 39, low: inputs a neighbour may send (within train.max_abs_value) can make a stage's own
    output exceed fp16, where a codec's fp16 zero-points and scales overflow (group's, AMAQ's,
    tahquant-paper's; the default tahquant keeps its scales under 65504 * qmax): the stage
    could not encode it, replayed the step, and the next attempt did the same, for ever, nobody
    blamed. Such an output is now moved down by a power of two before it is encoded (`scale_log2`,
    as gradients), and the next stage gets it back at its size. Here stage 1's output is 9e5 at its
    largest on every step."""
    run = build_run(3, **forward)
    assert run.train.max_abs_value > 9e5
    swarm = Swarm(run, dataset)
    received = []

    async def scenario():
        await swarm.start()
        stage1, stage2 = swarm.workers[1], swarm.workers[2]
        forward, decode = stage1.model.forward, stage2.codecs.decode

        def large(x):
            out = forward(x)
            return out * (9e5 / float(out.detach().abs().max()))

        def seen(direction, stream, mb, dtype, payload=None):
            x = decode(direction, stream, mb, dtype, payload)
            received.append((mb.scale_log2, float(x.abs().max())))
            return x

        stage1.model.forward, stage2.codecs.decode = large, seen
        try:
            await asyncio.wait_for(asyncio.gather(*(w.run(3) for w in swarm.workers)), 120)
        finally:
            await swarm.close()

    asyncio.run(scenario())
    assert swarm.steps() == [0, 1, 2] and swarm.workers[0].stats.replays == 0
    assert not any(w.stats.offences for w in swarm.workers)
    # moved down, back at its size
    assert received and all(k < 0 and 8.5e5 < top < 9.5e5 for k, top in received), received


def test_a_message_in_another_codec_or_with_a_forged_stale_header_is_refused(dataset):
    """Finding 7: the decoder was the message's choice (aqsgd messages with fresh sample ids grew a
    receiver's cache for ever) and a stale micro-batch was decoded before any header check."""
    run = build_run(4, **NONE)
    swarm = Swarm(run, dataset)
    aq = get_codec("aqsgd")

    def lie(direction, env):
        mb = env.micro_batch
        if direction == FORWARD and env.WhichOneof("body") == "micro_batch" and mb.step == 1 and mb.index == 0:
            bad = copy(env)
            x = torch.zeros(len(mb.sample_ids), run.train.seq_len, run.model.dim)
            from tahnode.codecs import CodecContext
            bad.micro_batch.tensor.CopyFrom(aq.encode(x, CodecContext(sample_ids=list(mb.sample_ids))))
            return bad

    tamper(swarm, 0, lie)
    asyncio.run(train(swarm, 4))
    assert swarm.workers[1].stats.offences == {"n0": 1}
    assert swarm.workers[1].codecs.cache_bytes() == 0  # no AQ-SGD state grew
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def test_a_stale_micro_batch_with_a_forged_header_is_counted_and_dropped(dataset):
    from tahnode.net.inproc import InProcessNetwork
    from tahnode.pipeline.worker import StageWorker

    run = build_run(4, **{"codec.forward": "aqsgd"})

    async def scenario():
        worker = StageWorker(run, 1, InProcessNetwork().transport("n1"), "cpu")
        worker.restart_step(0, 7)
        forged = pb.MicroBatch(step=0, index=0, attempt=6, sample_ids=list(range(10**4)),
                               tensor=pb.EncodedTensor(codec="aqsgd"))
        await worker.handle(Inbound(FORWARD, "n0", 1, pb.Envelope(micro_batch=forged)))
        worker.close()
        return worker

    worker = asyncio.run(scenario())
    assert worker.stats.offences == {"n0": 1} and worker.codecs.cache_bytes() == 0


@pytest.mark.parametrize("kind", ["shutdown", "gradient", "sync_ack_forward"])
def test_an_envelope_from_the_wrong_side_is_dropped(dataset, kind):
    """Finding 10: a message's direction was not tied to the neighbour that sent it: the next
    stage's Shutdown ended a stage; a previous stage could send gradients."""
    run = build_run(5, **NONE)
    sent = []

    def inject(worker):
        if worker.stage != 1 or worker.committed != 2 or sent:
            return
        if kind == "shutdown":  # from n2, on the backward direction: shutdowns only come from the previous stage
            item = Inbound(BACKWARD, "n2", 99, pb.Envelope(shutdown=pb.Shutdown(step=2)))
        elif kind == "gradient":  # from n0 (the previous stage) as if it were the next one
            item = Inbound(BACKWARD, "n0", 99, pb.Envelope(micro_batch=pb.MicroBatch(step=2, index=0, sample_ids=[1])))
        else:  # a sync ack travels backward only
            item = Inbound(FORWARD, "n0", 99, pb.Envelope(sync_ack=pb.SyncAck(step=2, abort=True)))
        sent.append(item)
        worker.t.inbox.put_nowait(Inbound(item.direction, item.sender, 99, None))
        worker.t.inbox.put_nowait(item)

    swarm = Swarm(run, dataset, on_step=inject)
    asyncio.run(train(swarm, 5))
    assert sent and swarm.workers[1].stats.offences == {sent[0].sender: 1}
    assert swarm.workers[0].stats.replays == 0 and all(w.committed == 5 for w in swarm.workers)
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def test_a_tensor_of_another_shape_is_refused_before_it_is_decoded(dataset):
    """Finding 12: `group` with 1-bit codes in 256-channel tiles decodes 28 times its payload; a
    forged shape made a stage allocate that before its shape check. The shape is checked first now."""
    run = build_run(4, **{"codec.forward": "group", "codec.forward_params": {"bits": 1, "group_size": 256}})
    swarm = Swarm(run, dataset)
    group = get_codec("group", bits=1, group_size=256)

    def lie(direction, env):
        mb = env.micro_batch
        if direction == FORWARD and env.WhichOneof("body") == "micro_batch" and mb.step == 1 and mb.index == 0:
            bad = copy(env)
            bad.micro_batch.tensor.CopyFrom(group.encode(torch.zeros(len(mb.sample_ids), run.train.seq_len,
                                                                     64 * run.model.dim)))
            return bad

    decoded = []

    async def scenario():
        await swarm.start()
        decode = swarm.workers[1].codecs.decode

        def watched(direction, stream, mb, dtype, payload=None):
            decoded.append(tuple(mb.tensor.shape))
            return decode(direction, stream, mb, dtype, payload)

        swarm.workers[1].codecs.decode = watched
        try:
            await asyncio.wait_for(asyncio.gather(*(w.run(4) for w in swarm.workers)), 120)
        finally:
            await swarm.close()

    tamper(swarm, 0, lie)
    asyncio.run(scenario())
    assert swarm.workers[1].stats.offences == {"n0": 1}
    assert all(shape[-1] == run.model.dim for shape in decoded)  # the forged one was never decoded
    assert all(w.committed == 4 for w in swarm.workers)

"""The pipeline's schedule and protocols on the in-process transport (every stage in one event
loop): exact equality with single-process training, replay after a lost link, codec state per
stream and across checkpoints, and a stop that never leaves stages a step apart. Milliseconds to
seconds each; the same behaviour over real gRPC between processes is in test_pipeline.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch
from tahnode.codecs import checksum, get_codec
from tahnode.config import RunConfig
from tahnode.net.body import Body
from tahnode.net.inproc import InProcessNetwork
from tahnode.net.transport import BACKWARD, FORWARD, Inbound
from tahnode.pipeline.checkpoint import CheckpointStore
from tahnode.pipeline.worker import StageWorker
from tahnode.proto import tahnode_pb2 as pb
from tahnode.train.corpus import prepare
from tahnode.train.data import TokenDataset
from tahnode.train.local import train_local

SMALL = {"train.micro_batches": 2, "train.batch_size": 2, "train.seq_len": 32}
NONE = {"codec.forward": "none", "codec.backward": "none", "codec.backward_params": {}}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> TokenDataset:
    root = tmp_path_factory.mktemp("corpus")
    gen = torch.Generator().manual_seed(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "print", "(", ")", ":", "\n"]
    for i in range(4):
        idx = torch.randint(len(words), (4000,), generator=gen)
        (root / f"doc{i}.py").write_text(" ".join(words[j] for j in idx))
    prepare([root], root / "tokens.bin", progress=False)
    return TokenDataset(root / "tokens.bin", SMALL["train.seq_len"])


def build_run(steps: int, **overrides) -> RunConfig:
    return RunConfig.build("llama-tiny", **{"train.steps": steps, **SMALL, **overrides})


class Swarm:
    """The stages of `run` as StageWorkers on one in-process network, chained n0 -> n1 -> ..."""

    def __init__(self, run: RunConfig, dataset: TokenDataset, store_dir: Path | None = None, **worker_args):
        self.run, self.net = run, InProcessNetwork()
        self.transports = [self.net.transport(f"n{k}") for k in range(run.stages)]
        self.dataset, self.store_dir, self.worker_args = dataset, store_dir, worker_args
        self.workers: list[StageWorker] = []

    async def start(self) -> None:
        for t in self.transports:
            await t.start()
        for k, t in enumerate(self.transports):
            store = CheckpointStore(self.store_dir / f"n{k}") if self.store_dir else None
            self.workers.append(StageWorker(self.run, k, t, "cpu", store, self.dataset if k == 0 else None,
                                            **self.worker_args))
            for direction, offset in ((FORWARD, 1), (BACKWARD, -1)):  # around the ring when the run is one
                other = self.run.neighbour(k, offset)
                if other is not None:
                    t.set_peer(direction, f"n{other}", f"n{other}")

    async def close(self) -> None:
        for w, t in zip(self.workers, self.transports):
            await t.close()
            w.close()

    def losses(self) -> list[float]:
        return [r.loss for r in self.workers[self.run.loss_stage].stats.losses]

    def steps(self) -> list[int]:
        return [r.step for r in self.workers[self.run.loss_stage].stats.losses]


async def train(swarm: Swarm, steps: int) -> Swarm:
    await swarm.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(w.run(steps) for w in swarm.workers)), 120)
    finally:
        await swarm.close()
    return swarm


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_none_fp32_equals_single_process_training(dataset, schedule):
    run = build_run(6, **NONE, **{"train.schedule": schedule, "train.seed": 3})
    swarm = asyncio.run(train(Swarm(run, dataset), 6))
    reference = train_local(run, dataset)
    assert swarm.steps() == list(range(6))
    assert swarm.losses() == pytest.approx(reference, abs=1e-5)
    assert reference[-1] < reference[0]
    assert all(w.committed == 6 and w.stats.finished for w in swarm.workers)


def test_a_lost_link_replays_the_step_and_training_stays_exact(dataset):
    """Stage 1's forward link breaks right after it committed step 2 (its StepEnd to stage 2 is
    lost with the queue): stage 0 replays the step; the losses still equal one process's."""
    run = build_run(6, **NONE)
    cuts = []

    def cut_after_step_2(worker: StageWorker) -> None:
        if worker.stage == 1 and worker.committed == 3 and not cuts:
            cuts.append(worker.committed)
            swarm.net.cut("n1", FORWARD)

    swarm = Swarm(run, dataset, on_step=cut_after_step_2)
    asyncio.run(train(swarm, 6))
    assert cuts == [3]
    assert swarm.workers[0].stats.replays >= 1
    assert swarm.transports[1].counters(FORWARD).failures == 1
    assert swarm.steps() == list(range(6))
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def bad_micro_batch(kind: str, run: RunConfig, step: int) -> pb.MicroBatch:
    """A micro-batch of the current step as a broken or hostile peer would send it."""
    n, s, d = 2, run.train.seq_len, run.model.dim
    ids, labels = [0, 1], torch.zeros(n, s, dtype=torch.int32).numpy().tobytes()
    enc = get_codec("none").encode(torch.zeros(n, s, 2 * d if kind == "oversized" else d))
    if kind == "truncated":  # 16 bytes where n*s*d*4 were due, with a checksum that matches
        enc.payload = enc.payload[:16]
        enc.crc32 = checksum(enc)
    elif kind == "nan":  # encoders refuse NaN: only a hostile peer sends it, with a checksum that matches
        enc.payload = torch.full((n, s, d), float("nan")).numpy().tobytes()
        enc.crc32 = checksum(enc)
    elif kind == "labels":
        labels = torch.full((n, s), run.model.vocab_size + 5, dtype=torch.int32).numpy().tobytes()
    return pb.MicroBatch(step=step, index=0, sample_ids=ids, labels=labels, tensor=enc, count=2)


@pytest.mark.parametrize("kind,stage", [("truncated", 1), ("nan", 1), ("oversized", 1), ("labels", 2)])
def test_a_bad_micro_batch_is_refused_the_step_replayed_and_training_stays_exact(dataset, kind, stage):
    """A malformed, non-finite or oversized micro-batch (or labels outside the vocabulary) arrives
    at a stage mid-run on a stream of its own: the stage refuses it and lives, stage 0 replays the
    step, and the losses still equal single-process training."""
    run = build_run(6, **NONE)
    sent = []

    def inject_after_step_2(worker: StageWorker) -> None:
        if worker.stage == stage and worker.committed == 3 and not sent:
            mb = bad_micro_batch(kind, run, worker.state.step)
            sent.append(mb)
            sender = f"n{stage - 1}"  # the neighbour itself, broken or hostile, on a stream of its own
            worker.t.inbox.put_nowait(Inbound(FORWARD, sender, 99, None))
            worker.t.inbox.put_nowait(Inbound(FORWARD, sender, 99, pb.Envelope(micro_batch=mb)))

    swarm = Swarm(run, dataset, on_step=inject_after_step_2)
    asyncio.run(train(swarm, 6))
    assert len(sent) == 1
    assert swarm.workers[stage].stats.refused_micro_batches == 1
    # reported to the coordinator, which bans repeat offenders
    assert swarm.workers[stage].stats.offences == {f"n{stage - 1}": 1}
    assert swarm.workers[0].stats.replays >= 1
    assert swarm.steps() == list(range(6))
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def test_a_lost_micro_batch_stalls_the_step_until_stage_0_replays_it(dataset):
    """A gradient that never comes back (dropped on the way, no link failure to tell): stage 0's
    stall watchdog replays the step after train.stall_timeout_s."""
    run = build_run(5, **NONE, **{"train.stall_timeout_s": 0.5})
    dropped = []
    swarm = Swarm(run, dataset)
    original = None

    async def send_dropping_one(direction, envelope, generation):
        env = envelope.envelope() if isinstance(envelope, Body) else envelope  # a micro-batch travels as its body
        if (direction == BACKWARD and env.WhichOneof("body") == "micro_batch" and env.micro_batch.step == 2
                and not dropped):
            dropped.append(env.micro_batch.index)
            return True
        return await original(direction, envelope, generation)

    original = swarm.transports[2].send
    swarm.transports[2].send = send_dropping_one
    asyncio.run(train(swarm, 5))
    assert dropped == [0]
    assert swarm.workers[0].stats.replays == 1
    assert swarm.steps() == list(range(5))
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def test_a_replay_request_waits_for_a_backward_peer_being_replaced(dataset):
    """Stage 2 refuses a micro-batch of step 2 (the real one lost on the way) while its backward link
    names no peer (its neighbour being replaced): the request to replay is sent once the link names
    one again, not lost, so stage 0 replays the step long before its stall watchdog (300 s)."""
    run = build_run(5, **NONE)
    swarm, events = Swarm(run, dataset), []
    original = swarm.transports[1].send

    def peer_back() -> None:
        events.append("peer back")
        swarm.transports[2].set_peer(BACKWARD, "n1", "n1")

    async def send_replacing_one(direction, envelope, generation):
        env = envelope.envelope() if isinstance(envelope, Body) else envelope
        if (direction == FORWARD and env.WhichOneof("body") == "micro_batch" and env.micro_batch.step == 2
                and not events):
            events.append("refused")
            swarm.transports[2].set_peer(BACKWARD, "", "")
            swarm.transports[2].inbox.put_nowait(Inbound(FORWARD, "n1", 99, None))
            swarm.transports[2].inbox.put_nowait(
                Inbound(FORWARD, "n1", 99, pb.Envelope(micro_batch=bad_micro_batch("nan", run, 2))))
            asyncio.get_running_loop().call_later(0.5, peer_back)
            return True
        return await original(direction, envelope, generation)

    swarm.transports[1].send = send_replacing_one

    async def main() -> None:
        await swarm.start()
        try:
            await asyncio.wait_for(asyncio.gather(*(w.run(5) for w in swarm.workers)), 60)
        finally:
            await swarm.close()

    asyncio.run(main())
    assert events == ["refused", "peer back"]
    assert swarm.workers[2].stats.refused_micro_batches == 1
    assert swarm.workers[0].stats.replays == 1
    assert swarm.steps() == list(range(5))
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)


def test_aqsgd_cache_starts_afresh_on_a_new_stream_at_both_ends(dataset):
    """AQ-SGD keeps a per-sample cache on both ends of a link; after the link breaks, the sender's
    new generation and the receiver's new stream both start empty, so decoding stays in step."""
    run = build_run(8, **{"codec.forward": "aqsgd"})
    seen = {}

    def cut_once(worker: StageWorker) -> None:
        if worker.stage == 0 and worker.committed == 3 and not seen:
            seen["before"] = worker.codecs.cache_bytes()
            swarm.net.cut("n0", FORWARD)
            seen["after"] = worker.codecs.sending.get(FORWARD)

    swarm = Swarm(run, dataset, on_step=cut_once)
    asyncio.run(train(swarm, 8))
    assert seen["before"] > 0
    stage1 = swarm.workers[1].codecs
    assert stage1.receiving[FORWARD][0] == 2  # the second stream from stage 0
    assert swarm.workers[0].codecs.sending[FORWARD][0] == 1  # the link's second generation
    assert swarm.steps() == list(range(8))
    losses = swarm.losses()
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]


def test_a_dropped_stale_micro_batch_still_feeds_the_stream_state(dataset):
    """A micro-batch of an aborted attempt is dropped, but the sender's AQ-SGD cache took it in when
    it encoded it: the receiver decodes it into its cache too, so the next message (a delta
    against that cache) still decodes."""
    from tahnode.codecs import CodecContext, get_codec
    from tahnode.net.transport import Inbound
    from tahnode.proto import tahnode_pb2 as pb

    run = build_run(4, **{"codec.forward": "aqsgd"})
    codec, sender = get_codec("aqsgd"), CodecContext(sample_ids=[5, 6])
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1))

    async def scenario():
        worker = StageWorker(run, 1, InProcessNetwork().transport("n1"), "cpu")
        worker.restart_step(0, 7)
        stale = pb.MicroBatch(step=0, index=0, attempt=6, sample_ids=[5, 6], tensor=codec.encode(x, sender))
        await worker.handle(Inbound(FORWARD, "n0", 1, pb.Envelope(micro_batch=stale)))
        assert not worker.state.pending  # dropped: not part of the current attempt
        fresh = pb.MicroBatch(step=0, index=0, attempt=7, sample_ids=[5, 6], tensor=codec.encode(x * 1.01, sender))
        assert fresh.tensor.ByteSize() < stale.tensor.ByteSize() / 4  # a delta against the cache
        out = await worker.compute(worker.codecs.decode, FORWARD, 1, fresh, torch.float32)
        worker.close()
        return out

    out = asyncio.run(scenario())
    assert (out - x * 1.01).abs().max() < 0.05 * x.abs().max()


def test_steps_not_reported_yet_come_back_with_the_last_stages_checkpoint(dataset, tmp_path):
    """A last stage killed after a checkpoint but before its heartbeat reported the steps it
    committed would leave holes in the coordinator's ledger (the chaos test found step 104
    missing): its checkpoint keeps the unreported steps, and a resumed worker reports them."""
    run = build_run(4, **NONE, **{"train.checkpoint_every": 2})
    swarm = asyncio.run(train(Swarm(run, dataset, store_dir=tmp_path), 4))  # no heartbeats here: nothing reported
    done = swarm.workers[2].stats.outbox
    assert [r.step for r in done] == [0, 1, 2, 3]
    resumed = StageWorker(run, 2, InProcessNetwork().transport("x"), "cpu", CheckpointStore(tmp_path / "n2"))
    assert resumed.resume() == 4
    assert ([(r.step, r.loss, list(r.sample_ids)) for r in resumed.stats.outbox]
            == [(r.step, r.loss, list(r.sample_ids)) for r in done])
    resumed.close()


def test_amaq_gates_learn_and_come_back_from_a_checkpoint(dataset, tmp_path):
    """AMAQ's learned widths live in the sending stage's codec state: they move during training,
    are saved with the stage, and a worker resumed from that checkpoint has the same gates."""
    run = build_run(4, **{"codec.forward": "amaq", "train.checkpoint_every": 2})
    swarm = asyncio.run(train(Swarm(run, dataset, store_dir=tmp_path), 4))
    gates = swarm.workers[1].codecs.states[FORWARD].gates
    assert gates.step == 4 and gates.gate.abs().max() > 0
    assert not swarm.workers[2].codecs.tensors()  # the last stage sends no activations
    resumed = StageWorker(run, 1, InProcessNetwork().transport("x"), "cpu", CheckpointStore(tmp_path / "n1"))
    assert resumed.resume() == 4
    again = resumed.codecs.states[FORWARD].gates
    assert torch.equal(again.gate, gates.gate) and again.step == 4
    resumed.close()


def test_stop_during_the_last_gradient_waits_for_its_step_end(dataset, tmp_path):
    """A stop that arrives while a stage computes the step's last backward: that gradient still
    goes out and stage 0 commits the step, so the stopping stage waits for the StepEnd and saves
    the same step stage 0 committed (stages a step apart could not be rolled back together)."""
    run = build_run(50, **NONE)

    async def scenario():
        swarm = Swarm(run, dataset, store_dir=tmp_path)
        await swarm.start()
        stage1 = swarm.workers[1]
        inside, loop = asyncio.Event(), asyncio.get_running_loop()
        backward = stage1.backward

        def slow_last_backward(item, mb):  # on the compute thread
            if mb.step == 4 and stage1.state.done_backward == run.train.micro_batches - 1:
                loop.call_soon_threadsafe(inside.set)
                time.sleep(0.3)
            return backward(item, mb)

        stage1.inbox.ops.backward = slow_last_backward  # what the inbox hands a gradient to
        tasks = [asyncio.ensure_future(w.run(50)) for w in swarm.workers]
        await asyncio.wait_for(inside.wait(), 60)
        await stage1.stop()
        saved = CheckpointStore(tmp_path / "n1").latest(1, 3)
        committed0 = swarm.workers[0].committed
        for task in tasks:
            task.cancel()
        await swarm.close()
        return saved.step, committed0

    saved, committed0 = asyncio.run(scenario())
    assert saved == committed0 == 5


def test_a_corrupt_checkpoint_is_moved_aside_and_every_stage_resumes_from_the_one_before(dataset, tmp_path):
    """Stage 1's newest checkpoint gets a flipped bit: on restart it is moved aside, stage 1
    resumes from its previous one, the other stages roll back to the same step, and the losses
    from there on equal uninterrupted single-process training."""
    run = build_run(4, **NONE, **{"train.checkpoint_every": 2})
    asyncio.run(train(Swarm(run, dataset, store_dir=tmp_path), 4))
    newest = CheckpointStore(tmp_path / "n1").latest(1, run.stages)
    assert newest.step == 4
    damaged = bytearray(newest.path.read_bytes())
    damaged[-1] ^= 0x01
    newest.path.write_bytes(bytes(damaged))

    longer = build_run(6, **NONE, **{"train.checkpoint_every": 2})
    swarm = Swarm(longer, dataset, store_dir=tmp_path)

    async def scenario() -> list[int]:
        await swarm.start()
        try:
            resumed = [w.resume() for w in swarm.workers]
            await asyncio.wait_for(asyncio.gather(*(w.run(6) for w in swarm.workers)), 120)
        finally:
            await swarm.close()
        return resumed

    assert asyncio.run(scenario()) == [4, 2, 4]
    assert (tmp_path / "n1" / (newest.path.name + ".corrupt")).exists()
    assert swarm.steps() == [2, 3, 4, 5]
    assert swarm.losses() == pytest.approx(train_local(longer, dataset)[2:], abs=1e-5)


def test_a_stage_without_the_checkpoint_to_roll_back_to_fetches_it_from_the_store(dataset, tmp_path):
    """Stage 1 must resume from step 2 (its step-4 file is corrupt), but stages 0 and 2 kept only
    their step-4 checkpoints: each fetches step 2 from the coordinator's store (here a copy of
    every file) and rolls back, and training stays exact. Without a store to fetch from, the
    stage that cannot roll back says so and stage 0 stops with PipelineError (no daemon dies
    on a stage's word alone)."""
    import shutil

    from tahnode.pipeline.state import PipelineError

    run = build_run(4, **NONE, **{"train.checkpoint_every": 2})
    asyncio.run(train(Swarm(run, dataset, store_dir=tmp_path / "ck"), 4))
    shutil.copytree(tmp_path / "ck", tmp_path / "coordinator-store")
    newest = CheckpointStore(tmp_path / "ck" / "n1").latest(1, run.stages)
    newest.path.write_bytes(newest.path.read_bytes()[:-1] + bytes([newest.path.read_bytes()[-1] ^ 1]))
    for k in (0, 2):
        CheckpointStore(tmp_path / "ck" / f"n{k}").path(k, run.stages, 2).unlink()
    longer = build_run(6, **NONE, **{"train.checkpoint_every": 2})

    def scenario(with_store: bool):
        swarm, fetched = Swarm(longer, dataset, store_dir=tmp_path / "ck"), []

        async def go() -> None:
            await swarm.start()
            try:
                for k, w in enumerate(swarm.workers):
                    async def fetch(step: int, k=k) -> bool:
                        source = CheckpointStore(tmp_path / "coordinator-store" / f"n{k}").find(k, run.stages, step)
                        if not with_store or source is None:
                            return False
                        shutil.copy(source.path, CheckpointStore(tmp_path / "ck" / f"n{k}").path(k, run.stages, step))
                        fetched.append((k, step))
                        return True

                    w.saver.fetch = fetch
                    w.resume()
                await asyncio.wait_for(asyncio.gather(*(w.run(6) for w in swarm.workers)), 120)
            finally:
                await swarm.close()

        asyncio.run(go())
        return swarm, fetched

    with pytest.raises(PipelineError, match="cannot roll back to step 2"):
        scenario(with_store=False)
    swarm, fetched = scenario(with_store=True)
    assert sorted(fetched) == [(0, 2), (2, 2)]
    assert swarm.steps() == [2, 3, 4, 5]
    assert swarm.losses() == pytest.approx(train_local(longer, dataset)[2:], abs=1e-5)


def codec_streams(run: RunConfig, stage: int):
    """The codec streams of `stage` on an in-process transport of its own."""
    from tahnode.pipeline.state import Stats
    from tahnode.pipeline.streams import CodecStreams

    transport = InProcessNetwork().transport(f"n{stage}")
    transport.open_links()
    return CodecStreams(run, stage, transport, torch.device("cpu"), Stats())


@pytest.mark.parametrize("std", [1e-2, 1e-5, 1e-8, 1e-11])
def test_gradients_are_prescaled_for_tahquant_and_come_back_at_their_size(std):
    """TAH-Quant's (the paper's) fp16 zero-points and scales underflow for gradients around 1e-7 and below; the
    stage multiplies them by a power of two before encoding (MicroBatch.scale_log2) and the
    receiver divides it out, so the error stays the codec's usual one at every magnitude."""
    from tahnode.pipeline.streams import prescale_exponent

    run = build_run(1, **{"codec.backward": "tahquant-paper", "codec.backward_params": {}})
    sender, receiver = codec_streams(run, 1), codec_streams(run, 0)
    grad = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1)) * std
    k = prescale_exponent(grad)
    assert 2 ** 7 <= float(grad.abs().max()) * 2.0 ** k < 2 ** 8
    msg, _, sent_k = sender.encode_gradient(grad, list(range(4)))
    assert sent_k == k
    back = receiver.decode(BACKWARD, 1, pb.MicroBatch(tensor=msg, sample_ids=list(range(4)), scale_log2=k),
                           torch.float32)
    assert float((back - grad).norm() / grad.norm()) < 0.2


def test_gradients_of_codecs_without_fp16_side_info_are_sent_as_they_are():
    """naive keeps its own shared exponent and none is exact: neither is prescaled, so `none` in
    fp32 stays bit-identical to single-process training (test above)."""
    for codec, params in (("none", {}), ("naive", {"bits": 6})):
        run = build_run(1, **{"codec.backward": codec, "codec.backward_params": params})
        assert codec_streams(run, 1).encode_gradient(torch.full((2, 4, 64), 1e-9), [0, 1])[2] == 0


def test_each_stage_counts_its_codec_time_within_its_step_time(dataset):
    """What `tahnode demo` reports as the share of a step spent in encode + decode: every stage
    times its codec calls, the time lies within the steps' wall time, and heartbeats carry both."""
    run = build_run(3, **{"codec.forward": "tahquant", "codec.backward": "naive"})
    swarm = asyncio.run(train(Swarm(run, dataset), 3))
    for w in swarm.workers:
        report = w.stats.report(w.committed, 0)
        assert 0.0 < report.codec_seconds < report.step_seconds
        assert report.step_seconds == pytest.approx(sum(w.stats.step_times))


@pytest.mark.parametrize("stages", [2, 3])
def test_tied_embeddings_train_around_the_ring_as_one_process_does(dataset, stages):
    """A tied model over several stages: stage 0 holds the embedding and the head that is it, the
    last stage sends its final hidden states back; with none in fp32 the losses are single-process
    training's, and the tied weight stays one tensor on stage 0."""
    run = build_run(5, **NONE, stages=stages, **{"train.seed": 2})
    run.model = dataclasses.replace(run.model, tie_embeddings=True)
    assert run.validate().ring and run.loss_stage == 0
    swarm = asyncio.run(train(Swarm(run, dataset), 5))
    reference = train_local(run, dataset)
    assert swarm.steps() == list(range(5))
    assert swarm.losses() == pytest.approx(reference, abs=1e-5)
    assert reference[-1] < reference[0]
    first, last = swarm.workers[0].model, swarm.workers[-1].model
    assert first.lm_head.weight is first.model.embed_tokens.weight and last.lm_head is None
    assert not swarm.workers[-1].stats.losses  # the losses are stage 0's

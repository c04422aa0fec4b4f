"""The schedule, unit by unit and on the in-process transport: how a step is cut into micro-batches,
which envelope runs next, how the in-flight window grows and what bounds it; and that the cut never
changes the training (fp32 `none` still equals one process to 1e-5)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from tahnode.config import LinkEmulation, RunConfig, TrainConfig
from tahnode.net.transport import BACKWARD, FORWARD, MAX_IN_FLIGHT, Inbound
from tahnode.pipeline.schedule import InboxOrder, Split, SplitTuner, Window
from tahnode.proto import tahnode_pb2 as pb
from tahnode.train.local import train_local
from test_pipeline_inproc import Swarm, dataset, train  # noqa: F401  (dataset is a fixture)


def bench_train(**kw) -> TrainConfig:
    """32768 tokens per step as 4 micro-batches of 64 x 128 (what `tahnode bench swarm` asks for)."""
    return replace(TrainConfig(micro_batches=4, batch_size=64, seq_len=128), **kw)


def busy_share(split: Split, stages: int) -> float:
    return split.micro_batches / (split.micro_batches + 2 * stages - 3)


@pytest.mark.parametrize("stages,expected", [(1, 4), (2, 16), (3, 32), (4, 64), (6, 64)])
def test_the_first_cut_fills_equal_links_within_the_smallest_micro_batch(stages, expected):
    split = Split.of(bench_train(), stages)
    assert split.micro_batches == expected and split.samples == 256
    assert split.batch_size * 128 >= 512  # min_micro_batch_tokens
    if 2 <= stages <= 4:
        assert busy_share(split, stages) >= 0.9
    assert Split.counts(bench_train()) == [4, 8, 16, 32, 64]


def test_cuts_never_go_below_the_users_micro_batches_and_honour_an_explicit_one():
    demo = TrainConfig()  # 4 x 4 samples of 64 tokens: cutting finer would go below 512 tokens
    assert Split.counts(demo) == [4] and Split.of(demo, 3) == Split(4, 4)
    assert Split.of(bench_train(min_micro_batch_tokens=8192), 3) == Split(4, 64)
    assert Split.counts(bench_train(pipeline_micro_batches=8)) == [8]
    with pytest.raises(ValueError, match="does not divide"):
        bench_train(pipeline_micro_batches=3).validate()


def tune(times: dict[int, float], steps: int = 14) -> list[int]:
    tuner = SplitTuner([4, 8, 16, 32, 64], 32, revisit=6)
    seen = []
    for _ in range(steps):
        seen.append(tuner.count)
        tuner.record(times[tuner.count])
    return seen


def test_the_tuner_keeps_the_fastest_cut_and_revisits_its_neighbours():
    link_bound = {4: 9.0, 8: 8.9, 16: 8.8, 32: 8.7, 64: 8.3}  # finer cuts shorten the fill and drain
    assert tune(link_bound) == [32, 32, 16, 64] + [64] * 6 + [32] + [64] * 3
    compute_bound = {4: 1.1, 8: 1.0, 16: 1.0, 32: 1.2, 64: 1.4}  # every micro-batch costs overhead
    assert tune(compute_bound) == [32, 32, 16, 8] + [16] * 6 + [8, 32] + [16] * 2
    flat = {m: 1.0 for m in (4, 8, 16, 32, 64)}  # within the 3% threshold: stay where it started
    assert tune(flat)[4:10] == [32] * 6


def inbound(direction, step: int) -> Inbound:
    return Inbound(direction, "peer", 1, pb.Envelope(step_end=pb.StepEnd(step=step)))


def test_gradients_run_before_activations_each_in_arrival_order():
    async def scenario():
        inbox = asyncio.Queue(maxsize=4)
        for item in (inbound(FORWARD, 0), inbound(FORWARD, 1), inbound(BACKWARD, 10), inbound(FORWARD, 2)):
            inbox.put_nowait(item)
        order = InboxOrder(inbox)
        first = [await order.next() for _ in range(2)]
        inbox.put_nowait(inbound(BACKWARD, 11))
        rest = [await order.next() for _ in range(3)]
        return [(i.direction, i.envelope.step_end.step) for i in first + rest]

    assert asyncio.run(scenario()) == [(BACKWARD, 10), (FORWARD, 0), (BACKWARD, 11), (FORWARD, 1), (FORWARD, 2)]


def test_window_grows_up_to_its_limits():
    async def scenario():
        w = Window.initial(3, Split(32, 8), "1f1b")
        assert (w.size, w.limit) == (5, 32)
        w.cap(7)  # the memory budget holds 7
        grown = [w.grow() for _ in range(4)]
        gpipe = Window.initial(3, Split(1000, 1), "gpipe")
        return grown, w.size, gpipe.size

    grown, size, gpipe = asyncio.run(scenario())
    assert grown == [True, True, False, False] and size == 7
    assert gpipe == MAX_IN_FLIGHT


def run_slow_return_link(dataset, budget_mb: float) -> tuple[int, list[float]]:  # noqa: F811
    """Three stages in one process, the gradients' link from stage 1 to stage 0 slow (8 Mbit/s):
    stage 0's forward link goes idle while it waits for gradients, so its window must grow."""
    run = RunConfig.build("llama-tiny", **{"train.steps": 2, "train.micro_batches": 2, "train.batch_size": 16,
                                            "train.seq_len": 32, "train.min_micro_batch_tokens": 32,
                                            "train.memory_budget_mb": budget_mb, "codec.forward": "none",
                                            "codec.backward": "none", "codec.backward_params": {}})
    swarm = Swarm(run, dataset)
    swarm.transports[1] = swarm.net.transport("n1", emulation=LinkEmulation(peer_rates={"n0": 8e6}))
    asyncio.run(train(swarm, 2))
    return swarm.workers[0].driver.window.size, swarm.losses()


def test_the_window_grows_when_the_link_waits_for_it_and_the_memory_budget_bounds_it(dataset):  # noqa: F811
    split = Split.of(RunConfig.build("llama-tiny",
                                     **{"train.micro_batches": 2, "train.batch_size": 16, "train.seq_len": 32,
                                       "train.min_micro_batch_tokens": 32}).train, 3)
    assert split == Split(32, 1)
    grown, losses = run_slow_return_link(dataset, 4096)
    assert 5 < grown <= 32
    bounded, again = run_slow_return_link(dataset, 0.001)  # not even one micro-batch's activations
    assert bounded == 5  # 2S-1: where it starts, never more
    assert again == pytest.approx(losses, abs=1e-6)  # the window changes the timing, never the training


def test_auto_split_trains_exactly_as_one_process(dataset):  # noqa: F811
    """The user asks for 2 micro-batches of 32 samples; the pipeline cuts steps into 32 of 2, then
    the tuner tries 16 and 64. The losses equal single-process training with the user's cut to 1e-5."""
    run = RunConfig.build("llama-tiny", **{"train.steps": 4, "train.micro_batches": 2, "train.batch_size": 32,
                                            "train.seq_len": 32, "train.min_micro_batch_tokens": 64, "train.seed": 5,
                                            "codec.forward": "none", "codec.backward": "none",
                                            "codec.backward_params": {}})
    assert Split.of(run.train, 3) == Split(32, 2)
    swarm = asyncio.run(train(Swarm(run, dataset), 4))
    assert swarm.workers[0].driver.tuner.tried  # it did try other cuts
    assert swarm.losses() == pytest.approx(train_local(run, dataset), abs=1e-5)
    assert torch.equal(torch.tensor(swarm.steps()), torch.arange(4))

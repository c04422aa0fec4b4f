"""Replicas of a stage that parted at one outer step meet again: a replica whose outer weights of its own step are
not the ones the coordinator names (settled: every replica reported that step) takes the named ones as its anchor
and keeps the steps it trained since, before its next round.

How they part: a round that one replica counts as a group and the other as formed by no one (hivemind's group of
two, one side waiting for an average that never comes while the other looks for a group), so that both take that
outer step alone, each from its own weights; each then catches up to the stage's naming of the step, but the one
whose wait ends before the other reports finds only its own digest named. From then on every round moves both by
the same mean, and the difference between their outer weights lasts (seen in `tahnode bench chaos`: 1.5e-2
between the replicas of a stage at the end of a run). The naming settles a round later, and this takes it."""

from __future__ import annotations

import logging

import torch

from .outer_adopt import fetch_named, not_served

log = logging.getLogger("tahnode.pipeline")

__all__ = ["parted", "meet_named"]

MEET_WAIT_S = 5.0  # the longest a replica asks the named state's sources (they wait for it at the round)


def parted(sync) -> bool:
    """Whether `sync` (an OuterSync that averages), unsure of its outer weights since a round without a mean, holds
    another outer state of its step than the settled naming, one it would take (a source it did not exclude, a
    naming its sources did not fail). Only then: replicas that averaged together since they were last confirmed
    cannot have parted, and a replica's report of another digest is then a lie it does not follow (a liar named
    first could otherwise move it each round; after a round it stalled, once, within outer_adopt's reach)."""
    named = sync.named
    return (sync.stats.unsure and named is not None and named.settled and named.step == sync.anchor_step
            and named.digest != sync.digest and sync.takes_from(named))


def _confirmed(sync) -> bool:
    """Whether the settled naming of its outer step is its own digest: its outer weights are the stage's."""
    named = sync.named
    return named is not None and named.settled and named.step == sync.anchor_step and named.digest == sync.digest


async def meet_named(sync) -> bool:
    """Before a round: if the replica parted from its stage's naming, its anchor becomes the named outer weights
    and its weights move by as much (the steps since its anchor kept). True if it did."""
    await sync.core.compute(sync.rehash)
    if _confirmed(sync):
        sync.stats.unsure = False
    if not parted(sync):
        return False
    named = sync.named
    tensors = await fetch_named(sync, named, MEET_WAIT_S)
    if tensors is None:
        not_served(sync, named)
        return False
    met = await sync.core.compute(_rebase, sync, tensors, named)
    if met:
        sync.stats.unsure = False  # its outer weights are now the named ones
        log.warning("stage %d: its outer weights of step %d were not the ones its replicas hold: it takes theirs "
                    "and keeps the steps it trained since", sync.core.stage, named.step)
    return met


def _rebase(sync, tensors: list[torch.Tensor], named) -> bool:
    """(compute thread) The named state as its outer weights (OuterSync.take_named's checks), and its weights
    moved by the same difference."""
    outer = sync.outer
    with torch.no_grad():
        since = [p.detach() - a for p, a in zip(outer.params, outer.anchor)]
    if not sync.take_named(tensors, named, False):
        return False
    with torch.no_grad():
        for p, a, d in zip(outer.params, outer.anchor, since):
            p.copy_(a + d)
    return True

"""A checkpoint's metadata as a typed, bounded record, parsed once where a file enters use (a node's
load, the coordinator's store): past that edge nothing meets wrong JSON, wrong types or made-up steps.

What a record allows: the step, stage and stage count its file is named for; the run configuration
of the same run (model and stages, as a node compares them); AdamW step counts of the parameters the
file has moments of, none past the step; and, on the stage that computes the loss only, the committed
steps the coordinator may not have heard of yet: the last ones before the step, one run of them."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

from ..config import RunConfig
from ..config.model import ModelConfig
from .checkpoint_errors import BadMetadata, ForeignCheckpoint
from .state import StepRecord

__all__ = ["CheckpointMeta", "MetaForm", "MAX_RUN_CHARS", "MAX_UNREPORTED", "kept_unreported", "same_run"]

MAX_RUN_CHARS = 1 << 16      # the run configuration's JSON (about 1 KiB today)
MAX_UNREPORTED = 1000        # committed steps a checkpoint carries for the coordinator, the newest
MAX_SAMPLE_ID = 1 << 63      # the ledger keeps sample ids as unsigned 64-bit integers
NUMBER = re.compile(r"0|[1-9][0-9]{0,17}")  # a step, stage or stage count as the metadata writes it


@dataclass(frozen=True)
class MetaForm:
    """What a checkpoint's metadata must agree with: its file's stage, stage count and step (from its
    name, or the upload's), and the run it is loaded into or stored for."""

    stage: int
    num_stages: int
    step: int
    run: RunConfig
    label: str = ""  # how messages name the file (its path on a node)

    @property
    def what(self) -> str:
        return self.label or f"checkpoint of stage {self.stage} at step {self.step}"


@dataclass(frozen=True)
class CheckpointMeta:
    """A checkpoint's metadata, every field checked (parse)."""

    step: int
    stage: int
    num_stages: int
    run: str                             # the run configuration's JSON, of the same run
    optim_steps: dict[str, int]          # AdamW's step count of each parameter, at most `step`
    unreported: tuple[StepRecord, ...]   # steps step - n .. step - 1, the loss stage's only
    pipeline: int = 0                    # whose ledger the unreported steps are (pipelines in data parallel)

    @classmethod
    def parse(cls, meta: Mapping[str, str], form: MetaForm, optimized: Collection[str]) -> "CheckpointMeta":
        """The record of `meta`, a file's metadata, which must agree with `form`; `optimized`: the
        parameters the file holds AdamW moments of. Raises BadMetadata, or ForeignCheckpoint for a
        file of another run configuration."""
        what = form.what
        for key, expected in (("step", form.step), ("stage", form.stage), ("num_stages", form.num_stages)):
            text = meta.get(key)
            if not isinstance(text, str) or not NUMBER.fullmatch(text) or int(text) != expected:
                raise BadMetadata(f"{what}: its metadata gives {key} {str(text)[:20]!r}, not {expected}")
        run = meta.get("run")
        if (not isinstance(run, str) or len(run) > MAX_RUN_CHARS
                or not isinstance(saved := _json(run, what, "run"), dict)):
            raise BadMetadata(f"{what}: its run configuration is not a JSON object of at most "
                              f"{MAX_RUN_CHARS} characters")
        same_run(saved, json.loads(form.run.to_json()), what)
        pipeline = meta.get("pipeline", "0")
        if (not isinstance(pipeline, str) or not NUMBER.fullmatch(pipeline)
                or int(pipeline) >= form.run.swarm.data_slots):
            raise BadMetadata(f"{what}: its pipeline {str(pipeline)[:20]!r} is not one of the run's "
                              f"0..{form.run.swarm.data_slots - 1}")
        return cls(form.step, form.stage, form.num_stages, run, _optim_steps(meta, form.step, optimized, what),
                   _unreported(meta, form, what), int(pipeline))


def same_run(saved: dict, ours: dict, what: str) -> None:
    """Raises ForeignCheckpoint unless the model and stages of `saved`, a checkpoint's run, are
    `ours`. Model configs compare with their defaults filled in: a checkpoint written before a model
    field with a default existed (rope_scaling) is still of the same run."""
    for key in ("model", "stages"):
        theirs, mine = saved.get(key), ours.get(key)
        if key == "model" and isinstance(theirs, dict) and isinstance(mine, dict):
            try:
                same = ModelConfig.from_dict(theirs) == ModelConfig.from_dict(mine)
            except (TypeError, ValueError):
                same = False
        else:
            same = theirs == mine
        if not same:
            raise ForeignCheckpoint(f"{what} belongs to another run ({key} differs); move it away or use another "
                                    "--checkpoint-dir")


def kept_unreported(records: Iterable[StepRecord], step: int) -> list[StepRecord]:
    """What a checkpoint of `step` keeps of the loss stage's unreported records: what the coordinator
    would make of them (a step at or before an earlier one replaces it and every later one, as after
    a rollback), the run of steps that ends at step - 1, its newest MAX_UNREPORTED."""
    kept: list[StepRecord] = []
    for r in (r for r in records if not r.skipped):  # a skipped step is no loss: told once, never kept
        while kept and kept[-1].step >= r.step:
            kept.pop()
        kept.append(r)
    run: list[StepRecord] = []
    for r in reversed(kept):
        if r.step >= step:
            continue
        if r.step != step - 1 - len(run) or len(run) == MAX_UNREPORTED:
            break
        run.append(r)
    return run[::-1]


def _json(text, what: str, key: str):
    if isinstance(text, str):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: brackets nested deeper than the parser goes
            pass
    raise BadMetadata(f"{what}: its metadata's {key} is not JSON")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _optim_steps(meta: Mapping[str, str], step: int, optimized: Collection[str], what: str) -> dict[str, int]:
    steps = _json(meta.get("optim_steps", "{}"), what, "optim_steps")
    if not isinstance(steps, dict):
        raise BadMetadata(f"{what}: its optim_steps is not a JSON object")
    for name, count in steps.items():
        if name not in optimized:
            raise BadMetadata(f"{what}: it gives an AdamW step count of {name[:80]!r}, "
                              "a parameter it holds no moments of")
        if not _real(count) or count != int(count) or not 0 <= count <= step:
            raise BadMetadata(f"{what}: the AdamW step count of {name} is {str(count)[:20]}, "
                              f"not a whole number in 0..{step}")
    return {name: int(count) for name, count in steps.items()}


def _unreported(meta: Mapping[str, str], form: MetaForm, what: str) -> tuple[StepRecord, ...]:
    entries = _json(meta.get("unreported", "[]"), what, "unreported")
    if not isinstance(entries, list):
        raise BadMetadata(f"{what}: its unreported steps are not a JSON list")
    if entries and form.stage != form.run.loss_stage:
        raise BadMetadata(f"{what}: it carries unreported steps, and stage {form.stage} computes no loss")
    if len(entries) > min(MAX_UNREPORTED, form.step):
        raise BadMetadata(f"{what}: it carries {len(entries)} unreported steps, "
                          f"more than {min(MAX_UNREPORTED, form.step)}")
    samples = form.run.train.micro_batches * form.run.train.batch_size
    records = []
    for k, entry in enumerate(entries):
        step = form.step - len(entries) + k  # one run of steps up to the checkpoint's
        if not (isinstance(entry, list) and len(entry) == 4 and _integer(entry[0]) and entry[0] == step
                and _real(entry[1]) and isinstance(entry[2], list) and len(entry[2]) <= samples
                and _real(entry[3]) and entry[3] >= 0
                and all(_integer(i) and 0 <= i < MAX_SAMPLE_ID for i in entry[2])):
            raise BadMetadata(f"{what}: its unreported entry {k} is not [step {step}, a finite loss, at most {samples} "
                              f"sample ids, seconds >= 0]")
        records.append(StepRecord(step, float(entry[1]), list(entry[2]), float(entry[3])))
    return tuple(records)

"""Stage checkpoints: one safetensors file per saved step holding the stage's weights, its AdamW
state and its codec state, with the step, the run identity and a SHA-256 of it all in the metadata.

This module owns the file names, their integrity (durable writes, the checksum checked on every
load and on arrival in a store, the metadata parsed into its record: tahnode.pipeline.checkpoint_meta)
and the chunking that carries a file to and from the coordinator."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import RunConfig
from .checkpoint_errors import (BadMetadata, CheckpointError, CheckpointTooLarge, CorruptCheckpoint,
                                ForeignCheckpoint)
from .checkpoint_files import (CHUNK_BYTES, DIGEST_KEY, digest, durable_replace, owner_only, read_chunks,
                               read_verified)
from .checkpoint_meta import CheckpointMeta, MetaForm
from .state import StepRecord

log = logging.getLogger("tahnode.checkpoint")

NAME = re.compile(r"stage(\d+)-of(\d+)-step(\d+)\.safetensors$")
CORRUPT_SUFFIX = ".corrupt"  # a corrupt file is renamed to this, so that nothing lists it again
EXTRA_LIMIT_PER_DIM = 64  # codec state in a checkpoint: at most this many elements per model channel (AMAQ keeps one)

__all__ = ["has_outer", "BadMetadata", "CheckpointError", "CheckpointTooLarge", "CorruptCheckpoint",
           "ForeignCheckpoint", "Checkpoint", "CheckpointStore", "ChunkWriter", "StageSaver", "check_fits", "digest",
           "load", "optimized", "read_chunks", "read_verified", "stage_shapes"]


def checkpoint_name(stage: int, num_stages: int, step: int) -> str:
    """The file name of stage `stage` of `num_stages` at step `step` (matches NAME)."""
    return f"stage{stage}-of{num_stages}-step{step}.safetensors"


def stage_shapes(model: torch.nn.Module, outer: bool = False) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor a checkpoint of `model`'s stage holds (weights once, the
    AdamW moments of each trainable parameter; with `outer`, pipelines in data parallel, the outer
    weights, momentum and error-feedback residual, flat); `extra/...` (codec state) is not listed."""
    aliases = tied_aliases(model)
    shapes = {f"model/{k}": tuple(v.shape) for k, v in model.state_dict().items() if k not in aliases}
    for name, p in model.named_parameters():
        if p.requires_grad:
            shapes[f"optim/{name}/exp_avg"] = shapes[f"optim/{name}/exp_avg_sq"] = tuple(p.shape)
    if outer:
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        shapes["outer/anchor"] = shapes["outer/momentum"] = shapes["outer/residual"] = (numel,)
    return shapes


def check_fits(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], what: str,
               extra_limit: int) -> None:
    """A checkpoint's tensors fit a stage: every weight present, nothing unknown, every shape right,
    floating point, and at most `extra_limit` elements of codec state (its shapes those of `shapes`'
    `extra/...` entries, where given). Raises CorruptCheckpoint: loading it would fail (or worse,
    succeed) on every node that takes the stage."""
    extra = 0
    for name, t in tensors.items():
        if name.startswith("extra/"):
            extra += t.numel()
        elif name not in shapes:
            raise CorruptCheckpoint(f"{what} does not fit the stage: it holds an unknown tensor {name!r}")
        if name in shapes and tuple(t.shape) != shapes[name]:
            raise CorruptCheckpoint(f"{what} does not fit the stage: {name} has shape {list(t.shape)}, "
                                    f"not {list(shapes[name])}")
        if not t.is_floating_point():
            raise CorruptCheckpoint(f"{what} does not fit the stage: {name} is {t.dtype}, not floating point")
    missing = [n for n in shapes if n.startswith("model/") and n not in tensors]
    if missing:
        raise CorruptCheckpoint(f"{what} does not fit the stage: it lacks {', '.join(missing[:3])}")
    if extra > extra_limit:
        raise CorruptCheckpoint(f"{what} holds {extra} elements of codec state, more than {extra_limit}")


class ChunkWriter:
    """Receives a checkpoint in pieces into a temporary name beside `final` (owner-only, at most
    `limit` bytes), and renames it only when whole and verified, by its SHA-256 and by `validate`
    ((tensors, metadata) -> None, raising a CheckpointError); `commit` raises CorruptCheckpoint (or
    validate's error) otherwise, and `write` CheckpointTooLarge. Closing it uncommitted removes the piece."""

    def __init__(self, final: Path, suffix: str = ".part", limit: int | None = None, validate=None):
        self.final, self.limit, self.validate = final, limit, validate
        final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = final.with_suffix(suffix)
        self.fh = os.fdopen(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
        self.bytes = 0

    def write(self, data: bytes) -> None:
        if self.limit is not None and self.bytes + len(data) > self.limit:
            self.close()
            raise CheckpointTooLarge(f"checkpoint {self.final.name} is larger than {self.limit} bytes: refused")
        self.fh.write(data)
        self.bytes += len(data)

    def commit(self) -> Path:
        self.fh.close()
        try:
            tensors, meta = read_verified(self.tmp)
            if self.validate is not None:
                self.validate(tensors, meta)
        except CheckpointError:
            self.close()
            raise
        durable_replace(self.tmp, self.final)
        return self.final

    def close(self) -> None:
        """Drop what was received (nothing is left once committed)."""
        if not self.fh.closed:
            self.fh.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ChunkWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Checkpoint:
    path: Path
    stage: int
    num_stages: int
    step: int


class CheckpointStore:
    """A directory of stage checkpoints; keeps the newest `keep` files of each stage."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.dir = Path(directory)
        self.keep = keep

    def list(self, stage: int, num_stages: int) -> list[Checkpoint]:
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = NAME.match(p.name)
            if m and int(m[1]) == stage and int(m[2]) == num_stages:
                found.append(Checkpoint(p, stage, num_stages, int(m[3])))
        return sorted(found, key=lambda c: c.step)

    def path(self, stage: int, num_stages: int, step: int) -> Path:
        return self.dir / checkpoint_name(stage, num_stages, step)

    def quarantine(self, ckpt: Checkpoint) -> Path:
        """Move a corrupt file aside (kept for inspection, never listed, loaded or uploaded again)."""
        aside = ckpt.path.with_name(ckpt.path.name + CORRUPT_SUFFIX)
        ckpt.path.replace(aside)
        return aside

    def prune(self, stage: int, num_stages: int, confirmed: int | None = None) -> None:
        """Keep only the newest `keep` files of the stage; with `confirmed` (the steps a ledger
        holds), the newest `keep` at or before it and, apart, the newest `keep` after it: files of
        steps nobody confirmed yet never push out those of steps that were."""
        found = self.list(stage, num_stages)
        if confirmed is None:
            old = found[: -self.keep]
        else:
            old = ([c for c in found if c.step <= confirmed][: -self.keep]
                   + [c for c in found if c.step > confirmed][: -self.keep])
        for ckpt in old:
            ckpt.path.unlink(missing_ok=True)

    def find(self, stage: int, num_stages: int, step: int) -> Checkpoint | None:
        return next((c for c in self.list(stage, num_stages) if c.step == step), None)

    def latest(self, stage: int, num_stages: int, at_most: int | None = None) -> Checkpoint | None:
        """The stage's newest file (of a step at most `at_most`, if given)."""
        found = [c for c in self.list(stage, num_stages) if at_most is None or c.step <= at_most]
        return found[-1] if found else None

    def save(self, stage: int, num_stages: int, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             run_json: str, extra: dict[str, torch.Tensor] | None = None, unreported: list | None = None,
             outer: dict[str, torch.Tensor] | None = None, pipeline: int = 0) -> Path:
        """Write durably (temp file, fsync, rename) with its SHA-256, and prune old files.
        `unreported`: the last stage's committed steps the coordinator has not heard of yet, as
        [step, loss, sample ids, seconds] (kept in the metadata, so a kill -9 loses none); `outer`:
        the outer weights and momentum, and `pipeline` the pipeline whose stage this is (pipelines in
        data parallel)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        aliases = tied_aliases(model)
        tensors = {f"model/{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()
                   if k not in aliases}
        names = {id(p): n for n, p in model.named_parameters()}
        opt_steps = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                name = names[id(p)]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        tensors[f"optim/{name}/{key}"] = state[key].detach().contiguous().cpu()
                if "step" in state:
                    opt_steps[name] = float(state["step"])
        for k, v in (extra or {}).items():
            tensors[f"extra/{k}"] = v.detach().contiguous().cpu()
        for k, v in (outer or {}).items():
            tensors[f"outer/{k}"] = v.detach().contiguous().cpu()
        meta = {"step": str(step), "stage": str(stage), "num_stages": str(num_stages), "run": run_json,
                "optim_steps": json.dumps(opt_steps)}
        if unreported:
            meta["unreported"] = json.dumps(unreported)
        if pipeline:
            meta["pipeline"] = str(pipeline)
        meta[DIGEST_KEY] = digest(tensors, meta)
        path = self.path(stage, num_stages, step)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        owner_only(tmp)
        durable_replace(tmp, path)
        self.prune(stage, num_stages)
        return path


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """State-dict names that are another name's tensor (a tied lm_head: the embedding), each to the
    first name of its tensor; a checkpoint stores that tensor once."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def optimized(tensors: dict[str, torch.Tensor]) -> set[str]:
    """The parameters a checkpoint's tensors hold AdamW moments of."""
    return {name[len("optim/"):-len("/exp_avg")] for name in tensors
            if name.startswith("optim/") and name.endswith("/exp_avg")}


def load(ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: RunConfig,
         codec_state: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], CheckpointMeta]:
    """Restore weights and optimizer state in place; returns the extra tensors (codec state, those of
    `codec_state` of its shapes; the outer weights and momentum as `outer/...`, for a run of
    pipelines in data parallel) and the metadata's record. Nothing changes when it raises:
    CorruptCheckpoint for a damaged file or one that does not fit (BadMetadata: its metadata),
    ForeignCheckpoint for a checkpoint of another run configuration (model, stages)."""
    tensors, raw = read_verified(ckpt.path)
    meta = CheckpointMeta.parse(raw, MetaForm(ckpt.stage, ckpt.num_stages, ckpt.step, run, f"checkpoint {ckpt.path}"),
                                optimized(tensors))
    shapes = {**stage_shapes(model, outer=has_outer(run)),
              **{f"extra/{k}": tuple(v.shape) for k, v in (codec_state or {}).items()}}
    check_fits(tensors, shapes, f"checkpoint {ckpt.path}", extra_limit=EXTRA_LIMIT_PER_DIM * model.cfg.dim)
    state = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    for alias, name in tied_aliases(model).items():  # a tied head is stored once, as the embedding
        if name in state:
            state.setdefault(alias, state[name])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ForeignCheckpoint(f"checkpoint {ckpt.path} does not fit stage {ckpt.stage}: missing {missing[:3]}, "
                                f"unexpected {unexpected[:3]}")
    params = dict(model.named_parameters())
    device = next(model.parameters()).device
    for name, p in params.items():
        if f"optim/{name}/exp_avg" in tensors:
            optimizer.state[p] = {
                "step": torch.tensor(float(meta.optim_steps.get(name, 0))),
                "exp_avg": tensors[f"optim/{name}/exp_avg"].to(device),
                "exp_avg_sq": tensors[f"optim/{name}/exp_avg_sq"].to(device),
            }
    extra = {k[len("extra/"):]: v for k, v in tensors.items() if k.startswith("extra/")}
    return {**extra, **{k: v for k, v in tensors.items() if k.startswith("outer/")}}, meta


def has_outer(run: RunConfig) -> bool:
    """Whether a run's checkpoints hold the outer weights: one that may train several pipelines."""
    return run.swarm.auto or run.swarm.pipelines > 1


class StageSaver:
    """Saves and restores one stage's whole state (weights, optimizer, codec state) in a store, and
    tells `on_saved(path, step)` of each file it wrote (the daemon uploads it)."""

    def __init__(self, store: CheckpointStore | None, stage: int, run: RunConfig, on_saved=None):
        self.store, self.stage, self.num_stages, self.run = store, stage, run.stages, run
        self.run_json = run.to_json()
        self.on_saved = on_saved
        # async fetch(step) -> bool: the daemon downloads a checkpoint of the stage from the coordinator
        self.fetch = None
        self.saved_step = -1
        self.unreported: list[StepRecord] = []  # what the checkpoint restored last held of steps not reported yet
        self.outer = None  # pipelines in data parallel: the OuterSync whose outer weights checkpoints keep
        self.pipeline = 0  # and the pipeline of the stage (the store's copy may be another pipeline's)

    async def ensure(self, step: int) -> bool:
        """A checkpoint of `step` is here (step 0 needs none: the initial weights), fetched with
        `fetch` if the store has none of its own; False if neither has one."""
        if step == 0 or (self.store is not None and self.store.find(self.stage, self.num_stages, step)):
            return True
        return self.fetch is not None and self.store is not None and await self.fetch(step)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, codecs,
             unreported: list | None = None) -> None:
        """Save the state of committed step `step` (once; nothing at step 0 or without a store)."""
        if self.store is None or step == 0 or step == self.saved_step:
            return
        self.saved_step = step
        outer = self.outer.checkpoint_tensors() if self.outer is not None else None
        path = self.store.save(self.stage, self.num_stages, step, model, optimizer, self.run_json,
                               codecs.tensors() or None, unreported, outer, self.pipeline)
        log.info("stage %d saved step %d to %s", self.stage, step, path)
        if self.on_saved:
            self.on_saved(str(path), step)

    def load_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, codecs) -> int:
        """Restore the newest sound checkpoint of the stage (a corrupt one is moved aside and the
        one before it tried); its step, or 0 if there is none."""
        for ckpt in reversed(self.store.list(self.stage, self.num_stages) if self.store else []):
            if self._try_restore(ckpt, model, optimizer, codecs):
                return ckpt.step
        return 0

    def load(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, codecs) -> bool:
        """Restore the checkpoint of `step`; False if the store has no sound one."""
        ckpt = self.store.find(self.stage, self.num_stages, step) if self.store else None
        return bool(ckpt) and self._try_restore(ckpt, model, optimizer, codecs)

    def _try_restore(self, ckpt: Checkpoint, model, optimizer, codecs) -> bool:
        """Restore `ckpt`; False (the file moved aside) if it is corrupt, which a file that does not
        load for any reason of its own is (damaged, its metadata or tensors not the stage's)."""
        try:
            self._restore(ckpt, model, optimizer, codecs)
        except CorruptCheckpoint as exc:
            log.error("stage %d: %s; moved aside to %s", self.stage, exc, self.store.quarantine(ckpt))
            return False
        return True

    def _restore(self, ckpt: Checkpoint, model, optimizer, codecs) -> int:
        extra, meta = load(ckpt, model, optimizer, self.run, codecs.tensors())
        codecs.load({k: v for k, v in extra.items() if not k.startswith("outer/")}, ckpt.step)
        if self.outer is not None:
            self.outer.restore({k[len("outer/"):]: v for k, v in extra.items() if k.startswith("outer/")}, ckpt.step)
        # another pipeline's steps: not ours
        self.unreported = list(meta.unreported) if meta.pipeline == self.pipeline else []
        log.info("stage %d loaded %s (step %d)", self.stage, ckpt.path, ckpt.step)
        return ckpt.step

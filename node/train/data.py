"""The training data: a prepared token file read back as fixed-length windows, in an order (the
sample schedule) that every machine computes alike; `open_dataset` finds the run's token file."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..config import RunConfig
from .corpus import BYTE_VOCAB_SIZE, TOKEN_DTYPES, DatasetInfo, default_corpus, file_sha256, index_path, prepare

__all__ = ["TokenDataset", "SampleSchedule", "open_dataset", "check_vocabulary", "check_run_data"]


class TokenDataset:
    """Fixed-length training samples from a prepared token file.

    Sample i is the window of seq_len + 1 tokens starting at token i * seq_len: its input is the
    window without its last token, its label the window without its first (next-token targets).
    Consecutive samples share one token; `len()` counts whole windows only."""

    def __init__(self, path: str | Path, seq_len: int, verify_hash: bool = False):
        """Opens `path` and its index; `verify_hash` re-hashes the file (slow for large ones)."""
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.info = DatasetInfo.read(index_path(self.path))
        if not self.path.is_file():
            raise FileNotFoundError(f"token file {self.path} does not exist")
        dtype = np.dtype(TOKEN_DTYPES[self.info.dtype])
        size = self.path.stat().st_size
        if size != self.info.n_tokens * dtype.itemsize:
            raise ValueError(f"token file {self.path} has {size} bytes, but its index says "
                             f"{self.info.n_tokens} {self.info.dtype} tokens = "
                             f"{self.info.n_tokens * dtype.itemsize} bytes (truncated or "
                             "replaced; run prepare again)")
        if verify_hash and file_sha256(self.path) != self.info.sha256:
            raise ValueError(f"token file {self.path} does not match the sha256 in its index")
        self._len = max(0, (self.info.n_tokens - 1) // seq_len)
        if self._len == 0:
            raise ValueError(f"token file {self.path} has {self.info.n_tokens} tokens: too few "
                             f"for one sample of seq_len {seq_len}")
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", shape=(self.info.n_tokens,))

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def __len__(self) -> int:
        return self._len

    def window(self, i: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample i."""
        if not 0 <= i < self._len:
            raise IndexError(f"sample id {i} is out of range (the dataset has {self._len})")
        start = i * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels), int64 tensors of shape (seq_len,)."""
        w = torch.from_numpy(self.window(i).astype(np.int64))
        return w[:-1], w[1:]

    def batch(self, sample_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of the samples, int64 tensors of shape (len(sample_ids), seq_len)."""
        if len(sample_ids) == 0:
            raise ValueError("batch needs at least one sample id")
        w = torch.from_numpy(np.stack([self.window(int(i)) for i in sample_ids]).astype(np.int64))
        return w[:, :-1], w[:, 1:]


# ------------------------------------------------------------------------------------------------
# Order
# ------------------------------------------------------------------------------------------------


class SampleSchedule:
    """Which sample ids each (step, pipeline, micro-batch) trains on, the same on every machine.

    The samples form one stream: epoch after epoch, each epoch a permutation of all ids (drawn
    from a torch.Generator seeded by (seed, epoch); the identity with shuffle=False). Pipeline p
    (of `slots`, the most a run may have: swarm.data_slots) owns the stream's lane p, `lane`
    positions from p * lane on (a whole run's samples: run.train.steps * samples_per_step); step s
    takes the samples at s * samples_per_step in its lane, micro-batch m the batch_size ids from
    m * batch_size on, so a batch may straddle two epochs. No two (step, pipeline) of a run share a
    position; pipeline 0 is the single stream of a single pipeline (every id once per epoch), and
    other pipelines start further on. Replaying a step gives the same ids. Identical across machines
    with the same torch version."""

    def __init__(self, num_samples: int, batch_size: int, micro_batches: int, seed: int = 0,
                 shuffle: bool = True, slots: int = 1, lane: int = 0):
        for name, value in (("num_samples", num_samples), ("batch_size", batch_size),
                            ("micro_batches", micro_batches), ("slots", slots)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if batch_size > num_samples:
            raise ValueError(f"batch_size {batch_size} exceeds the {num_samples} samples")
        self.num_samples = num_samples
        self.batch_size, self.micro_batches = batch_size, micro_batches
        self.seed, self.shuffle, self.slots = seed, shuffle, slots
        if slots > 1 and lane < batch_size * micro_batches:
            raise ValueError(f"pipelines' lanes of {lane} positions cannot hold a step of {batch_size * micro_batches}")
        self.lane = lane
        self._cached: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    @classmethod
    def for_run(cls, run: RunConfig, num_samples: int) -> "SampleSchedule":
        """The schedule of `run` over a data set of `num_samples`: its batch shape and seed, and a
        lane of the whole run's samples for each pipeline its [swarm] table allows (swarm.data_slots)."""
        t = run.train
        return cls(num_samples, t.batch_size, t.micro_batches, seed=t.seed, slots=run.swarm.data_slots,
                   lane=t.steps * t.batch_size * t.micro_batches)

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.micro_batches

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of sample ids for `epoch` (int64)."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                digest = hashlib.sha256(f"{self.seed}/epoch/{epoch}".encode()).digest()
                gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            self._cached = (epoch, order)
        return self._cached[1]

    def _stream(self, start: int, count: int) -> Iterator[int]:
        for pos in range(start, start + count):
            epoch, offset = divmod(pos, self.num_samples)
            yield int(self.epoch_order(epoch)[offset])

    def ids(self, step: int, micro_batch: int, pipeline: int = 0) -> list[int]:
        """The batch_size sample ids of micro-batch `micro_batch` of step `step` of `pipeline`."""
        if not 0 <= micro_batch < self.micro_batches:
            raise ValueError(f"micro_batch {micro_batch} is out of range "
                             f"(0..{self.micro_batches - 1})")
        return self.ids_at(step, micro_batch * self.batch_size, self.batch_size, pipeline)

    def ids_at(self, step: int, offset: int, count: int, pipeline: int = 0) -> list[int]:
        """The ids of samples offset..offset+count-1 of step `step` of `pipeline` (however the step is cut)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= pipeline < self.slots:
            raise ValueError(f"pipeline {pipeline} is out of range: the schedule keeps {self.slots} apart "
                             f"(0..{self.slots - 1})")
        if offset < 0 or count < 1 or offset + count > self.samples_per_step:
            raise ValueError(f"samples {offset}..{offset + count - 1} are not within a step of {self.samples_per_step}")
        return list(self._stream(pipeline * self.lane + step * self.samples_per_step + offset, count))

    def epoch(self, step: int) -> float:
        """How many epochs pipeline 0 has passed at the start of `step` (fractional)."""
        return step * self.samples_per_step / self.num_samples


def check_vocabulary(run: RunConfig, vocab_size: int, tokenizer: str, where: str | Path) -> None:
    """Refuse data tokenized for a larger vocabulary than the model's (it would end in an index
    error on stage 0's embedding)."""
    if vocab_size > run.model.vocab_size:
        raise ValueError(f"the data ({where}) was tokenized with a vocabulary of {vocab_size} ({tokenizer}) "
                         f"but the model's vocab_size is {run.model.vocab_size}: prepare the data with the model's "
                         "tokenizer (tahnode data prepare --tokenizer), or train a model of that vocabulary")


def check_run_data(run: RunConfig, here: bool = True) -> None:
    """The run's data fits its model: the built-in corpus (bytes), or the token file's index (read
    here; with `here` False, a missing index, the data being on another machine, is let pass)."""
    if not run.data:
        check_vocabulary(run, BYTE_VOCAB_SIZE, "bytes", "the built-in corpus")
    elif here or index_path(Path(run.data)).is_file():
        info = DatasetInfo.read(index_path(Path(run.data)))
        check_vocabulary(run, info.vocab_size, info.tokenizer, run.data)


def open_dataset(run: RunConfig, data_dir: str = "") -> TokenDataset:
    """The run's token file (`run.data`), or the built-in corpus, prepared on first use under
    `data_dir` (default: $TAHNODE_CACHE, else ~/.cache/tahnode)."""
    check_run_data(run)
    if run.data:
        return TokenDataset(run.data, run.train.seq_len)
    cache = Path(data_dir or os.environ.get("TAHNODE_CACHE", Path.home() / ".cache" / "tahnode"))
    out = cache / f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}-{run.data_limit_mb:g}mb.bin"
    if not out.exists():
        print(f"preparing the built-in corpus (Python's stdlib sources, {run.data_limit_mb:g} MB) in {out}", flush=True)
        cache.mkdir(parents=True, exist_ok=True)
        prepare(default_corpus(limit_bytes=int(run.data_limit_mb * 2**20)), out, progress=False)
    return TokenDataset(out, run.train.seq_len)

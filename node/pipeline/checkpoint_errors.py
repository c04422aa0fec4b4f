"""Why a checkpoint cannot be used, as classes: callers branch on them (a corrupt file is moved
aside and the one before it tried; an upload's class picks its gRPC status), never on their text."""

from __future__ import annotations

__all__ = ["BadMetadata", "CheckpointError", "CheckpointTooLarge", "CorruptCheckpoint", "ForeignCheckpoint"]


class CheckpointError(ValueError):
    """A checkpoint cannot be used."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that cannot be parsed or whose contents do not match its recorded SHA-256, or
    whose tensors do not fit its stage: a node moves it aside, the coordinator never stores it."""


class BadMetadata(CorruptCheckpoint):
    """A checkpoint whose metadata does not parse into its record (tahnode.pipeline.checkpoint_meta):
    wrong JSON, types, ranges or steps. Corrupt on a node; an upload of one is INVALID_ARGUMENT."""


class ForeignCheckpoint(CheckpointError):
    """A checkpoint of another run configuration (model or stages differ)."""


class CheckpointTooLarge(CheckpointError):
    """An upload beyond the size a checkpoint of its stage can have."""

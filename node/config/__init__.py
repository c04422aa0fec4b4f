"""Configuration as dataclasses, in one place: the model's shape and its presets, the run every
stage agrees on, and each process's own settings (defaults < TOML < flags)."""

from .emulation import LinkEmulation, parse_duration, parse_rate
from .model import PRESETS, ModelConfig, preset_names
from .node import (AUTO_STAGE, DEFAULT_COORDINATOR, CoordinatorConfig, NodeConfig, P2PSettings, PlacementSettings,
                   TlsMode, TransportKind)
from .run import CodecConfig, RunConfig, TrainConfig

__all__ = ["ModelConfig", "PRESETS", "preset_names", "TrainConfig", "CodecConfig", "RunConfig", "NodeConfig",
           "CoordinatorConfig", "PlacementSettings", "TransportKind", "TlsMode", "P2PSettings", "AUTO_STAGE",
           "DEFAULT_COORDINATOR", "LinkEmulation", "parse_rate", "parse_duration"]

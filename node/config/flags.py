"""The command-line flags that override the run configuration, shared by every command that
builds or forwards a RunConfig (coordinator, demo, swarm up): one flag per [train] and [swarm]
field, made from TrainConfig's and SwarmConfig's own fields and their help, so a new field cannot
be forgotten."""

from __future__ import annotations

import argparse
import dataclasses

from .model import preset_names
from .run import RunConfig, TrainConfig
from .swarm import SwarmConfig

__all__ = ["add_run_flags", "run_config_from", "run_flag_args", "train_flag", "KNOB_TABLES"]

KNOB_TABLES = (("train", TrainConfig), ("swarm", SwarmConfig))  # the tables whose every field is a flag


def train_flag(f: dataclasses.Field) -> str:
    """The flag of a TrainConfig or SwarmConfig field: its metadata's, else --field-name."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _shown(f: dataclasses.Field, default) -> str:
    """What --help says of a field's default (a parsed field names its default as a flag would)."""
    if default is None:
        return ""
    if isinstance(default, bool):
        return f" (default {'on' if default else 'off'})"
    if f.metadata.get("parse") is not None and default == 0:
        return " (default auto)"
    return f" (default {default:g})" if isinstance(default, float) else f" (default {default})"


def _knob_flags(p, section: str, kind) -> list[argparse.Action]:
    actions = []
    defaults = kind()
    for f in dataclasses.fields(kind):
        meta, default = f.metadata, getattr(defaults, f.name)
        value_type = meta.get("parse") or (type(default) if default is not None else float)
        kwargs = dict(dest=f"{section}_{f.name}", type=value_type, help=meta["help"] + _shown(f, default))
        if meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        actions.append(p.add_argument(train_flag(f), **kwargs))
    return actions


def add_run_flags(p) -> list[argparse.Action]:
    """Flags that override the run configuration (built-in defaults < --config TOML < flags); the
    actions they made (`run_flag_args` turns parsed values back into flags)."""
    from ..codecs import CODECS

    return [
        p.add_argument("--model", default="llama-tiny",
                       help=f"model preset ({', '.join(preset_names())}; shipped with tahnode), a TOML path, or a "
                       "Hugging Face config.json or checkpoint directory (default: llama-tiny)"),
        p.add_argument("--stages", type=int, help="number of pipeline stages (default 3)"),
        p.add_argument("--config", help="run TOML with [run], [train], [codec] and [swarm] tables"),
        p.add_argument("--codec", dest="forward_codec", choices=sorted(CODECS),
                       help="forward (activation) codec (default tahquant)"),
        p.add_argument("--backward-codec", choices=sorted(CODECS),
                       help="backward (gradient) codec (default pertoken: 6 bits, a scale per token and 128 channels)"),
        p.add_argument("--data",
                       help="prepared token file (tahnode data prepare); default: the built-in stdlib corpus"),
        *[action for section, kind in KNOB_TABLES for action in _knob_flags(p, section, kind)],
    ]


def run_config_from(args) -> RunConfig:
    """The run configuration of parsed run flags."""
    overrides = {"stages": args.stages, "data": args.data, "codec.forward": args.forward_codec,
                 "codec.backward": args.backward_codec}
    for section, kind in KNOB_TABLES:
        overrides.update({f"{section}.{f.name}": getattr(args, f"{section}_{f.name}")
                          for f in dataclasses.fields(kind)})
    if args.forward_codec and args.forward_codec != "tahquant":
        overrides["codec.forward_params"] = {}
    if args.backward_codec and args.backward_codec != "pertoken":
        overrides["codec.backward_params"] = {}
    return RunConfig.build(args.model, args.config, **overrides)


def run_flag_args(args, actions: list[argparse.Action], skip: tuple[str, ...] = ()) -> list[str]:
    """The flags (and values) of `actions` that were given, to pass the same run to another command."""
    out = []
    for action in actions:
        value = getattr(args, action.dest)
        if value is not None and action.dest not in skip and value != action.default:
            out += [action.option_strings[0], str(value)]
    return out

"""The command-line flags that override the run configuration, shared by every command that
builds or forwards a RunConfig (coordinator, demo, swarm up): one flag per [train] field, made from
TrainConfig's own fields and their help, so a new field cannot be forgotten."""

from __future__ import annotations

import argparse
import dataclasses

from .model import preset_names
from .run import RunConfig, TrainConfig

__all__ = ["add_run_flags", "run_config_from", "run_flag_args", "train_flag"]


def train_flag(f: dataclasses.Field) -> str:
    """The flag of a TrainConfig field: its metadata's, else --field-name."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _train_flags(p) -> list[argparse.Action]:
    actions = []
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        meta, default = f.metadata, getattr(defaults, f.name)
        kind = type(default) if default is not None else float
        shown = f" (default {default:g})" if isinstance(default, float) else f" (default {default})" if default is not None else ""
        kwargs = dict(dest=f"train_{f.name}", type=kind, help=meta["help"] + shown)
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
                       help=f"model preset ({', '.join(preset_names())}; shipped with tahnode), a TOML path, or a Hugging Face "
                       "config.json or checkpoint directory (default: llama-tiny)"),
        p.add_argument("--stages", type=int, help="number of pipeline stages (default 3)"),
        p.add_argument("--config", help="run TOML with [run], [train] and [codec] tables"),
        p.add_argument("--codec", dest="forward_codec", choices=sorted(CODECS), help="forward (activation) codec (default tahquant)"),
        p.add_argument("--backward-codec", choices=sorted(CODECS),
                       help="backward (gradient) codec (default pertoken: 6 bits, a scale per token and 128 channels)"),
        p.add_argument("--data", help="prepared token file (tahnode data prepare); default: the built-in stdlib corpus"),
        *_train_flags(p),
    ]


def run_config_from(args) -> RunConfig:
    """The run configuration of parsed run flags."""
    overrides = {"stages": args.stages, "data": args.data, "codec.forward": args.forward_codec, "codec.backward": args.backward_codec}
    overrides.update({f"train.{f.name}": getattr(args, f"train_{f.name}") for f in dataclasses.fields(TrainConfig)})
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

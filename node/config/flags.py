"""The command-line flags that override the run configuration, shared by every command that
builds or forwards a RunConfig (coordinator, demo, swarm up, bench swarm)."""

from __future__ import annotations

import argparse

from .model import preset_names
from .run import RunConfig

__all__ = ["add_run_flags", "run_config_from", "run_flag_args"]


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
        p.add_argument("--steps", type=int, help="optimizer steps to train"),
        p.add_argument("--codec", dest="forward_codec", choices=sorted(CODECS), help="forward (activation) codec (default tahquant)"),
        p.add_argument("--backward-codec", choices=sorted(CODECS), help="backward (gradient) codec (default naive, 6 bits)"),
        p.add_argument("--data", help="prepared token file (tahnode data prepare); default: the built-in stdlib corpus"),
        p.add_argument("--micro-batches", type=int, help="micro-batches per step (default 4)"),
        p.add_argument("--batch-size", type=int, help="samples per micro-batch (default 4)"),
        p.add_argument("--seq-len", type=int, help="tokens per sample (default 64)"),
        p.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)"),
        p.add_argument("--schedule", choices=["1f1b", "gpipe"], help="pipeline schedule (default 1f1b)"),
        p.add_argument("--pipeline-micro-batches", type=int, help="micro-batches the pipeline cuts each step into "
                       "(default 0: enough to keep slow links busy, tahnode.pipeline.schedule)"),
        p.add_argument("--memory-budget", type=float, metavar="MB", help="activation memory stage 0 may hold for micro-batches "
                       "in flight (default 4096)"),
        p.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default float32)"),
        p.add_argument("--seed", type=int, help="model init and data order seed (default 0)"),
        p.add_argument("--checkpoint-every", type=int, help="save each stage every N steps (default 20)"),
    ]


def run_config_from(args) -> RunConfig:
    """The run configuration of parsed run flags."""
    overrides = {
        "stages": args.stages, "data": args.data, "train.steps": args.steps, "codec.forward": args.forward_codec,
        "codec.backward": args.backward_codec, "train.micro_batches": args.micro_batches, "train.batch_size": args.batch_size,
        "train.seq_len": args.seq_len, "train.lr": args.lr, "train.schedule": args.schedule, "train.dtype": args.dtype,
        "train.seed": args.seed, "train.checkpoint_every": args.checkpoint_every,
        "train.pipeline_micro_batches": args.pipeline_micro_batches, "train.memory_budget_mb": args.memory_budget,
    }
    if args.forward_codec and args.forward_codec != "tahquant":
        overrides["codec.forward_params"] = {}
    if args.backward_codec and args.backward_codec != "naive":
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

"""`tahnode bench convergence`: does a codec pair train as well as uncompressed? Every pair trains
with seeds 0..N-1 on the pipeline replica (tahnode.pipeline.replica: the stages' exact math and
codec work in one process) and is compared with the reference pair (none/none) of the same seed.

It reports held-out loss (samples at the end of the data that no run trains on), bits per element,
relative error per boundary crossing, and the tokens and link time each pair needs to reach the
reference's final held-out loss; the table goes to docs/benchmarks-log.md, the plot beside it. Each
run's result is kept in --workdir, so a bench that was stopped picks up where it was."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from ..net.memory import reuse_message_buffers
from .bench_report import machine, write_section
from .swarm_cells import CodecPair
from .convergence_pipelines import add_pipeline_args, pipeline_report, pipeline_specs
from .convergence_report import plot, summarize, table
from .convergence_runs import RunResult, RunSpec, train_one
from .workers import worker_manager, worker_pool

__all__ = ["main", "build_parser", "plan"]

# the paper's algorithm with the three gradient codecs, then the product's default pair: tahquant with its
# precision schedule (docs/codecs.md)
DEFAULT_PAIRS = ("none/none;none/pertoken;tahquant-paper/naive;tahquant-paper/none;tahquant-paper/pertoken;"
                 "tahquant:group_size=128,qmax=12@start=0.12,end=0,qmax=31/pertoken")


# The bench's reference [train] where --config names none: the run defaults' learning rate after 60 warm-up steps
# instead of 10. At the run defaults none/none's held-out loss moved by up to 20% across seeds and one seed could not
# tell choices a few points apart; with these, 3.4% over 6 seeds on the stdlib corpus at 2 messages a step
# (docs/benchmarks-log.md, "a steadier reference"). The same as docs/runs/steady-reference.toml.
REFERENCE_TRAIN = {"lr": 3e-3, "warmup_steps": 60}
# ... and its batch: 4 messages a step (16,384 tokens), each of 32 x 128 tokens as before. At 2 a step
# none/none's seeds still ended 3.4% apart (issue 41's bar: 3%); at 4, 2.3% over the same 6 seeds
# (docs/benchmarks-log.md, "a steadier reference, twice the batch").
REFERENCE_MESSAGES_PER_STEP = 4
# Per seed, the default pair's gap moved with a standard deviation of 0.61 points on the stdlib corpus at that
# reference (0.86 at 2 messages a step): 4 seeds give its mean a standard error of about 0.3 (issue 41's bar: 0.5).
DEFAULT_SEEDS = 4


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench convergence", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default=None,
                    help="codec pairs FWD[:k=v,...]/BWD[:k=v,...], comma-separated; the first is the reference unless "
                    f"none/none is among them (default {DEFAULT_PAIRS}; with --pipelines, the last of them, the "
                    "product's default: tahquant with its schedule; the paper's algorithm is tahquant-paper). "
                    "Separate pairs with ';' when their parameters have commas")
    ap.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, metavar="N", help="train every pair with seeds "
                    f"0..N-1: weights and data order (default {DEFAULT_SEEDS}: enough for a standard error of about "
                    "half a point on the default pair's gap)")
    ap.add_argument("--first-seed", type=int, default=0, help="start the seeds here (default 0)")
    ap.add_argument("--model", default="llama-tiny",
                    help="model preset, TOML or Hugging Face config (default llama-tiny)")
    ap.add_argument("--stages", type=int, default=3, help="pipeline stages the model is cut into (default 3)")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    ap.add_argument("--tokens-per-message", type=int, default=4096, help="tokens in one micro-batch, i.e. in one "
                    "message between stages (default 4096: 32 samples of 128)")
    ap.add_argument("--messages-per-step", type=int, default=REFERENCE_MESSAGES_PER_STEP,
                    help="micro-batches per optimizer step (default %(default)s: the bench's reference; "
                    "2 before 2026-11-29)")
    ap.add_argument("--config", default="", help="a TOML file whose [train] table sets lr, warmup_steps, min_lr, ... "
                    "(default: the bench's reference, the built-in [train] defaults with "
                    + ", ".join(f"{k} = {v:g}" for k, v in REFERENCE_TRAIN.items())
                    + ": with --messages-per-step's default, none/none's held-out loss varies about 2%% across seeds "
                    "there, against up to 20%% at the run defaults)")
    ap.add_argument("--data", default="",
                    help="a token file from `tahnode data prepare` (default: the built-in corpus)")
    ap.add_argument("--data-mb", type=float, default=16.0, help="size of the built-in corpus in MB (default 16)")
    ap.add_argument("--init-from", default="", help="fine-tune this Hugging Face checkpoint folder instead of training "
                    "from scratch")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--dtype", default="", help="float32 or bfloat16 (default: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--eval-every", type=int, default=25, help="held-out loss every this many steps (default 25)")
    ap.add_argument("--eval-samples", type=int, default=512,
                    help="held-out samples, at the end of the data (default 512)")
    ap.add_argument("--jobs", type=int, default=0, help="runs at once (default: one per CPU core on cpu, 4 on a GPU)")
    ap.add_argument("--rates", default="10,50", help="link rates in Mbit/s for the time-to-loss column (default 10,50)")
    ap.add_argument("--workdir", default="bench-convergence", help="each run's result as JSON; runs already there "
                    "with the same settings are not trained again (default bench-convergence)")
    ap.add_argument("--name", default="convergence", help="the doc section and plot name (default convergence)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="where the table goes (default docs/benchmarks-log.md)")
    ap.add_argument("--plots", default="docs/plots", help="where the PNG plot goes (default docs/plots)")
    ap.add_argument("--no-doc", action="store_true", help="print the table only; leave the doc and plots alone")
    ap.add_argument("--json", action="store_true", help="print every run's result as one JSON list on the last line")
    add_pipeline_args(ap)
    return ap


def parse_pairs(text: str) -> list[CodecPair]:
    """Pairs separated by ';', else by ','; one pair whose parameters have commas needs no ';'."""
    parts = text.split(";") if ";" in text else text.split(",")
    if ";" not in text and text.count("/") == 1:
        parts = [text]
    pairs = [CodecPair.parse(p) for p in parts if p.strip()]
    if not pairs:
        raise ValueError("--pairs names no codec pair")
    return pairs


def jobs_for(args) -> int:
    """Runs at once: --jobs, else one per CPU core (each with one torch thread), or 4 sharing a GPU."""
    return args.jobs or (4 if args.device.startswith("cuda") else max(1, multiprocessing.cpu_count()))


def plan(args) -> list[RunSpec]:
    """Every (pair, seed) run, seed-major so that the first results already compare pairs."""
    if args.tokens_per_message % args.seq_len:
        raise ValueError(f"--tokens-per-message {args.tokens_per_message} is not whole samples of "
                         f"--seq-len {args.seq_len}")
    for name in ("seeds", "steps", "stages", "messages_per_step", "eval_every", "eval_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    on_gpu, jobs = args.device.startswith("cuda"), jobs_for(args)
    pairs = args.pairs or (DEFAULT_PAIRS.split(";")[-1] if args.pipelines else DEFAULT_PAIRS)
    specs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for pair in parse_pairs(pairs):
            specs.append(RunSpec(
                pair=pair.label, forward=pair.forward, forward_params=pair.forward_params, backward=pair.backward,
                backward_params=pair.backward_params, seed=seed, model=args.model, stages=args.stages, steps=args.steps,
                seq_len=args.seq_len, samples_per_message=args.tokens_per_message // args.seq_len,
                messages_per_step=args.messages_per_step, config=args.config, data=args.data, data_mb=args.data_mb,
                train={} if args.config else dict(REFERENCE_TRAIN),
                device=args.device, dtype=args.dtype or ("bfloat16" if on_gpu else "float32"), init_from=args.init_from,
                eval_every=args.eval_every, eval_samples=args.eval_samples, threads=0 if on_gpu or jobs == 1 else 1,
                schedule=pair.schedule))
    if args.pipelines:
        specs = pipeline_specs(specs, args)
    for spec in {s.pipelines: s for s in specs}.values():  # a bad model, config, codec or [swarm] setting fails here
        spec.run_config()
    return specs


def run_all(specs: list[RunSpec], workdir: Path, jobs: int) -> list[RunResult]:
    """Train the runs not yet in `workdir`, `jobs` at a time, with progress bars; every result."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    workdir.mkdir(parents=True, exist_ok=True)
    todo = [s for s in specs if not s.result_file(workdir).exists()]
    if todo:
        train_samples_ready(todo[0])
        with worker_manager() as manager, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                                   TimeElapsedColumn()) as bar, \
                worker_pool(min(jobs, len(todo)), reuse_message_buffers) as pool:  # host copies as in a daemon
            queue = manager.Queue()
            overall = bar.add_task(f"{len(todo)} runs ({len(specs) - len(todo)} done before)",
                                   total=len(todo) * todo[0].steps)
            futures = {pool.submit(train_one, spec, queue): spec for spec in todo}
            tasks: dict[str, tuple[int, int]] = {}  # run key -> (its task, steps counted)
            while any(not f.done() for f in futures) or not queue.empty():
                try:
                    key, done = queue.get(timeout=0.5)
                except Exception:  # queue.Empty through the manager's proxy
                    _collect(futures, workdir, bar, tasks)
                    continue
                if key not in tasks:
                    spec = next(s for s in todo if s.key == key)
                    tasks[key] = (bar.add_task(f"  {spec.pair} seed {spec.seed}", total=spec.steps), 0)
                task, counted = tasks[key]
                bar.update(task, completed=done)
                bar.advance(overall, done - counted)
                tasks[key] = (task, done)
                _collect(futures, workdir, bar, tasks)
            _collect(futures, workdir, bar, tasks)
    return [RunResult.load(path) for s in specs if (path := s.result_file(workdir)).exists()]


def train_samples_ready(spec: RunSpec) -> None:
    """Prepare the built-in corpus once here, before the workers would each start on it."""
    from ..train.data import open_dataset

    open_dataset(spec.run_config())


def _collect(futures: dict, workdir: Path, bar, tasks: dict) -> None:
    """Save the results of runs that ended; a run that raised is reported (and not saved)."""
    for future, spec in list(futures.items()):
        if not future.done():
            continue
        del futures[future]
        if spec.key in tasks:
            bar.remove_task(tasks[spec.key][0])
        if future.exception() is not None:
            bar.console.print(f"[red]run {spec.pair} seed {spec.seed} failed:[/red] {future.exception()}")
            continue
        result = future.result()
        result.save(workdir / f"{spec.key}.json")
        what = f"diverged ({result.diverged})" if result.diverged else f"held-out loss {result.final_eval:.4f}"
        bar.console.print(f"{spec.pair} seed {spec.seed}: {what}, {result.seconds:.0f} s")


def report(results: list[RunResult], specs: list[RunSpec], args, command: str) -> str:
    labels = list(dict.fromkeys(s.pair for s in specs))
    reference = "none/none" if "none/none" in labels else labels[0]
    summaries = summarize(results, reference)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    text = pipeline_report(results, specs, rates[0]) if args.pipelines else table(summaries, rates)
    if args.no_doc:
        return text
    spec = specs[0]
    run = spec.run_config()
    plots = [plot(summaries, reference, Path(args.plots) / f"{args.name}.png")]
    setting = (f"Model: {spec.model} in {spec.stages} stages, {spec.steps} steps of {spec.messages_per_step} "
               f"messages of {spec.samples_per_message} × {spec.seq_len} tokens, {spec.dtype} on {spec.device}; "
               f"lr {run.train.lr:g} ({run.train.warmup_steps} warm-up steps, cosine to {run.train.min_lr:g}); "
               + (f"fine-tuning {spec.init_from}; " if spec.init_from else "from scratch; ")
               + f"held-out loss over the last {spec.eval_samples} samples of the data, never trained on, every "
               f"{spec.eval_every} steps. " + (_pipelines_note(rates[0], args.swarm_steps) if args.pipelines else
               f"Gaps compare each seed with the reference ({reference}) of the same seed. Link time = tokens × "
               "width × bits per element of a link's busier direction / rate: what the link alone needs."))
    write_section(Path(args.doc), f"bench-convergence-{args.name}", f"Convergence: {args.name}",
                  [text, "", setting, "", f"Command: `{command}`"], plots, spec.device,
                  trained_on(results, spec.device))
    return text


def trained_on(results: list[RunResult], device: str) -> str | None:
    """Where the runs trained, when that is not (only) this machine with `device`: each machine with its
    runs (the table is made here; its runs may come from a workdir filled elsewhere, e.g. on a lent GPU)."""
    here = machine(device)
    counts = Counter(r.machine for r in results)
    if set(counts) <= {here}:
        return None
    return "; ".join(f"{n} run{'s' if n > 1 else ''} "
                     + (f"on {m}" if m else "that did not record where it trained") for m, n in counts.items())


def _pipelines_note(rate: float, swarm_steps: int) -> str:
    shorter = (f"P pipelines and their reference train {swarm_steps} steps, the learning-rate schedule over those; one "
               "pipeline alone the steps above. " if swarm_steps else "")
    return (shorter + "P pipelines train steps of the messages above each, on samples of their own; the reference is "
            "one pipeline with P times the messages per step (over the run, the same samples; one synchronous step), "
            "of the same seed. Averaging bytes: what the replicas sent each other for their outer steps (butterfly "
            "all-reduce of blockwise-coded pseudo-gradients), over the activations and gradients every pipeline sent. "
            "Replica spread: the largest difference between two replicas' outer weights after an outer step. "
            f"Wall-clock: a step takes its link time at {rate:g} Mbit/s (tokens × width × bits of the busier "
            "direction / rate), an outer step the time one replica needs to send its share; against one pipeline "
            "alone (of the same seed) training all its steps.")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        specs = plan(args)
    except ValueError as exc:
        print(f"tahnode bench convergence: {exc}", file=sys.stderr)
        return 2
    results = run_all(specs, Path(args.workdir), jobs_for(args))
    if not results:
        return 1
    command = ("tahnode bench convergence " + shlex.join(sys.argv[3:] if argv is None else argv)).strip()
    print(report(results, specs, args, command))
    if not args.no_doc:
        print(f"written to {args.doc}; plot in {args.plots}")
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    return 0 if len(results) == len(specs) else 1

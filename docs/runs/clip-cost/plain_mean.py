"""The clip rule's cost without a liar: `tahnode bench convergence --pipelines P`'s swarm runs (the product's outer
step, the bench's reference) trained with the clip rule and again with the plain mean (an infinite clip radius),
paired by seed, one torch thread a run, two runs at a time. Prints per seed both held-out losses, their difference
in points of the plain mean's, and the parts the rule clipped and the averages refused (both 0: it was the plain
mean all run, so the two runs are the same arithmetic). Usage, from the repository root:
    .venv/bin/python docs/runs/clip-cost/plain_mean.py --pipelines 2 --seeds 3 [--workdir /tmp/clip-cost]"""
import argparse
import json
import math
import multiprocessing
from pathlib import Path

from tahnode.tools import bench_convergence
from tahnode.tools.convergence_runs import RunResult, RunSpec, train_one

RULE_CONFIG = RunSpec.run_config


def plain_config(spec: RunSpec):
    """The spec's run, its reducers' clip radius infinite: nothing clipped, every average taken (the plain mean)."""
    run = RULE_CONFIG(spec)
    run.swarm.outer_clip = math.inf
    return run


def train(job: tuple[RunSpec, str, str]) -> tuple[str, str]:
    spec, rule, path = job
    if not Path(path).exists():
        if rule == "plain":
            RunSpec.run_config = plain_config
        train_one(spec).save(Path(path))
    return rule, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", default="2")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/clip-cost")
    mine = ap.parse_args()
    args = bench_convergence.build_parser().parse_args(
        ["--pipelines", mine.pipelines, "--seeds", str(mine.seeds), "--first-seed", str(mine.first_seed),
         "--jobs", "2"])
    specs = [s for s in bench_convergence.plan(args) if s.pipelines > 1]
    work = Path(mine.workdir)
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(s, rule, str(work / f"{rule}-{s.pipelines}p-seed{s.seed}.json"))
            for s in specs for rule in ("clip", "plain")]
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        for rule, path in pool.imap_unordered(train, jobs):
            print(f"done: {rule} {path}", flush=True)
    rows = []
    for s in specs:
        clip, plain = (RunResult.load(work / f"{rule}-{s.pipelines}p-seed{s.seed}.json") for rule in ("clip", "plain"))
        points = 100 * (clip.final_eval / plain.final_eval - 1)
        rows.append({"pipelines": s.pipelines, "seed": s.seed, "clip": clip.final_eval, "plain": plain.final_eval,
                     "points": points, "clipped": clip.clipped, "refused": clip.kept, "plain_clipped": plain.clipped,
                     "minutes": (clip.seconds + plain.seconds) / 60})
        print(f"P={s.pipelines} seed {s.seed}: clip rule {clip.final_eval:.5f}, plain mean {plain.final_eval:.5f} "
              f"({points:+.3f} points); {clip.clipped} parts clipped, {clip.kept} averages refused", flush=True)
    (work / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

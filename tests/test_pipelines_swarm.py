"""Pipelines in data parallel with real daemons, started as users start them (`tahnode coordinator
--pipelines auto`, `tahnode join --stage auto`) on 127.0.0.1: four volunteers train as two
pipelines whose replicas average through hivemind every few steps (at 2 bits, with error feedback);
two late volunteers form a third pipeline that starts from the others' latest outer step; every
pipeline's ledger has each of its steps once (those it skipped to take a newer replica's state marked
so, with their samples), their samples never overlap, and at the end the replicas of each stage hold the
same weights (to the pseudo-gradient codec's error)."""

from __future__ import annotations

import pytest
import torch

from tahnode.pipeline.checkpoint import read_verified
from swarm import Swarm

pytestmark = pytest.mark.slow

STEPS, EVERY = 160, 4
RUN = ["--stages", "2", "--steps", str(STEPS), "--checkpoint-every", "8", "--micro-batches", "2", "--batch-size", "4",
       "--seq-len", "64", "--codec", "none", "--backward-codec", "none", "--pipelines", "auto", "--standbys", "0",
       "--outer-every", str(EVERY), "--outer-timeout", "20", "--settle", "1", "--probe-wait", "2", "--min-chain-share",
       "0", "--outer-bits", "2", "--outer-feedback", "on"]  # the default 4 bits: tests/test_pipelines_faults.py


def pipelines_of(state: dict) -> dict[int, list[str]]:
    return {p["index"]: p["nodes"] for p in state.get("pipelines", []) if p["complete"]}


def final_weights(swarm: Swarm, node: str) -> dict[str, torch.Tensor]:
    """The model tensors of the node's newest checkpoint (the run's last step: after the last outer step)."""
    ckpts = sorted((swarm.workdir / "ck" / node).glob("stage*-step*.safetensors"),
                   key=lambda p: int(p.stem.rsplit("step", 1)[1]))
    tensors, _ = read_verified(ckpts[-1])
    assert ckpts[-1].stem.endswith(f"step{STEPS}"), ckpts
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


def test_pipelines_train_in_data_parallel_and_a_late_pair_forms_another(tmp_path):
    swarm = Swarm(tmp_path)
    try:
        swarm.start_coordinator(*RUN)
        swarm.wait_for(lambda s: s is not None, 60, "the coordinator")
        for k in range(4):
            swarm.join(f"n{k}", "auto", "--threads", "1")
        two = swarm.wait_for(lambda s: len(pipelines_of(s)) == 2
                             and all(p["step"] and p["step"] >= 6 for p in s["pipelines"]),
                             240, "two pipelines training past their first outer step")
        assert sorted(n for chain in pipelines_of(two).values() for n in chain) == ["n0", "n1", "n2", "n3"]
        for k in (4, 5):
            swarm.join(f"n{k}", "auto", "--threads", "1")
        three = swarm.wait_for(lambda s: len(pipelines_of(s)) == 3, 120, "a third pipeline of the late nodes")
        assert sorted(pipelines_of(three)[2]) == ["n4", "n5"]
        metrics = swarm.metrics()
        state = swarm.wait_for(lambda s: s["training"]["finished"], 600, f"{STEPS} steps of every pipeline")
        ledger = swarm.ledger()["steps"]
    finally:
        swarm.stop()
    by_pipeline: dict[int, list[dict]] = {}
    skipped: dict[int, list[dict]] = {}
    for entry in ledger:  # a step a pipeline skipped (it took a newer replica's state) is there, marked
        (skipped if entry["skipped"] else by_pipeline).setdefault(entry["pipeline"], []).append(entry)
    for p, entries in skipped.items():  # with the samples it did not train, and no loss
        assert all(e["loss"] is None and e["sample_ids"] for e in entries), p
        trained = {e["step"] for e in by_pipeline.get(p, [])}
        assert not trained & {e["step"] for e in entries}, p
    assert sorted(by_pipeline) == [0, 1, 2] and 0 in (by_pipeline[0][0]["step"], by_pipeline[1][0]["step"])
    for p, steps in by_pipeline.items():
        steps = [e["step"] for e in steps]
        # a pipeline placed after another began (the late pair; the second of the first four where
        # their joins straddled a placement) starts from the others' newest outer step
        assert steps[0] % EVERY == 0 and (p < 2 or steps[0] > 0) and steps[-1] == STEPS - 1, (p, steps)
        for a, b in zip(steps, steps[1:]):  # once each; a pipeline that fell behind took the others' newest outer step
            assert b == a + 1 or (b > a and b % EVERY == 0), (p, steps)
        assert p == 2 or len(steps) >= STEPS - 2 * EVERY, (p, steps)  # the first two fell behind once at most
    for step in range(STEPS):  # the pipelines' samples never overlap
        ids = [set(e["sample_ids"]) for p in range(3) for e in by_pipeline[p] if e["step"] == step]
        assert sum(map(len, ids)) == len(set().union(*ids)), step
    assert "tahnode_pipelines 3.0" in metrics and 'tahnode_node_pipeline{node="n5"} 2.0' in metrics
    nodes = {n["id"]: n for n in state["nodes"]}
    for chain_a, chain_b in ((pipelines_of(three)[0], pipelines_of(three)[1]),
                             (pipelines_of(three)[0], pipelines_of(three)[2])):
        for a, b in zip(chain_a, chain_b):  # the replicas of each stage end with one model
            wa, wb = final_weights(swarm, a), final_weights(swarm, b)
            assert nodes[a]["stage"] == nodes[b]["stage"] and wa.keys() == wb.keys()
            for name in wa:
                assert float((wa[name] - wb[name]).abs().max()) < 1e-3, (a, b, name)

"""A stage replica that misbehaves at its outer steps, for tests/test_pipelines_faults.py: the real
`tahnode join` daemon, patched in-process on a script.

- `liar`: from outer step 6 on, its pseudo-gradient is 1e30 everywhere (finite: it goes out), and it keeps its
  own weights at its outer steps.
- `stall`: in its third outer step, once its group formed, it writes MARKER and stops before it sends
  a part (the test kills it with SIGKILL: a replica that dies in the middle of an all-reduce).

Run as `python tests/faulty_replica.py MODE MARKER -- JOIN FLAGS...`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from tahnode import cli
from tahnode.net import averaging_parts
from tahnode.pipeline import outer_sync
from tahnode.train import outer

LIE_FROM, STALL_AT = 6, 3  # outer steps: the liar lies once the victim (its third) is dealt with
STALL_ENV = "TAHNODE_TEST_STALL_MARKER"  # the stalling replica's marker file, for its averager's process


def lie() -> None:
    """Lie at every outer step from LIE_FROM on, and train on its own weights meanwhile (its outer steps take
    no mean: a liar that would take its own lie's average would blow its pipeline up and lie no more). The
    honest reducers clip its parts into their radius and refuse its averages (tahnode.train.clip_rule)."""
    honest, take = outer.OuterOptimizer.pseudo_gradient, outer_sync.OuterSync._take
    calls = {"n": 0}

    def pseudo_gradient(self):
        calls["n"] += 1
        g = honest(self)
        return torch.full_like(g, 1e30) if calls["n"] >= LIE_FROM else g

    def own_weights(self, committed, mean, counted=None):
        return take(self, committed, None if calls["n"] >= LIE_FROM else mean, counted)

    outer.OuterOptimizer.pseudo_gradient = pseudo_gradient
    outer_sync.OuterSync._take = own_weights


def stall(marker: Path) -> None:
    """In hivemind's averager process: in the STALL_AT-th group it is in, before its first part goes out."""
    sent = averaging_parts.CheckedRunner._generate_input_for_peer
    rounds = {"n": 0, "group": None}

    async def generate(self, peer_index):
        if rounds["group"] != self.group_id:
            rounds["group"], rounds["n"] = self.group_id, rounds["n"] + 1
        if rounds["n"] >= STALL_AT:
            marker.write_text(f"stalled in its outer step {rounds['n']}, in a group of {len(self.ordered_peer_ids)}\n")
            while True:  # the test kills this process now (its event loop blocked: nothing more goes out)
                time.sleep(1)
        async for message in sent(self, peer_index):
            yield message

    averaging_parts.CheckedRunner._generate_input_for_peer = generate


def main() -> int:
    mode, marker, args = sys.argv[1], Path(sys.argv[2]), sys.argv[sys.argv.index("--") + 1:]
    lie() if mode == "liar" else stall(marker)
    os.environ[STALL_ENV] = str(marker) if mode == "stall" else ""  # for the averager's process (below)
    return cli.main(["join", *args])


# hivemind's averager process is a child of multiprocessing's forkserver (tahnode.net.clean_start), not of
# this one: it runs this script as "__mp_main__" before it starts, and patches itself here
if __name__ == "__mp_main__" and os.environ.get(STALL_ENV):
    stall(Path(os.environ[STALL_ENV]))


if __name__ == "__main__":
    sys.exit(main())

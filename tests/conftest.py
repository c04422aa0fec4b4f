"""Shared pytest setup: Triton runs in its CPU interpreter where there is no GPU, torch computes on
one thread, hypothesis gets a CI profile sized for 2 cores, and after the whole session no p2p
daemon (`p2pd`) the tests started may still run: each must end with the process that started it."""

import os
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' models are tiny, and the slow tests' daemons share the machine's cores with this
# process: torch's threads spinning beside other busy processes made a 5-step single-process
# training take 35 s instead of 0.3 s (2 cores, two other trainings running).
torch.set_num_threads(1)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def p2p_daemons() -> set[int]:
    """Pids of the running p2pd processes (hivemind's libp2p daemon)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "p2pd":
                found.add(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def kernels():
    """For tests of the Triton kernels: a CUDA GPU, or Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    if not torch.cuda.is_available():
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 without a GPU")


@pytest.fixture(scope="session", autouse=True)
def no_p2p_daemon_outlives_its_process():
    before = p2p_daemons()
    yield
    deadline = time.monotonic() + 15  # a daemon's watcher takes up to 3 s after its process ended
    while (left := p2p_daemons() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"p2p daemons still running after the tests: {sorted(left)}"

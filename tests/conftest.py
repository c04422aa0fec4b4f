"""Shared pytest setup: the repository's root off sys.path (its kernels/ folder is not Hugging Face's
`kernels`), Triton runs in its CPU interpreter where there is no GPU, torch computes on
one thread, hypothesis gets a CI profile sized for 2 cores, the tests that change the root network
namespace run one at a time under pytest-xdist, and after the whole session no p2p daemon (`p2pd`)
this session's tests started may still run: each must end with the process that started it."""

import os
import sys
import time
from pathlib import Path

# `python -m pytest` puts the repository's root first on sys.path, where its kernels/ folder (the package
# tahnode.kernels, found through the editable install) would stand in for Hugging Face's `kernels`, which
# transformers (>= 5.25) imports whenever it is installed: every transformers test failed with an ImportError
REPOSITORY = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != REPOSITORY]

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' models are tiny, and the slow tests' daemons share the machine's cores with this
# process: torch's threads spinning beside other busy processes made a 5-step single-process
# training take 35 s instead of 0.3 s (2 cores, two other trainings running).
torch.set_num_threads(1)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Every process this session's tests start inherits this variable, p2pd included: under pytest-xdist
# each worker is a session of its own, and must not count the daemons of another worker's tests.
os.environ["TAHNODE_TEST_SESSION"] = str(os.getpid())
SESSION_MARK = f"TAHNODE_TEST_SESSION={os.environ['TAHNODE_TEST_SESSION']}".encode()

# What shares the root network namespace (tahnode.tools.netns's host links in 10.78.0.0/16, dockerd's
# nftables and docker0, the CPU that shaped links are measured against): under pytest-xdist (`make test`
# runs 2 workers) these tests share one group, so one worker runs them one after another.
ROOT_NETWORK_GROUP = "root-network"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("netns") or item.get_closest_marker("root_network"):
            item.add_marker(pytest.mark.xdist_group(ROOT_NETWORK_GROUP))


def pytest_runtest_setup(item):
    """In a worker of `--dist loadgroup`, xdist names a grouped test `nodeid@group`; where it does not
    (pytest 9.2 with pytest-xdist 3.8: pytest-xdist issue 1386) the group is ignored, and two swarms
    could share the root namespace's host link at once: such a test fails, saying why."""
    if (item.config.getoption("loadgroup", default=False) and item.get_closest_marker("xdist_group")
            and "@" not in item.nodeid):
        pytest.fail(f"pytest-xdist's --dist loadgroup does not group tests with pytest {pytest.__version__} here; "
                    "install the versions pyproject.toml asks for", pytrace=False)


def p2p_daemons() -> set[int]:
    """Pids of the running p2pd processes (hivemind's libp2p daemon) that this session's tests started."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and (entry / "comm").read_text().strip() == "p2pd"
                    and SESSION_MARK in (entry / "environ").read_bytes().split(b"\0")):
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

"""`tahnode bench copies` (issue 27): a message's host-path copies, counted by the allocation shim.
The shim counts exactly what it is given, the path carries every payload there and back, and each
way copies the payload once (issue 27's aim; 18 and 9 copies before it, then 10.3 and 7)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tahnode.tools import bench_copies

pytestmark = pytest.mark.skipif(bench_copies.shutil.which("cc") is None and bench_copies.shutil.which("gcc") is None,
                                reason="needs a C compiler")


def test_the_shim_counts_a_known_copy(tmp_path):
    lib = bench_copies.build_shim(tmp_path)
    code = ("import ctypes, os; f = ctypes.CDLL(os.environ['TAHNODE_ALLOC_SHIM']).tahnode_big_bytes; "
            "f.restype = ctypes.c_size_t; data = bytes(1 << 20); b = f(); c = bytearray(data); d = f() - b; "
            "small = [bytes(100) for _ in range(1000)]; print(d, f() - b - d)")
    out = subprocess.run([sys.executable, "-c", code], env={"LD_PRELOAD": str(lib), "TAHNODE_ALLOC_SHIM": str(lib)},
                         capture_output=True, text=True, check=True).stdout.split()
    copied, small = int(out[0]), int(out[1])
    assert (1 << 20) <= copied < (1 << 20) + 4096  # one copy of 1 MiB
    assert small == 0  # blocks under 64 KiB are not counted


def test_every_codecs_host_path_copies_the_payload_once_each_way():
    counts = bench_copies.count_copies((2, 512, 768), ("none", "tahquant", "pertoken"))
    assert [c.codec for c in counts] == ["none", "tahquant", "pertoken"]
    for c in counts:
        assert c.payload_bytes >= 64 * 1024
        assert 1.0 <= c.send_copies <= 1.02 and 1.0 <= c.receive_copies <= 1.02, c


def test_the_cli_prints_json_and_refuses_a_bad_shape():
    run = lambda *a: subprocess.run([sys.executable, "-m", "tahnode.cli", "bench", "copies", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    done = run("--codecs", "none", "--json")
    assert done.returncode == 0, done.stderr
    assert [row["codec"] for row in json.loads(done.stdout.splitlines()[-1])] == ["none"]
    bad = run("--shape", "2,x")
    assert bad.returncode == 2 and "--shape must be B,S,C" in bad.stderr

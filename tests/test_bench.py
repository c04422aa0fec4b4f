"""`tahnode bench kernels` as users call it: its flags reach its own parser, bad input and a machine
without a GPU get clear errors, the rows it appends to docs/benchmarks-log.md keep one table header, and
its host-path rows carry a whole message there and back."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tahnode.codecs import decode
from tahnode.net.framing import FrameError
from tahnode.tools import bench_kernels, bench_sweep
from tahnode.tools.host_path import HostPath

TAHNODE = [sys.executable, "-m", "tahnode.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TAHNODE, *args], capture_output=True, text=True, timeout=120)


def test_flags_reach_the_bench_parser():
    r = run("bench", "kernels", "--help")
    assert r.returncode == 0
    for flag in ("--shape", "--dtype", "--iters", "--doc", "--profile", "--sweep"):
        assert flag in r.stdout
    r = run("bench", "kernels", "--shape", "4,x,8")
    assert r.returncode == 2 and "--shape must be B,S,C or 'all', got '4,x,8'" in r.stderr
    r = run("bench", "kernels", "--dtype", "int8")
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the bench would run")
def test_without_a_gpu_it_says_so(tmp_path):
    out = tmp_path / "bench.md"
    r = run("bench", "kernels", "--shape", "all", "--doc", str(out))
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr
    assert not out.exists()


def test_shapes_and_rows(tmp_path):
    assert bench_kernels._parse_shape("all") == bench_kernels.ALL_SHAPES
    assert bench_kernels._parse_shape("1,1024,1600") == [(1, 1024, 1600)]
    row = dict(op="tahquant encode", t=50e-6, ref=5e-3, diff="3", shape=(4, 2048, 4096), nbytes=64 * 2**20, clone=45e-6)
    line = bench_kernels.format_row(row, "NVIDIA H100 80GB HBM3", "2.11.0 / 3.6.0", "bf16", "2026-11-23")
    assert line == ("| 2026-11-23 | NVIDIA H100 80GB HBM3 | 2.11.0 / 3.6.0 | 4×2048×4096 | bf16 | tahquant encode | "
                    "50.0 | 1342 | 1.11 | 5000 | 100.0 | 3 |")
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nearlier text\n")
    bench_kernels.append_rows(str(page), [line])
    page.write_text(page.read_text() + "\n## A later section\n\n| its | table |\n|---|---|\n| a | b |\n")
    later = line.replace("2026-11-23", "2026-11-25")
    bench_kernels.append_rows(str(page), [later])
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nearlier text\n")
    assert text.count("| date | GPU |") == 1
    assert text.index(line) < text.index(later) < text.index("## A later section")  # under the kernel table's rows
    assert text.endswith("| a | b |\n")


def test_a_whole_messages_host_path_gives_the_decoded_tensor():
    """The host-path rows (issue 27) run on any device: every codec's frames come back as what its
    decode gives, and a frame list is received once (the bench makes one per timed run)."""
    x = bench_kernels.activations((2, 64, 256), torch.bfloat16, device="cpu")
    rows = bench_kernels.host_path_rows(x, 2, codecs=("none", "tahquant-paper", "tahquant"))
    assert [r["op"] for r in rows] == ["x.cpu()", "none: tensor -> frames", "none: frames -> tensor",
                                       "tahquant-paper: tensor -> frames", "tahquant-paper: frames -> tensor",
                                       "tahquant: tensor -> frames", "tahquant: frames -> tensor"]
    assert all(r["diff"] == "" and r["t"] > 0 for r in rows)
    path = HostPath("pertoken")
    frames = path.send(x)
    got = path.receive(frames, "cpu")
    assert torch.equal(got, decode(path.codec.encode(x)))
    # 0.08: 6 bits, outlier channels ×20
    assert got.shape == x.shape and float((got.float() - x.float()).norm() / x.float().norm()) < 0.1
    with pytest.raises(FrameError):  # the same frames again are a replay
        path.receive(frames, "cpu")


def test_a_payload_is_received_into_the_buffer_its_device_asks_for(monkeypatch):
    """A GPU stage reassembles envelopes, and copies payloads carried inside their message, into
    receive_buffer(device) (page-locked memory there): the same tensor as through a bytearray."""
    import numpy as np

    from tahnode.codecs import base

    given: list[int] = []

    def fake_pinned(n: int):
        given.append(n)
        return np.full(n, 0xA5, dtype=np.uint8)  # not zeroed: every byte must be written

    monkeypatch.setattr(base, "pinned_buffer", fake_pinned)
    assert base.receive_buffer("cpu") is bytearray and base.receive_buffer(torch.device("cpu")) is bytearray
    assert base.receive_buffer("cuda:0") is fake_pinned
    x = bench_kernels.activations((2, 64, 256), torch.bfloat16, device="cpu")
    path = HostPath("pertoken")
    want = decode(path.codec.encode(x))
    msg, payload = path.message(path.send(x), allocate=base.receive_buffer("cuda"))
    assert len(given) == 1 and given[0] > payload.nbytes > 0  # the whole envelope, its payload a view of it
    assert torch.equal(decode(msg, payload=payload), want)
    inline = path.codec.encode(x)
    got = base.payload_tensor(inline, None, base.receive_buffer("cuda"))
    assert (given[1] == len(inline.payload)
            and torch.equal(got, torch.frombuffer(bytearray(inline.payload), dtype=torch.uint8)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_payload_waits_in_page_locked_memory():
    from tahnode.codecs import base

    buf = base.receive_buffer("cuda")(1 << 20)
    assert torch.from_numpy(buf).is_pinned()
    x = bench_kernels.activations((2, 64, 256), torch.bfloat16, device="cuda")
    path = HostPath("none")
    assert torch.equal(path.receive(path.send(x), "cuda"), x)


def test_every_launch_setting_the_sweep_times_gives_the_references_bytes(kernels, monkeypatch):
    """--sweep (issue 27): a run's default pair at every launch setting it times, in the GPU's
    settings (Triton's interpreter runs them on a CPU), encodes the reference's payload byte for byte
    and decodes its values bit for bit; the rows name each setting, the defaults first, and the
    summary names the fastest setting that gives the reference's bytes."""
    from tahnode.kernels import rice_triton, symtiles_triton

    if torch.cuda.is_available():
        pytest.skip("on a GPU the sweep's own rows count the bytes that differ from the reference (bytes ≠ ref)")
    for module in (rice_triton, symtiles_triton):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    x = bench_kernels.activations((1, 16, 256), torch.bfloat16, device="cpu")
    defaults = symtiles_triton.GPU_ENCODE_BLOCK, symtiles_triton.GPU_DECODE_BLOCK, rice_triton.GPU_DECODE_BLOCK
    calls = []
    rows = bench_sweep.sweep_rows(x, 1, timer=lambda fn, iters: calls.append(fn()) or 1e-3)
    settings = bench_sweep.sweep_settings()
    assert len(rows) == len(calls) == 2 * sum(len(names) for *_, names in settings)
    assert len(settings) == 1 + len(bench_sweep.SYMTILES_BLOCKS) + len(bench_sweep.RICE_BLOCKS)
    assert [r["diff"] for r in rows] == ["0"] * len(rows)
    y = x.clone()
    y[0, 3, :2] = -y[0, 3, :2] - 1
    assert bench_sweep._differing(y, x) == "2" and bench_sweep._differing(y[0], x).startswith("[16, 256]")
    assert rows[0]["op"] == "pertoken encode [symtiles {}/{}, default]".format(*defaults[0])
    assert rows[3]["op"] == "tahquant decode [symtiles {}/{}, default]".format(*defaults[1])
    assert "tahquant encode [symtiles {}/{}]".format(*bench_sweep.SYMTILES_BLOCKS[-1]) in [r["op"] for r in rows]
    assert rows[-1]["op"] == "tahquant decode [rice {}/{}]".format(*bench_sweep.RICE_BLOCKS[-1][1])
    lines = bench_sweep.fastest_settings([dict(r, t=1e-3 if "default" in r["op"] else 2e-3) for r in rows])
    assert lines[0] == "pertoken encode, symtiles: the defaults are fastest (1000.0 us)"
    assert len(lines) == 6  # pertoken encode, decode; tahquant encode, decode by symtiles and by rice
    rows[-1].update(t=1e-4)
    rows[-2].update(t=1e-4, diff="3")  # a faster setting that gives other bytes is not chosen
    lines = bench_sweep.fastest_settings([dict(r, t=r["t"] if r["t"] < 1e-3 else 1e-3) for r in rows])
    assert lines[-1] == "tahquant decode, rice: fastest {}/{} 100.0 us, the defaults 1000.0 us (10.00x)".format(
        *bench_sweep.RICE_BLOCKS[-1][1])
    assert lines[3] == "tahquant encode, rice: the defaults are fastest (1000.0 us)"
    # every setting put back
    assert defaults == (symtiles_triton.GPU_ENCODE_BLOCK, symtiles_triton.GPU_DECODE_BLOCK,
                        rice_triton.GPU_DECODE_BLOCK)


@pytest.mark.parametrize("tool", ["abuse", "convergence", "coordinator", "nat", "soak", "swarm"])
def test_every_bench_that_writes_a_doc_section_names_it_with_one_flag(tool):
    import importlib

    parser = importlib.import_module(f"tahnode.tools.bench_{tool}").build_parser()
    assert parser.parse_args(["--name", "mine"]).name == "mine"
    assert parser.parse_args([]).name == tool

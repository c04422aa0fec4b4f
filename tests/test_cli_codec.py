"""`tahnode codec eval` as users run it: the installed console script on real files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import outlier_activations

TAHNODE = str(Path(sys.executable).parent / "tahnode")
KEYS = {"codec", "shape", "bits_per_element", "sqnr_db", "max_abs_err", "encode_ms", "decode_ms", "device"}


def run(*args):
    return subprocess.run([TAHNODE, "codec", "eval", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def act(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "act.pt"
    torch.save(outlier_activations((2, 64, 1024), seed=9), path)
    return path


@pytest.mark.parametrize("codec", ["none", "naive", "group", "tahquant", "tahquant-paper", "aqsgd", "amaq"])
def test_json_report(act, codec):
    r = run(str(act), "--codec", codec, "--json", "--repeat", "1")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert KEYS <= set(report)
    assert report["codec"] == codec and report["shape"] == [2, 64, 1024] and report["device"] == "cpu"
    if codec == "none":
        assert report["sqnr_db"] is None and report["max_abs_err"] == 0  # exact: infinite SQNR is null
    if codec == "tahquant-paper":
        assert 4.0 < report["bits_per_element"] < 4.45 and report["sqnr_db"] > 15
    if codec == "tahquant":
        assert 4.5 < report["bits_per_element"] < 5.0 and report["sqnr_db"] > 20  # qmax 12: finer, a few more bits
    if codec in ("aqsgd", "amaq"):
        assert "note" in report


def test_text_report_and_params(act):
    r = run(str(act), "--codec", "tahquant-paper", "--param", "rho=0.5", "--param", "tau=1.5")
    assert r.returncode == 0, r.stderr
    assert "bits/element" in r.stdout and "SQNR" in r.stdout and "dB" in r.stdout


def test_safetensors_input(tmp_path):
    path = tmp_path / "acts.safetensors"
    save_file({"h": outlier_activations((1, 16, 256), seed=1), "g": torch.randn(4, 64)}, path)
    r = run(str(path), "--codec", "group", "--json", "--key", "h")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shape"] == [1, 16, 256]
    r = run(str(path), "--codec", "group")
    assert r.returncode == 2 and "--key" in r.stderr


def test_clear_errors(tmp_path, act):
    r = run(str(tmp_path / "missing.pt"), "--codec", "none")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = run(str(act), "--codec", "tahquant", "--param", "colour=1")
    assert r.returncode == 2 and "no parameter 'colour'" in r.stderr
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a tensor")
    r = run(str(bad), "--codec", "none")
    assert r.returncode == 2 and "not a readable" in r.stderr
    r = run(str(act), "--codec", "nosuch")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_data_prepare_command(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello tahnode\n")
    out = tmp_path / "data.bin"
    r = subprocess.run([TAHNODE, "data", "prepare", "--input", str(tmp_path / "docs"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "wrote 15 tokens" in r.stdout  # 14 bytes + the end-of-document token
    assert out.stat().st_size == 15 * 2
    r = subprocess.run([TAHNODE, "data", "prepare", "--input", str(tmp_path / "nowhere"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr

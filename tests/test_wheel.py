"""tahnode as a user installs it: the wheel, installed without the source tree (no editable install),
finds its presets and its status page, and `tahnode demo` trains from it in another directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert r.returncode == 0, f"{' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}"
    return r


def test_the_wheel_installed_elsewhere_runs_the_demo(tmp_path):
    source = tmp_path / "source"  # a copy of what the wheel is built from: no stale build/ folder of the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "node", "kernels", "proto", "configs"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name,
             **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, source,
        timeout=300)
    wheel = next(wheels.glob("tahnode-*.whl"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # the dependencies (torch, grpcio, ...) come from this interpreter's site-packages; a path in a
    # .pth file adds the folder only, so this checkout's editable install is not activated there
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    deps = run(sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(purelib, "tahnode-test-deps.pth").write_text(deps + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TAHNODE_CACHE"] = str(tmp_path / "cache")
    probe = ("import importlib.resources, json, tahnode, tahnode.config as c; print(json.dumps({'file': "
             "tahnode.__file__, 'presets': c.preset_names(), 'page': importlib.resources.files('tahnode.coordinator')"
             ".joinpath('status_page.html').read_text()[:15]}))")
    found = json.loads(run(python, "-c", probe, cwd=elsewhere, env=env).stdout)
    assert Path(found["file"]).is_relative_to(venv)
    assert {"llama-tiny", "llama-125m", "llama-1b"} <= set(found["presets"])
    assert found["page"] == "<!doctype html>"

    r = run(venv / "bin" / "tahnode", "demo", "--steps", "2", "--json", "--http-port", "0", "--workdir",
            tmp_path / "demo", cwd=elsewhere, env=env, timeout=300)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["loss_last"] < summary["loss_first"]
    assert 4.3 < summary["forward_bits_per_element"] < 4.5

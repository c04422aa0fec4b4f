"""The README's "Start from a Hugging Face model" block, run as the script it is (a coordinator and
two volunteers fine-tuning a transformers-saved Llama at lr 1e-5, then the export), exits 0, and
transformers loads what it exported."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tahnode.tools.swarm import free_ports

ROOT = Path(__file__).resolve().parents[1]


def readme_block(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(f"## {title}"):]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_hugging_face_block_runs_as_a_script(tmp_path):
    script = readme_block("Start from a Hugging Face model")
    assert "--lr 1e-5" in script  # fine-tuning at a fine-tuning learning rate
    grpc, http = free_ports(2)
    script = script.replace("127.0.0.1:7000", f"127.0.0.1:{grpc}").replace("127.0.0.1:8080", f"127.0.0.1:{http}")
    script = script.replace(".venv/bin/python", sys.executable)
    (tmp_path / "block.sh").write_text("set -e\n" + script)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               TAHNODE_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = tmp_path / "block.log"  # a file, not a pipe: the coordinator the block leaves running keeps its stdout open
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(tmp_path / "block.sh")], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=420)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)  # that coordinator
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert "LlamaForCausalLM" in out  # the exported model, loaded by transformers
    assert (tmp_path / "trained" / "config.json").is_file()

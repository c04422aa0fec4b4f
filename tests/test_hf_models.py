"""Real checkpoints, against the `transformers` library as the reference: a tiny random Llama with
Llama 3's rope scaling and grouped-query attention, saved with save_pretrained, is read by
`--model DIR` (its config.json) and loaded stage by stage; the logits equal transformers' in fp32.
A rope type tahnode cannot compute is refused, naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from tahnode.config import RunConfig
from tahnode.config.model import ModelConfig, RopeScaling
from tahnode.train.hf import load_stage_from_hf
from tahnode.train.model import build_stage

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def tiny_llama(tmp_path, **overrides):
    """A random LlamaForCausalLM saved with save_pretrained; (its directory, the model)."""
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    cfg = transformers.LlamaConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def chain_logits(stages: list, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the stages run in turn; a tied model's last hidden states go back to stage 0's head."""
    x = tokens
    for s in stages:
        x = s(x)
    return stages[0].head(x) if stages[0].ring else x


def stage_logits(directory, tokens: torch.Tensor, stages: int) -> torch.Tensor:
    cfg = ModelConfig.from_name(directory)
    with torch.no_grad():
        return chain_logits([load_stage_from_hf(build_stage(cfg, k, stages), directory) for k in range(stages)], tokens)


@pytest.mark.parametrize("stages", [1, 3])
def test_a_llama3_checkpoint_with_rope_scaling_and_gqa_matches_transformers(tmp_path, stages):
    directory, reference = tiny_llama(tmp_path, rope_scaling=dict(LLAMA3_ROPE))
    cfg = ModelConfig.from_name(directory)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32) and cfg.rope_theta == 500000.0 and cfg.n_kv_heads == 2
    tokens = torch.randint(0, 96, (2, 200))  # past the original 32 positions, where the scaling acts
    with torch.no_grad():
        want = reference(tokens).logits
    got = stage_logits(directory, tokens, stages)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_tied_checkpoint_matches_transformers_with_the_head_on_stage_0(tmp_path, stages):
    """tie_word_embeddings (Llama 3.2 1B, small Qwen2.5): the checkpoint has no lm_head.weight; over
    several stages stage 0 holds the embedding and the head that is it."""
    directory, reference = tiny_llama(tmp_path, tie_word_embeddings=True)
    cfg = ModelConfig.from_name(directory)
    assert cfg.tie_embeddings and RunConfig.build(str(directory), None, stages=stages).ring == (stages > 1)
    tokens = torch.randint(0, 96, (2, 50))
    with torch.no_grad():
        want = reference(tokens).logits
    assert (stage_logits(directory, tokens, stages) - want).abs().max().item() < 1e-5


def test_the_scaling_changes_the_model_and_survives_the_run_config(tmp_path):
    """Without its rope scaling the same weights give other logits (the field is not decoration);
    the scaling travels in the run configuration every stage receives."""
    directory, reference = tiny_llama(tmp_path, rope_scaling=dict(LLAMA3_ROPE))
    plain = ModelConfig.from_name(directory)
    tokens = torch.randint(0, 96, (1, 200))
    with torch.no_grad():
        want = reference(tokens).logits
        unscaled = load_stage_from_hf(build_stage(ModelConfig(**{**plain.__dict__, "rope_scaling": None}), 0, 1),
                                      directory)(tokens)
    assert (unscaled - want).abs().max().item() > 1e-3
    run = RunConfig.build(str(directory), None)
    assert RunConfig.from_json(run.to_json()).model.rope_scaling == plain.rope_scaling


def test_an_unknown_rope_type_and_a_partial_llama3_table_are_refused(tmp_path):
    directory, _ = tiny_llama(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    for rope, needle in (({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
                          "rope_type 'yarn' is not supported"),
                         ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}, "lacks low_freq_factor")):
        (directory / "config.json").write_text(json.dumps({**config, "rope_parameters": rope, "rope_scaling": rope}))
        with pytest.raises(ValueError, match=needle):
            ModelConfig.from_name(directory)


def test_init_from_a_checkpoint_of_another_model_names_every_field_that_differs(tmp_path):
    from tahnode.train.hf import check_hf_config

    directory, _ = tiny_llama(tmp_path, rope_scaling=dict(LLAMA3_ROPE))
    ours = ModelConfig.from_name(directory)
    check_hf_config(ours, directory)  # the same model: nothing to say
    other = ModelConfig(**{**ours.__dict__, "rope_theta": 10000.0, "n_layers": 2, "rope_scaling": None})
    with pytest.raises(ValueError) as refused:
        check_hf_config(other, directory)
    text = str(refused.value)
    assert "n_layers is 4 there but 2 in the run" in text and "rope_theta is 500000.0 there but 10000.0" in text
    assert "rope_scaling is RopeScaling(" in text and "--model" in text
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_hf_config(ours, tmp_path)


def tiny_qwen2(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", model


@pytest.mark.parametrize("kind", ["llama3", "llama-tied", "qwen2"])
def test_trained_stages_export_to_a_folder_transformers_loads_with_the_same_logits(tmp_path, kind):
    """Three stages loaded from a checkpoint (`--model DIR`, weights per stage), a few AdamW steps
    through the chain, each stage saved as the daemons save it; `tahnode export` merges them, and
    from_pretrained gives the logits the trained stages give."""
    import subprocess
    import sys

    from tahnode.pipeline.checkpoint import CheckpointStore

    if kind == "qwen2":
        directory, _ = tiny_qwen2(tmp_path)
    else:
        directory, _ = tiny_llama(tmp_path, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=kind == "llama-tied")
    run = RunConfig.build(str(directory), None, stages=3)
    stages = [load_stage_from_hf(build_stage(run.model, k, 3), directory) for k in range(3)]
    optimizers = [torch.optim.AdamW(s.parameters(), lr=1e-3) for s in stages]
    tokens = torch.randint(0, 96, (2, 80))
    for _ in range(3):
        loss = stages[-1].loss(chain_logits(stages, tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    store = CheckpointStore(tmp_path / "store" / "run-abc", keep=3)
    for k, (s, opt) in enumerate(zip(stages, optimizers)):
        store.save(k, 3, 3, s, opt, run.to_json())
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "tahnode.cli", "export", "--checkpoint-dir", str(tmp_path / "store"),
                           "--out", str(out), "--shard-mb", "0.05"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exported step 3 of 3 stages" in done.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == ("Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM")
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr() or kind != "llama-tied"
    probe = torch.randint(0, 96, (1, 120))
    with torch.no_grad():
        want = chain_logits(stages, probe)
        got = exported(probe).logits
    assert (got - want).abs().max().item() < 1e-5
    assert ModelConfig.from_name(out) == run.model
    again = subprocess.run([sys.executable, "-m", "tahnode.cli", "export", "--checkpoint-dir", str(tmp_path / "store"),
                            "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "refusing to write over it" in again.stderr

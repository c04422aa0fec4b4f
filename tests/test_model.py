"""Tests of the stage model: a partitioned model computes what the whole one does, forward and
backward; HF names, seeded init, checkpoint loading, presets and parameter counts."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tahnode.config import ModelConfig, preset_names
from tahnode.train.hf import load_stage_from_hf
from tahnode.train.model import (StageModel, apply_rope, build_stage, full_model, param_count, rope_cos_sin,
                                 stage_layers)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # the presets in the source tree

TINY = ModelConfig(vocab_size=96, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=160,
                   max_seq_len=32)


def hf_names(cfg: ModelConfig, layers, first: bool, last: bool) -> set[str]:
    """The Hugging Face Llama state-dict names of a stage holding `layers`."""
    names = set()
    if first:
        names.add("model.embed_tokens.weight")
    for i in layers:
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    if last:
        names |= {"model.norm.weight", "lm_head.weight"}
    return names


def run_pipeline(stages: list[StageModel], tokens, labels):
    """Forward through the stages passing detached activations, then backward stage by stage,
    as the pipeline does across machines. Returns the logits and the loss."""
    inputs, outputs = [], []
    x = tokens
    for stage in stages:
        if not stage.is_first:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = stage(x)
        outputs.append(x)
    loss = stages[-1].loss(outputs[-1], labels)
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        outputs[k].backward(inputs[k + 1].grad)
    return outputs[-1], loss


def test_three_stages_equal_one_stage_forward_and_backward():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 24), generator=gen)
    labels = torch.randint(0, TINY.vocab_size, (2, 24), generator=gen)

    whole = full_model(TINY, seed=7)
    logits_ref = whole(tokens)
    loss_ref = whole.loss(logits_ref, labels)
    loss_ref.backward()

    stages = [build_stage(TINY, k, 3, seed=7) for k in range(3)]
    logits, loss = run_pipeline(stages, tokens, labels)

    assert logits.shape == (2, 24, TINY.vocab_size)
    torch.testing.assert_close(logits, logits_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(loss, loss_ref, atol=1e-6, rtol=0)
    ref_grads = {n: p.grad for n, p in whole.named_parameters()}
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-6, rtol=0, msg=name)
            seen.add(name)
    assert seen == set(ref_grads)


def test_loss_is_mean_cross_entropy_and_starts_near_log_vocab():
    model = full_model(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    loss = model.loss(logits, tokens)
    by_hand = -torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).mean()
    torch.testing.assert_close(loss, by_hand)
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.5  # small init: near uniform


def test_causal():
    """Changing a later token leaves the earlier positions' outputs unchanged."""
    model = full_model(TINY, seed=0)
    a = torch.randint(0, TINY.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    b = a.clone()
    b[0, 8] = (b[0, 8] + 1) % TINY.vocab_size
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :8], lb[:, :8], atol=1e-6, rtol=0)
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


def test_state_dict_names_are_hf_with_global_indices():
    assert set(full_model(TINY).state_dict()) == hf_names(TINY, range(6), True, True)
    expected = [(range(0, 2), True, False), (range(2, 4), False, False), (range(4, 6), False, True)]
    for k, (layers, first, last) in enumerate(expected):
        stage = build_stage(TINY, k, 3)
        assert stage.layer_ids == layers
        assert set(stage.state_dict()) == hf_names(TINY, layers, first, last)


def test_init_is_seeded_per_name_and_scaled():
    a, b, c = full_model(TINY, seed=3), full_model(TINY, seed=3), full_model(TINY, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"],
                           sc["model.layers.0.mlp.up_proj.weight"])
    # different names draw different values
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"],
                           sa["model.layers.1.mlp.up_proj.weight"])
    # the same layer is the same whichever stage holds it
    stage = build_stage(TINY, 2, 4, seed=3)  # layers 4 of 6 over 4 stages: 2,2,1,1 -> layer 4
    assert list(stage.layer_ids) == [4]
    for name, value in stage.state_dict().items():
        assert torch.equal(value, sa[name]), name
    assert torch.all(sa["model.norm.weight"] == 1)
    std = sa["model.layers.0.mlp.gate_proj.weight"].std().item()
    out_std = torch.cat([sa[f"model.layers.{i}.mlp.down_proj.weight"].flatten()
                         for i in range(6)]).std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(out_std - 0.02 / math.sqrt(12)) < 0.001


def test_dtype_argument():
    stage = build_stage(TINY, 1, 3, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in stage.parameters())
    out = stage(torch.randn(1, 5, TINY.dim, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 5, TINY.dim)


@pytest.mark.parametrize("n_layers,num_stages,sizes", [
    (6, 4, [2, 2, 1, 1]), (6, 3, [2, 2, 2]), (7, 3, [3, 2, 2]), (6, 1, [6]), (5, 5, [1] * 5),
    (22, 4, [6, 6, 5, 5]),
])
def test_stage_layers_splits(n_layers, num_stages, sizes):
    ranges = [stage_layers(n_layers, num_stages, k) for k in range(num_stages)]
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(n_layers))


def test_stage_layers_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stages"):
        stage_layers(3, 4, 0)
    with pytest.raises(ValueError, match="out of range"):
        stage_layers(6, 3, 3)
    with pytest.raises(ValueError, match="out of range"):
        stage_layers(6, 3, -1)


def test_gqa_shapes():
    stage = build_stage(TINY, 0, 3)
    attn = stage.model.layers["0"].self_attn
    assert attn.q_proj.weight.shape == (4 * 16, 64)
    assert attn.k_proj.weight.shape == (2 * 16, 64)
    assert attn.v_proj.weight.shape == (2 * 16, 64)
    assert attn.o_proj.weight.shape == (64, 64)
    h = stage(torch.zeros(3, 10, dtype=torch.int64))
    assert h.shape == (3, 10, 64)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model computes what an MHA model does whose k/v heads are the GQA ones repeated."""
    gqa = full_model(TINY, seed=5)
    mha_cfg = replace(TINY, n_kv_heads=TINY.n_heads)
    mha = full_model(mha_cfg, seed=5)
    sd = gqa.state_dict()
    hd, groups = TINY.head_dim, TINY.n_heads // TINY.n_kv_heads
    for name in list(sd):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            sd[name] = sd[name].view(TINY.n_kv_heads, hd, -1).repeat_interleave(
                groups, 0).reshape(TINY.n_heads * hd, -1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gqa(tokens), mha(tokens), atol=1e-6, rtol=0)


def test_rope_follows_hf_rotate_half_convention():
    """Channel j pairs with channel j + head_dim/2 (not j+1), rotated by pos * theta^(-2j/d):
    as complex numbers x_j + i x_{j+d/2} times e^{i pos theta_j}, the layout of HF checkpoints."""
    d, s, theta = 8, 5, 10000.0
    x = torch.randn(1, 1, s, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(s, d, theta, "cpu", torch.float64)
    got = apply_rope(x, cos, sin)
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freqs  # (s, d/2)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1))


def test_forward_rejects_wrong_inputs():
    with pytest.raises(ValueError, match="token ids"):
        build_stage(TINY, 0, 3)(torch.randn(1, 4, 64))
    with pytest.raises(ValueError, match="hidden states"):
        build_stage(TINY, 1, 3)(torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_seq_len"):
        full_model(TINY)(torch.zeros(1, 33, dtype=torch.int64))


def test_tied_embeddings():
    cfg = replace(TINY, tie_embeddings=True)
    whole = full_model(cfg, seed=2)
    assert whole.lm_head.weight is whole.model.embed_tokens.weight
    assert param_count(cfg) == sum(p.numel() for p in whole.parameters())
    # split: stage 0 holds the embedding and the head that is it; the last stage ends with the norm
    first, last = build_stage(cfg, 0, 3, seed=2), build_stage(cfg, 2, 3, seed=2)
    assert first.lm_head.weight is first.model.embed_tokens.weight and last.lm_head is None
    assert torch.equal(first.model.embed_tokens.weight, whole.model.embed_tokens.weight)
    assert sum(param_count(cfg, k, 3) for k in range(3)) == param_count(cfg)
    for k, stage in ((0, first), (2, last)):
        assert param_count(cfg, k, 3) == sum(p.numel() for p in stage.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    middle = build_stage(cfg, 1, 3, seed=2)
    assert torch.allclose(first.head(last(middle(first(tokens)))), whole(tokens), atol=1e-5)
    with pytest.raises(ValueError, match="no separate head"):
        last.head(torch.zeros(1, 2, cfg.dim))


def test_load_stage_from_hf_single_file(tmp_path):
    source = full_model(TINY, seed=11)
    save_file(source.state_dict(), tmp_path / "model.safetensors")
    stage = build_stage(TINY, 1, 3, seed=0)
    assert not torch.equal(stage.state_dict()["model.layers.2.mlp.up_proj.weight"],
                           source.state_dict()["model.layers.2.mlp.up_proj.weight"])
    assert load_stage_from_hf(stage, tmp_path) is stage
    ref = source.state_dict()
    for name, value in stage.state_dict().items():
        assert torch.equal(value, ref[name]), name


def test_load_stage_from_hf_sharded_with_index_and_bf16(tmp_path):
    source = full_model(TINY, seed=12, dtype=torch.bfloat16)
    sd = source.state_dict()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: sd[n] for n in part}, tmp_path / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stage = load_stage_from_hf(build_stage(TINY, 2, 3), tmp_path)  # fp32 model, bf16 checkpoint
    for name, value in stage.state_dict().items():
        assert torch.equal(value, sd[name].float()), name


def test_load_tied_head_from_embedding(tmp_path):
    cfg = replace(TINY, tie_embeddings=True)
    sd = {k: v for k, v in full_model(cfg, seed=1).state_dict().items() if k != "lm_head.weight"}
    save_file(sd, tmp_path / "model.safetensors")
    first = load_stage_from_hf(build_stage(cfg, 0, 3), tmp_path)  # split: the head is stage 0's embedding
    assert first.lm_head.weight is first.model.embed_tokens.weight
    assert torch.equal(first.lm_head.weight, sd["model.embed_tokens.weight"])
    last = load_stage_from_hf(build_stage(cfg, 2, 3), tmp_path)
    assert last.lm_head is None and torch.equal(last.model.norm.weight, sd["model.norm.weight"])


def test_load_attention_biases(tmp_path):
    cfg = replace(TINY, attention_bias=True)
    source = full_model(cfg, seed=1)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    save_file(source.state_dict(), tmp_path / "model.safetensors")
    stage = load_stage_from_hf(build_stage(cfg, 0, 2), tmp_path)
    bias = "model.layers.1.self_attn.k_proj.bias"
    assert torch.equal(stage.state_dict()[bias], source.state_dict()[bias])
    # the same checkpoint cannot go into a model without biases
    with pytest.raises(ValueError, match="attention_bias"):
        load_stage_from_hf(build_stage(TINY, 0, 2), tmp_path)


def test_load_wrong_shape_names_the_tensor(tmp_path):
    sd = full_model(TINY).state_dict()
    sd["model.layers.3.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(sd, tmp_path / "model.safetensors")
    load_stage_from_hf(build_stage(TINY, 0, 3), tmp_path)  # stage 0 does not hold layer 3
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.down_proj\.weight.*\(64, 100\)"):
        load_stage_from_hf(build_stage(TINY, 1, 3), tmp_path)


def test_load_missing_tensor_is_named(tmp_path):
    sd = full_model(TINY).state_dict()
    del sd["model.norm.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    load_stage_from_hf(build_stage(TINY, 1, 3), tmp_path)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_stage_from_hf(build_stage(TINY, 2, 3), tmp_path)
    with pytest.raises(FileNotFoundError):
        load_stage_from_hf(build_stage(TINY, 2, 3), tmp_path / "nowhere")


def test_presets_load_and_split():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    assert names == preset_names()  # every preset in the tree ships with the package
    assert {"llama-tiny", "llama-125m", "llama-1b"} <= set(names)
    for name in names:
        cfg = ModelConfig.from_name(name)
        assert cfg == ModelConfig.from_name(CONFIG_DIR / f"{name}.toml")
    tiny = ModelConfig.from_name("llama-tiny")
    assert tiny.vocab_size >= 257  # byte-level tokens + end of document (tahnode.data)
    assert [len(stage_layers(tiny.n_layers, 3, k)) for k in range(3)] == [2, 2, 2]
    assert abs(param_count(ModelConfig.from_name("llama-125m")) - 125e6) < 0.1 * 125e6
    assert abs(param_count(ModelConfig.from_name("llama-1b")) - 1.1e9) < 0.05 * 1.1e9


def test_param_count_matches_instantiated_models():
    tiny = ModelConfig.from_name("llama-tiny")
    for cfg in (TINY, tiny, replace(TINY, attention_bias=True)):
        assert param_count(cfg) == sum(p.numel() for p in full_model(cfg).parameters())
        for k in range(3):
            stage = build_stage(cfg, k, 3)
            assert param_count(cfg, k, 3) == sum(p.numel() for p in stage.parameters())


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        replace(TINY, dim=66)
    with pytest.raises(ValueError, match="n_kv_heads"):
        replace(TINY, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        replace(TINY, n_layers=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_name("llama-nonexistent")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nvocab_size = 10\ndim = 8\nbogus = 1\n")
    with pytest.raises(ValueError, match="unknown keys.*bogus"):
        ModelConfig.from_toml(bad)
    bad.write_text("[other]\n")
    with pytest.raises(ValueError, match=r"\[model\]"):
        ModelConfig.from_toml(bad)
    bad.write_text("[model\n")
    with pytest.raises(ValueError, match="TOML"):
        ModelConfig.from_toml(bad)

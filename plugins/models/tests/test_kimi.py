"""The kimi family (DeepSeek-V3 / Kimi K2 architecture): the tiny preset
(determinism, forward+backward, routers), checkpoints, generation through the
embedded engine, and the full-size configurations (counted on the meta device)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers

from skyrl_host.errors import UserError
from skyrl_host.interfaces import LoadedModel, ModelFamily, RouterInfo
from skyrl_models import _kimi_impl
from skyrl_models.kimi import FULL_PRESETS, KimiConfig, make_family

ALPHABET = "0123456789reverse :"
VOCAB = 3 + len(set(ALPHABET))


def load(seed: int = 0, **options: Any) -> LoadedModel:
    options.setdefault("preset", "tiny-kimi")
    return make_family(KimiConfig(**options)).load(alphabet=ALPHABET, seed=seed)


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def logits(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_registered_module_is_light_and_options_are_checked(tmp_path: pathlib.Path) -> None:
    code = "import sys, json, skyrl_models.kimi; print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    from skyrl_host.plugins import build_host

    host = build_host()
    assert host.registry.get("models", "kimi").config is KimiConfig
    with pytest.raises(ValueError, match="full-size architecture"):
        KimiConfig(preset="kimi-k2")
    with pytest.raises(ValueError, match="tiny-kimi"):
        KimiConfig(preset="tiny-kimmi")
    with pytest.raises(Exception, match="either preset or path"):
        (tmp_path / "config.json").write_text("{}")
        KimiConfig(preset="tiny-kimi", path=str(tmp_path))


def test_tiny_preset_is_deepseek_v3_and_deterministic() -> None:
    lm = load(seed=5)
    assert isinstance(make_family(KimiConfig(preset="tiny-kimi")), ModelFamily)
    model, cfg = lm.model, lm.model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and cfg.model_type == "deepseek_v3"
    assert cfg.vocab_size == len(lm.tokenizer) == VOCAB and lm.stop_token_ids == [1] and lm.family == "kimi"
    assert (cfg.first_k_dense_replace, cfg.n_group, cfg.topk_group, cfg.n_routed_experts) == (1, 4, 2, 8)
    assert cfg.q_lora_rank == 32 and cfg.kv_lora_rank == 32 and not model.training
    assert not hasattr(model.model.layers[0].mlp, "experts")  # layer 0 is dense
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = model.state_dict()
    b = load(seed=5).model.state_dict()
    assert torch.equal(torch.rand(3), expected_next)  # the process's random state is left alone
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = load(seed=6).model.state_dict()
    assert not torch.equal(a["model.layers.1.mlp.gate.weight"], c["model.layers.1.mlp.gate.weight"])


def test_forward_backward_and_routers() -> None:
    lm = load()
    model = lm.model.train()
    infos = _kimi_impl.routers(model)
    assert infos == make_family(KimiConfig(preset="tiny-kimi")).routers(model)
    assert [r.layer for r in infos] == [1, 2]  # one per MoE layer, the dense layer 0 excluded
    assert all(isinstance(r, RouterInfo) and r.kind == "sigmoid_group_topk" for r in infos)
    assert all((r.n_experts, r.top_k, r.normalize, r.scale) == (8, 2, True, 2.827) for r in infos)
    assert [r.path for r in infos] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    seen: list[Any] = []
    modules = dict(model.named_modules())
    hooks = [modules[r.path].register_forward_hook(lambda _m, _i, out: seen.append(out)) for r in infos]
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    for h in hooks:
        h.remove()
    assert torch.isfinite(loss) and len(seen) == 2
    for router_logits, weights, indices in seen:
        assert router_logits.shape == (ids.numel(), 8)
        assert weights.shape == indices.shape == (ids.numel(), 2)
        # renormalised then scaled by routed_scaling_factor
        assert torch.allclose(weights.sum(-1), torch.full((ids.numel(),), 2.827), atol=1e-5)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.experts.gate_up_proj.grad.abs().sum() > 0
    assert moe.shared_experts.up_proj.weight.grad.abs().sum() > 0
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(_kimi_impl.LORA_TARGETS[:8]) <= names  # the DeepSeek-V3 targets (the rest are Kimi Linear's)


def test_save_then_from_pretrained_identical_logits_and_load_through_family(tmp_path: pathlib.Path) -> None:
    lm = load(seed=2)
    out = tmp_path / "ckpt"
    make_family(KimiConfig(preset="tiny-kimi")).save(lm, str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    ids, mask = batch()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert torch.equal(logits(lm.model, ids, mask), logits(reloaded, ids, mask))
    again = make_family(KimiConfig(path=str(out))).load(alphabet=None, seed=0)
    assert torch.equal(logits(lm.model, ids, mask), logits(again.model, ids, mask))
    assert again.stop_token_ids == [1]


def test_a_folder_of_another_model_type_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(UserError, match="deepseek_v3"):
        make_family(KimiConfig(path=str(tmp_path))).load(alphabet=None, seed=0)


def test_greedy_generation_through_the_embedded_engine() -> None:
    from skyrl_host.plugins import build_host

    host = build_host()
    engine = host.registry.get("engines", "embedded").create(None)
    sampler = host.registry.get("samplers", "greedy").create(None)
    lm = load()
    engine.start(lm)
    prompts = [lm.tokenizer.encode("reverse 123:"), lm.tokenizer.encode("reverse 9:")]
    a = engine.generate(prompts, n=2, sampler=sampler, max_new_tokens=5, seed=0)
    b = engine.generate(prompts, n=2, sampler=sampler, max_new_tokens=5, seed=1)
    assert a.n_sequences == 4
    assert (a.tokens == b.tokens).all()  # greedy: the seed does not matter


def test_full_size_configs_count_about_1t_total_32b_active_on_meta() -> None:
    assert set(FULL_PRESETS) == {"kimi-k2", "kimi-k2.6", "kimi-k2.7", "deepseek-v3.2"}
    cfg = _kimi_impl.full_config("kimi-k2")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (7168, 61, 384, 8)
    assert (cfg.n_shared_experts, cfg.vocab_size, cfg.kv_lora_rank, cfg.q_lora_rank) == (1, 163840, 512, 1536)
    assert cfg.routed_scaling_factor == pytest.approx(2.827)
    total, active = _kimi_impl.estimate_parameters(cfg)
    assert 1.0e12 < total < 1.06e12 and 31e9 < active < 34e9
    with pytest.raises(ValueError, match="kimi-k2"):
        _kimi_impl.full_config("kimi-k3")


def test_deepseek_v32_full_config_is_the_published_one_about_671b_total_37b_active() -> None:
    cfg = _kimi_impl.full_config("deepseek-v3.2")
    assert cfg.model_type == "deepseek_v32"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.vocab_size) == (7168, 61, 3, 129280)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (256, 8, 8, 4)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim) == (1536, 512, 128, 64)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (2048, 64, 128)
    total, active = _kimi_impl.estimate_parameters(cfg)
    assert 6.6e11 < total < 6.9e11 and 36e9 < active < 39e9, (total, active)
    with pytest.raises(ValueError, match="full-size architecture"):
        KimiConfig(preset="deepseek-v3.2")


def test_a_kimi_k25_folder_loads_its_text_model(tmp_path: pathlib.Path) -> None:
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    lm = load(seed=4)
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                  pos_emb_height=4, pos_emb_width=4, pos_emb_time=1)
    cfg = Kimi_K25Config(text_config=lm.model.config.to_dict(), vision_config=vision, projection_hidden_size=32,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    full = Kimi_K25ForConditionalGeneration(cfg).eval()
    full.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    got = make_family(KimiConfig(path=str(tmp_path))).load(alphabet=None, seed=0)
    assert type(got.model).__name__ == "DeepseekV3ForCausalLM" and got.stop_token_ids == [1]
    ids, mask = batch()
    assert torch.equal(logits(full, ids, mask), logits(got.model, ids, mask))
    assert [r.layer for r in _kimi_impl.routers(got.model)] == [1, 2]

"""The qwen family's dense hybrid Qwen3.5 (``qwen3_5_text``): Gated DeltaNet and gated
full-attention layers, every MLP dense (no routers)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
import transformers

from skyrl_host.interfaces import LoadedModel, ModelFamily
from skyrl_models import _qwen_impl, qwen
from skyrl_models.qwen import QwenConfig, make_family

ALPHABET = "0123456789reverse :"
VOCAB = 3 + len(set(ALPHABET))  # 19
PRESET = "tiny-qwen3.5"


def load(seed: int = 0, **options: Any) -> LoadedModel:
    return make_family(QwenConfig(preset=PRESET, **options)).load(alphabet=ALPHABET, seed=seed)


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def logits(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def linear_names(model: Any) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_preset_architecture_and_size() -> None:
    lm = load()
    model, cfg = lm.model, lm.model.config
    assert isinstance(make_family(QwenConfig(preset=PRESET)), ModelFamily)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and cfg.model_type == "qwen3_5_text"
    assert QwenConfig(preset=PRESET).model_type == "qwen3_5_text" and not QwenConfig(preset=PRESET).is_moe
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert [hasattr(layer, "linear_attn") for layer in model.model.layers] == [True, True, True, False]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 32)
    assert cfg.intermediate_size == 128 and not cfg.tie_word_embeddings
    assert cfg.vocab_size == len(lm.tokenizer) == VOCAB and lm.stop_token_ids == [1] and not model.training
    mlp = 3 * 64 * 128 + 2 * 64  # dense MLP + 2 norms
    # Gated DeltaNet as in tiny-qwen3.5-moe (test_qwen_hybrid.py)
    linear = 64 * (32 + 32 + 64 + 64 + 4 + 4) + (32 + 32 + 64) * 4 + 4 + 4 + 16 + 64 * 64
    attention = 64 * 256 + 2 * 64 * 64 + 128 * 64 + 2 * 32
    embeddings = 2 * VOCAB * 64 + 64
    assert sum(p.numel() for p in model.parameters()) == 4 * mlp + 3 * linear + attention + embeddings


def test_preset_is_deterministic_takes_overrides_and_trains() -> None:
    a = load(seed=5).model.state_dict()
    lm = load(seed=5)
    assert all(torch.equal(t, a[k]) for k, t in lm.model.state_dict().items())
    other = load(seed=6).model.state_dict()
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
    cfg = load(num_layers=8, intermediate_size=32).model.config
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2 and cfg.intermediate_size == 32
    with pytest.raises(Exception, match="mixture-of-experts"):
        QwenConfig(preset=PRESET, num_experts=4)

    model = lm.model.train()
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_no_routers_and_lora_targets() -> None:
    lm = load()
    assert _qwen_impl.routers(lm.model) == [] and lm.routers == ()
    present = {t for t in qwen.LORA_TARGETS if t in linear_names(lm.model)}
    assert present == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                       "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}


def test_save_then_load_gives_identical_logits(tmp_path: pathlib.Path) -> None:
    lm = load(seed=2)
    make_family(QwenConfig(preset=PRESET)).save(lm, str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    ids, mask = batch()
    expected = logits(lm.model, ids, mask)
    back = make_family(QwenConfig(path=str(tmp_path / "ckpt"))).load(alphabet=None, seed=0)
    assert type(back.model).__name__ == "Qwen3_5ForCausalLM" and back.routers == ()
    assert torch.equal(logits(back.model, ids, mask), expected)
    raw = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    torch.testing.assert_close(logits(raw, ids, mask), expected, rtol=0, atol=1e-6)

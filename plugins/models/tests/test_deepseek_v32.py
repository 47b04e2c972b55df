"""The kimi family's DeepSeek-V3.2 preset (``deepseek_v32``): DeepSeek-V3 (MLA, a dense
first layer, sigmoid group-limited MoE) with the sparse-attention indexer."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
import transformers

from skyrl_host.interfaces import LoadedModel, ModelFamily
from skyrl_models import _kimi_impl
from skyrl_models.kimi import KimiConfig, make_family

ALPHABET = "0123456789reverse :"
VOCAB = 3 + len(set(ALPHABET))  # 19
PRESET = "tiny-deepseek-v3.2"


def load(seed: int = 0) -> LoadedModel:
    return make_family(KimiConfig(preset=PRESET)).load(alphabet=ALPHABET, seed=seed)


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 20), generator=g)  # longer than index_topk (8)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    return ids, mask


def logits(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_preset_is_deepseek_v32_with_the_indexer_and_deterministic() -> None:
    lm = load(seed=5)
    assert isinstance(make_family(KimiConfig(preset=PRESET)), ModelFamily)
    model, cfg = lm.model, lm.model.config
    assert type(model).__name__ == "DeepseekV32ForCausalLM" and cfg.model_type == "deepseek_v32"
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (4, 32, 8)
    assert (cfg.first_k_dense_replace, cfg.n_group, cfg.topk_group, cfg.n_routed_experts) == (1, 4, 2, 8)
    assert cfg.vocab_size == len(lm.tokenizer) == VOCAB and lm.stop_token_ids == [1] and not model.training
    assert all(hasattr(layer.self_attn, "indexer") for layer in model.model.layers)
    b = load(seed=5).model.state_dict()
    assert all(torch.equal(t, b[k]) for k, t in model.state_dict().items())
    c = load(seed=6).model.state_dict()
    assert not torch.equal(b["model.layers.1.mlp.gate.weight"], c["model.layers.1.mlp.gate.weight"])


def test_forward_backward_routers_and_lora_targets() -> None:
    lm = load()
    model = lm.model.train()
    infos = _kimi_impl.routers(model)
    assert list(lm.routers) == infos and [r.layer for r in infos] == [1, 2]
    assert all((r.kind, r.n_experts, r.top_k, r.normalize, r.scale) == ("sigmoid_group_topk", 8, 2, True, 2.827)
               for r in infos)
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    no_grad = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0}
    # the indexer's top-k selection is not differentiable: the LM loss trains everything else
    assert no_grad and all(".self_attn.indexer." in n for n in no_grad)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(_kimi_impl.LORA_TARGETS[:8]) <= names  # the DeepSeek-V3 targets (the rest are Kimi Linear's)


def test_save_then_load_gives_identical_logits(tmp_path: pathlib.Path) -> None:
    lm = load(seed=2)
    out = tmp_path / "ckpt"
    make_family(KimiConfig(preset=PRESET)).save(lm, str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v32"
    ids, mask = batch()
    again = make_family(KimiConfig(path=str(out))).load(alphabet=None, seed=0)
    assert type(again.model).__name__ == "DeepseekV32ForCausalLM" and list(again.routers) == list(lm.routers)
    assert torch.equal(logits(lm.model, ids, mask), logits(again.model, ids, mask))
    raw = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(raw, ids, mask), logits(lm.model, ids, mask), rtol=0, atol=1e-6)

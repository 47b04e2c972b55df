"""The kimi family's Kimi Linear preset (``kimi_linear``): Kimi Delta Attention (linear
attention) and MLA layers, a dense first MLP, then sigmoid group-limited MoE."""

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
PRESET = "tiny-kimi-linear"


def load(seed: int = 0) -> LoadedModel:
    return make_family(KimiConfig(preset=PRESET)).load(alphabet=ALPHABET, seed=seed)


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    return ids, torch.ones_like(ids)


def logits(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_preset_is_kimi_linear_and_deterministic() -> None:
    lm = load(seed=5)
    assert isinstance(make_family(KimiConfig(preset=PRESET)), ModelFamily)
    model, cfg = lm.model, lm.model.config
    assert type(model).__name__ == "KimiLinearForCausalLM" and cfg.model_type == "kimi_linear"
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (8, 2, 4, 2)
    assert cfg.vocab_size == len(lm.tokenizer) == VOCAB and lm.stop_token_ids == [1] and not model.training
    b = load(seed=5).model.state_dict()
    assert all(torch.equal(t, b[k]) for k, t in model.state_dict().items())
    c = load(seed=6).model.state_dict()
    assert not torch.equal(b["model.layers.1.mlp.gate.weight"], c["model.layers.1.mlp.gate.weight"])


def test_forward_backward_routers_and_lora_targets() -> None:
    lm = load()
    model = lm.model.train()
    infos = _kimi_impl.routers(model)
    assert list(lm.routers) == infos and [r.layer for r in infos] == [1, 2, 3]
    assert [r.path for r in infos] == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    assert all((r.kind, r.n_experts, r.top_k, r.normalize, r.scale) == ("sigmoid_group_topk", 8, 2, True, 2.446)
               for r in infos)
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(_kimi_impl.LORA_TARGETS) - {"q_a_proj", "q_b_proj"} <= names  # no q_lora in Kimi Linear


def test_save_then_load_gives_identical_logits(tmp_path: pathlib.Path) -> None:
    lm = load(seed=2)
    out = tmp_path / "ckpt"
    make_family(KimiConfig(preset=PRESET)).save(lm, str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_linear"
    ids, mask = batch()
    again = make_family(KimiConfig(path=str(out))).load(alphabet=None, seed=0)
    assert type(again.model).__name__ == "KimiLinearForCausalLM" and list(again.routers) == list(lm.routers)
    assert torch.equal(logits(lm.model, ids, mask), logits(again.model, ids, mask))
    raw = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(raw, ids, mask), logits(lm.model, ids, mask), rtol=0, atol=1e-6)

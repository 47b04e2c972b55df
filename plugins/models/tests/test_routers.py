"""RouterInfo describes the router: for every tiny MoE preset of every family, each
listed router, called on random hidden states, returns weights that follow from its
logits and chosen experts through the RouterInfo fields alone (what routing replay
does when it forces expert ids and recomputes their weights)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from skyrl_host.interfaces import RouterInfo
from skyrl_models import _hf, glm, hf, kimi, nemotron, qwen

ALPHABET = "0123456789reverse :"

CASES = (  # (family, tiny MoE preset): every MoE preset of every family, from their own tables
    [("qwen", p) for p in qwen.MOE_PRESETS]
    + [("glm", p) for p in glm.PRESETS]
    + [("kimi", p) for p in kimi.PRESETS]
    + [("nemotron", p) for p in nemotron.PRESETS]
    + [("hf", p) for p in hf.MOE_PRESETS]
)
MODULES = {  # family -> (registered module, its options class)
    "qwen": (qwen, qwen.QwenConfig),
    "glm": (glm, glm.GlmConfig),
    "kimi": (kimi, kimi.KimiConfig),
    "nemotron": (nemotron, nemotron.NemotronConfig),
    "hf": (hf, hf.HfConfig),
}


def weights_from(info: RouterInfo, logits: Any, indices: Any) -> Any:
    """The chosen experts' weights from the router's logits, by the RouterInfo fields only."""
    if info.kind == "softmax_topk":
        chosen = torch.softmax(logits.float(), dim=-1).gather(1, indices)
        eps = 0.0
    elif info.kind == "sigmoid_group_topk":
        chosen = torch.sigmoid(logits.float()).gather(1, indices)
        eps = 1e-20
    else:
        raise AssertionError(f"unknown router kind {info.kind!r}")
    if info.normalize:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + eps)
    return chosen * info.scale


def check_routers(model: Any, infos: list[RouterInfo], seed: int = 0) -> None:
    """Every listed router returns (logits, weights, indices) consistent with its RouterInfo."""
    assert infos, "an MoE preset lists its routers"
    moe_blocks = [n for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    assert [i.path for i in infos] == [f"{n}.gate" for n in moe_blocks]  # one per MoE block, in layer order
    g = torch.Generator().manual_seed(seed)
    for info in infos:
        assert f".layers.{info.layer}." in info.path
        router = model.get_submodule(info.path)
        hidden = torch.randn(37, model.config.hidden_size, generator=g) * 3  # spread logits: no ties
        with torch.no_grad():
            logits, weights, indices = router(hidden)
        assert logits.shape == (37, info.n_experts)
        assert indices.shape == weights.shape == (37, info.top_k)
        assert int(indices.min()) >= 0 and int(indices.max()) < info.n_experts
        assert all(len(set(row)) == info.top_k for row in indices.tolist())  # distinct experts per token
        expected = weights_from(info, logits, indices).to(weights.dtype)
        # (bit-exact with transformers 5.24: the same operations in the same order)
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6, msg=lambda m: f"{info.path}: {m}")


@pytest.mark.parametrize(("family", "preset"), CASES, ids=[p for _, p in CASES])
def test_router_info_recomputes_the_routers_weights(family: str, preset: str) -> None:
    module, options = MODULES[family]
    family_obj = module.make_family(options(preset=preset))
    lm = family_obj.load(alphabet=ALPHABET, seed=3)
    infos = family_obj.routers(lm.model)
    assert infos == list(lm.routers)
    check_routers(lm.model, infos)


def test_every_tiny_moe_preset_is_covered() -> None:
    assert {p for _, p in CASES} >= {"tiny-moe", "tiny-qwen3.5-moe", "tiny-qwen3-next", "tiny-kimi", "tiny-nemotron-h"}
    assert {p for _, p in CASES} >= set(glm.PRESETS) | {"tiny-glm5-next"}


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_without_renormalisation_and_with_another_scale(norm_topk_prob: bool) -> None:
    """The flags are read from the config, not assumed: Qwen3-MoE with and without
    ``norm_topk_prob``, GLM-4.5 with ``routed_scaling_factor`` 1.0 and 0.5."""
    from skyrl_models import _glm_impl, _qwen_impl

    tokenizer = _hf.char_tokenizer(ALPHABET, model_max_length=512)
    cfg = _qwen_impl.preset_config(qwen.QwenConfig(preset="tiny-moe"), tokenizer)
    cfg.norm_topk_prob = norm_topk_prob
    with _hf.seeded(0):
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    infos = _qwen_impl.routers(model)
    assert {(i.normalize, i.scale) for i in infos} == {(norm_topk_prob, 1.0)}
    check_routers(model, infos)

    cfg = _glm_impl.preset_config(glm.GlmConfig(preset="tiny-glm4-moe"), tokenizer)
    cfg.norm_topk_prob = norm_topk_prob
    cfg.routed_scaling_factor = 1.0 if norm_topk_prob else 0.5
    with _hf.seeded(0):
        model = transformers.Glm4MoeForCausalLM(cfg).eval()
    infos = _glm_impl.routers(model)
    assert {(i.normalize, i.scale) for i in infos} == {(norm_topk_prob, cfg.routed_scaling_factor)}
    check_routers(model, infos)

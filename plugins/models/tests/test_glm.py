"""The glm family: tiny presets (determinism, forward+backward, routers), checkpoints,
generation through the embedded engine, and full-size configs (no weights); GLM-5.3-Flash's
text model: its causal LM, cached generation against a full forward, loading the language
model of a vision-language folder."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers

from skyrl_host.options import OptionError
from skyrl_host.interfaces import LoadedModel, ModelFamily, RouterInfo
from skyrl_models import glm
from skyrl_models.glm import FULL_PRESETS, PRESETS, GlmConfig, full_config, make_family

ALPHABET = "0123456789reverse :"
VOCAB = 3 + len(set(ALPHABET))
TINY = list(PRESETS)
EXPECTED = {  # preset -> (model type, class)
    "tiny-glm4-moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "tiny-glm4-moe-lite": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "tiny-glm-moe-dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "tiny-glm5-next": ("glm5_next_text", "Glm5NextTextForCausalLM"),
}
MOE_LAYERS = {"tiny-glm5-next": (1, 2, 3)}  # the others: (1, 2)


def load(preset: str, seed: int = 0, **options: Any) -> LoadedModel:
    return make_family(GlmConfig(preset=preset, **options)).load(alphabet=ALPHABET, seed=seed)


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


# -- registration and config ------------------------------------------------------


def test_registered_through_the_entry_point_without_heavy_imports(skyrl_host) -> None:
    reg = skyrl_host.registry.get("models", "glm")
    assert reg.factory is make_family and reg.config is GlmConfig
    assert skyrl_host.records["glm"].entry_point == "skyrl_models.glm"
    code = "import sys, skyrl_models.glm; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_needs_exactly_one_of_preset_and_path(tmp_path) -> None:
    with pytest.raises(OptionError):
        GlmConfig()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(OptionError):
        GlmConfig(preset="tiny-glm4-moe", path=str(tmp_path))
    with pytest.raises(ValueError, match="full_config"):
        GlmConfig(preset="glm-4.5")


# -- tiny presets -----------------------------------------------------------------


@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_builds_deterministically_and_trains(preset: str) -> None:
    lm = load(preset, seed=5)
    family = make_family(GlmConfig(preset=preset))
    assert isinstance(family, ModelFamily)
    model_type, cls = EXPECTED[preset]
    assert lm.model.config.model_type == model_type and type(lm.model).__name__ == cls
    assert lm.model.config.vocab_size == len(lm.tokenizer) == VOCAB and lm.stop_token_ids == [1]
    torch.manual_seed(1)
    expected_next = torch.rand(2)
    torch.manual_seed(1)
    again = load(preset, seed=5).model.state_dict()
    assert torch.equal(torch.rand(2), expected_next)  # the process's random state is untouched
    state = lm.model.state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    other = load(preset, seed=6).model.state_dict()
    assert not torch.equal(state["model.layers.1.mlp.gate.weight"], other["model.layers.1.mlp.gate.weight"])

    # routers: one per MoE layer (the first layer is dense), DeepSeek-V3-style
    model = lm.model.train()
    infos = family.routers(model)
    cfg = model.config
    moe_layers = MOE_LAYERS.get(preset, (1, 2))
    assert infos == [
        RouterInfo(
            layer=i,
            path=f"model.layers.{i}.mlp.gate",
            kind="sigmoid_group_topk",
            n_experts=8,
            top_k=2,
            normalize=True,  # norm_topk_prob
            scale=2.5,  # routed_scaling_factor
        )
        for i in moe_layers
    ]
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (2, 1, 2.5)
    assert not hasattr(model.model.layers[0].mlp, "gate")
    seen: list[Any] = []
    hooks = [model.get_submodule(r.path).register_forward_hook(lambda _m, _i, o: seen.append(o)) for r in infos]
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    for h in hooks:
        h.remove()
    assert torch.isfinite(loss) and len(seen) == len(moe_layers)
    for router_logits, weights, indices in seen:
        assert router_logits.shape == (ids.numel(), 8)
        assert weights.shape == indices.shape == (ids.numel(), 2)
        # group-limited: both experts come from one group of 4 (topk_group = 1)
        assert torch.equal(indices[:, 0] // 4, indices[:, 1] // 4)
        assert torch.allclose(weights.sum(-1), torch.full((ids.numel(),), 2.5))  # renormalised x scaling
    moe = model.get_submodule("model.layers.1.mlp")
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.experts.gate_up_proj.grad is not None and moe.experts.gate_up_proj.grad.abs().sum() > 0
    # lora targets name modules / parameters that exist
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()} | {
        n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()
    }
    assert {"o_proj", "gate_up_proj", "down_proj", "gate_proj", "up_proj"} <= names
    assert set(family.lora_targets) & names >= {"o_proj", "gate_up_proj"}


@pytest.mark.parametrize("preset", TINY)
def test_save_then_from_pretrained_gives_identical_logits(preset: str, tmp_path) -> None:
    lm = load(preset, seed=2)
    family = make_family(GlmConfig(preset=preset))
    family.save(lm, str(tmp_path / "ckpt"))
    assert not list(tmp_path.glob(".ckpt.tmp-*"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="sdpa").eval()
    ids, mask = batch()
    with torch.no_grad():
        a = lm.model(input_ids=ids, attention_mask=mask).logits
        b = back(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    via_family = make_family(GlmConfig(path=str(tmp_path / "ckpt"))).load(alphabet=None, seed=0)
    assert via_family.family == "glm" and via_family.tokenizer.get_vocab() == lm.tokenizer.get_vocab()


@pytest.mark.parametrize("preset", TINY)
def test_greedy_generation_through_the_embedded_engine(preset: str, skyrl_host) -> None:
    from skyrl_host.interfaces import SampleOutput

    class Greedy:
        temperature = 1.0

        def sample(self, logits: Any, generator: Any) -> SampleOutput:
            ids = logits.argmax(-1)
            return SampleOutput(ids, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])

    lm = load(preset)
    engine = skyrl_host.registry.get("engines", "embedded").create()
    engine.start(lm)
    prompts = [lm.tokenizer.encode("reverse 123:"), lm.tokenizer.encode("reverse 9:")]
    out = engine.generate(prompts, n=1, sampler=Greedy(), max_new_tokens=4, seed=0)
    assert len(out.prompt_lens) == 2
    assert out.tokens.shape[0] == int(out.cu_seqlens[-1])
    again = engine.generate(prompts, n=1, sampler=Greedy(), max_new_tokens=4, seed=1)
    assert (out.tokens == again.tokens).all()  # greedy: the same whatever the seed


# -- GLM-5.3-Flash's text model (glm5_next) -----------------------------------------


class _Sampling:
    """Plain sampling at temperature 1 from the engine's generator."""

    temperature = 1.0

    def sample(self, logits: Any, generator: Any) -> Any:
        from skyrl_host.interfaces import SampleOutput

        lp = torch.log_softmax(logits.float(), -1)
        ids = torch.multinomial(lp.exp(), 1, generator=generator)[:, 0]
        return SampleOutput(ids, lp.gather(1, ids[:, None])[:, 0])


def _vlm_config(text_config: Any) -> Any:
    """A glm5_next (vision-language) config around ``text_config`` with a tiny vision tower."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=text_config.hidden_size,
        projection_intermediate_size=64,
        patch_size=14,
        image_size=28,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return Glm5NextConfig(text_config=text_config, vision_config=vision, tie_word_embeddings=False)


def test_glm5_next_text_causal_lm() -> None:
    """The preset covers every layer kind; the causal LM's head, decoder, cache and
    ``generate`` behave like transformers' own causal LMs."""
    lm = load("tiny-glm5-next", seed=1)
    model, cfg = lm.model, lm.model.config
    assert cfg.layer_types == ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    assert cfg.indexer_types[1:3] == ["full", "shared"] and cfg.mlp_layer_types[0] == "dense"
    assert cfg.qk_rope_head_dim == 0 and cfg.index_topk == 8 and cfg.index_kpool == 4
    assert model.get_decoder() is model.model and model.get_output_embeddings() is model.lm_head
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied
    assert model.model.layers[2].self_attn.indexer is None  # reuses layer 1's choice
    import skyrl_backends.torch_backend as trainer
    assert trainer.has_recurrent_layers(cfg)  # the torch backend gives each sequence its own row

    ids, mask = batch()
    with torch.no_grad():
        full = model(input_ids=ids[1:], use_cache=False).logits
        last = model(input_ids=ids[1:], logits_to_keep=1, use_cache=False).logits
        torch.testing.assert_close(last[:, 0], full[:, -1], rtol=0, atol=1e-6)
        # the cache: a prefill, then one token at a time (also under the old keyword name)
        out = model(input_ids=ids[1:, :5], use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(5, ids.shape[1]):
            out = model(input_ids=ids[1:, t : t + 1], past_key_values=out.cache, use_cache=True)
            steps.append(out.logits[:, -1])
        torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:], rtol=0, atol=1e-5)
        # generate: a left-padded batch, greedy, equals greedy decoding by full forwards
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None)
    for row in range(ids.shape[0]):
        seq = ids[row][mask[row].bool()][None]
        with torch.no_grad():
            for _ in range(4):
                nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1)
                seq = torch.cat([seq, nxt[:, None]], 1)
        assert torch.equal(got[row, ids.shape[1] :], seq[0, -4:])


def test_glm5_next_tied_head_saves_and_loads(tmp_path) -> None:
    from skyrl_models import _glm5_next, _glm_impl, _hf

    tokenizer = _hf.char_tokenizer(ALPHABET, model_max_length=512)
    cfg = _glm_impl.preset_config(GlmConfig(preset="tiny-glm5-next"), tokenizer)
    cfg.tie_word_embeddings = True
    with _hf.seeded(0):
        model = _glm5_next.Glm5NextTextForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is _glm5_next.Glm5NextTextForCausalLM
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, back(input_ids=ids, attention_mask=mask).logits)


def test_glm5_next_engine_matches_a_full_forward(skyrl_host) -> None:
    """Cached generation (left-padded prefill, one token at a time, finished rows
    dropped from the batch) gives the logprobs and expert choices of one full forward
    of each finished sequence; prompts longer than the indexer's budget attend sparsely."""
    import numpy as np

    lm = load("tiny-glm5-next", seed=4)
    reg = skyrl_host.registry.get("engines", "embedded")
    engine = reg.create(reg.config(return_routed_experts=True, max_batch_size=5))
    engine.start(lm)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, VOCAB, size=n))) for n in (1, 4, 13, 22, 30)]
    out = engine.generate(prompts, n=2, sampler=_Sampling(), max_new_tokens=12, seed=3)
    routes = out.side_channels["routed_experts"]
    assert routes.shape == (out.n_tokens, 3, 2)
    infos = list(lm.routers)
    worst = 0.0
    for i in range(out.n_sequences):
        a, b = int(out.cu_seqlens[i]), int(out.cu_seqlens[i + 1])
        p = int(out.prompt_lens[i])
        seq = torch.as_tensor(out.tokens[a:b], dtype=torch.long)[None]
        seen: list[Any] = []
        hooks = [lm.model.get_submodule(r.path).register_forward_hook(lambda _m, _i, o: seen.append(o[2])) for r in infos]
        try:
            with torch.no_grad():
                logits = lm.model(input_ids=seq, use_cache=False).logits[0].float()
        finally:
            for h in hooks:
                h.remove()
        lp = torch.log_softmax(logits, -1)[p - 1 : -1].gather(1, seq[0, p:, None])[:, 0]
        worst = max(worst, float((lp - torch.as_tensor(out.logprobs[a + p : b])).abs().max()))
        full_routes = torch.stack(seen, 1).sort(-1).values  # [S, L, k]
        engine_routes = torch.as_tensor(routes[a:b].astype(np.int64)).sort(-1).values
        assert torch.equal(full_routes[:-1], engine_routes[:-1])  # the last token is never fed back
    assert worst <= 1e-5, worst


def test_glm5_next_loads_the_language_model_of_a_vision_language_folder(tmp_path) -> None:
    """A glm5_next folder (vision-language, as published): only ``model.language_model.*``
    and ``lm_head`` are loaded, into the text causal LM, which gives the VLM's own logits
    on text and saves as (and loads back from) a glm5_next_text folder."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from skyrl_models import _glm_impl, _hf

    tokenizer = _hf.char_tokenizer(ALPHABET, model_max_length=512)
    text_cfg = _glm_impl.preset_config(GlmConfig(preset="tiny-glm5-next"), tokenizer)
    with _hf.seeded(7):
        vlm = Glm5NextForConditionalGeneration(_vlm_config(text_cfg)).eval()
    vlm.generation_config.eos_token_id = tokenizer.eos_token_id
    vlm.save_pretrained(tmp_path / "vlm")
    tokenizer.save_pretrained(tmp_path / "vlm")

    family = make_family(GlmConfig(path=str(tmp_path / "vlm")))
    lm = family.load(alphabet=None, seed=0)
    model = lm.model
    assert type(model).__name__ == "Glm5NextTextForCausalLM" and model.config.model_type == "glm5_next_text"
    assert not any("visual" in n for n, _ in model.named_parameters())
    language = dict(vlm.model.language_model.named_parameters())
    assert {n.removeprefix("model.") for n, _ in model.model.named_parameters(prefix="model")} == set(language)
    for name, p in model.model.named_parameters():
        assert torch.equal(p, language[name]), name
    assert torch.equal(model.lm_head.weight, vlm.lm_head.weight)
    assert lm.stop_token_ids == [tokenizer.eos_token_id] and len(lm.routers) == 3
    ids, mask = batch()
    with torch.no_grad():
        want = vlm(input_ids=ids, attention_mask=mask).logits  # the VLM on text alone
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    family.save(lm, str(tmp_path / "text"))
    import json

    from safetensors import safe_open

    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "glm5_next_text"
    with safe_open(str(tmp_path / "text" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "model.embed_tokens.weight" in keys and not any("language_model" in k or "visual" in k for k in keys)
    again = make_family(GlmConfig(path=str(tmp_path / "text"))).load(alphabet=None, seed=0).model
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, attention_mask=mask).logits, got)


# -- full-size configs ---------------------------------------------------------------


def test_full_configs_build_without_weights() -> None:
    from skyrl_models._glm_impl import count_parameters

    expected_billions = {"glm-4.5": 355, "glm-4.5-air": 106, "glm-4.7-flash": 30, "glm-5": 744}
    for name, billions in expected_billions.items():
        cfg = full_config(name)
        assert cfg.model_type == FULL_PRESETS[name][0]
        n = count_parameters(cfg)  # on the meta device: nothing allocated
        assert abs(n / 1e9 - billions) / billions < 0.05, (name, n)
    cfg = full_config("glm-4.7-flash")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (2048, 47, 64, 4)
    assert cfg.vocab_size == 154880 and cfg.routed_scaling_factor == 1.8
    assert full_config("glm-4.7").to_dict() == full_config("glm-4.5").to_dict()
    # GLM-5.3-Flash: the text config's class defaults (named after zai-org/GLM-5.3-Flash)
    cfg = full_config("glm-5.3-flash")
    assert cfg.model_type == "glm5_next_text" and cfg.layer_types.count("indexed_attention") == 11
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (4096, 45, 288, 8)
    assert abs(count_parameters(cfg) / 1e9 - 313.3) < 0.5
    with pytest.raises(KeyError):
        glm.full_config("glm-9")

"""The glm family: tiny presets (determinism, forward+backward, routers), checkpoints,
generation through the embedded engine, and full-size configs (no weights)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from skyrl_host.config import OptionError  # noqa: E402
from skyrl_host.interfaces import LoadedModel, ModelFamily, RouterInfo  # noqa: E402
from skyrl_models import glm  # noqa: E402
from skyrl_models.glm import FULL_PRESETS, PRESETS, GlmConfig, full_config, make_family  # noqa: E402

ALPHABET = "0123456789reverse :"
VOCAB = 3 + len(set(ALPHABET))
TINY = list(PRESETS)
EXPECTED = {  # preset -> (model type, class)
    "tiny-glm4-moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "tiny-glm4-moe-lite": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "tiny-glm-moe-dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
}


@pytest.fixture(autouse=True)
def _few_threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
        for i in (1, 2)
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
    assert torch.isfinite(loss) and len(seen) == 2
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
    with pytest.raises(KeyError):
        glm.full_config("glm-9")

"""The nemotron family (Nemotron-H: hybrid Mamba2 / attention / MoE): registration,
options, the tiny preset (determinism, forward+backward on the PyTorch Mamba2 path,
routers), the full-size config on the meta device, checkpoints, and generation
through the embedded engine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers

from skyrl_host.interfaces import LoadedModel, ModelFamily, RouterInfo, SampleOutput
from skyrl_models import _nemotron_impl as impl
from skyrl_models.nemotron import FULL_CONFIGS, NemotronConfig, make_family

ALPHABET = "0123456789reverse :"
VOCAB = 3 + len(set(ALPHABET))  # <pad>, <eos>, <unk> + 16 characters = 19
PRESET = "tiny-nemotron-h"


def load(seed: int = 0, **options: Any) -> LoadedModel:
    options.setdefault("preset", PRESET)
    return make_family(NemotronConfig(**options)).load(alphabet=ALPHABET, seed=seed)


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    return ids, mask


def logits(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# -- registration and options ------------------------------------------------------


def test_registered_through_the_entry_point_and_imports_no_torch() -> None:
    from skyrl_host.plugins import build_host

    reg = build_host().registry.get("models", "nemotron")
    assert reg.factory is make_family and reg.config is NemotronConfig
    code = "import sys, json, skyrl_models.nemotron; print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_options_are_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="expected one of 'tiny-nemotron-h'"):
        NemotronConfig(preset="tiny-nemotron")
    with pytest.raises(ValueError, match="full-size architecture without weights"):
        NemotronConfig(preset="nemotron-3-nano-30b-a3b")
    with pytest.raises(Exception, match="missing"):
        NemotronConfig()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception, match="not both"):
        NemotronConfig(preset=PRESET, path=str(tmp_path))


# -- the tiny preset -------------------------------------------------------------------


def test_tiny_preset_is_a_hybrid_nemotron_h() -> None:
    lm = load()
    family = make_family(NemotronConfig(preset=PRESET))
    assert isinstance(family, ModelFamily) and family.model_types == ("nemotron_h",)
    model, cfg = lm.model, lm.model.config
    assert type(model).__name__ == "NemotronHForCausalLM" and cfg.model_type == "nemotron_h"
    assert cfg.layers_block_type == ["linear_attention", "moe", "full_attention", "moe"]
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (64, 8, 2)
    assert cfg.vocab_size == len(lm.tokenizer) == VOCAB and not cfg.tie_word_embeddings
    assert lm.family == "nemotron" and lm.stop_token_ids == [1]
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 115_340


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = load(seed=7).model.state_dict()
    assert torch.equal(torch.rand(3), expected_next)  # the process's random state is left alone
    b = load(seed=7).model.state_dict()
    c = load(seed=8).model.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("model.layers.0.mixer.in_proj.weight", "model.layers.1.mixer.gate.weight"):
        assert not torch.equal(a[name], c[name]), name


def test_forward_backward_on_cpu_float32_through_the_torch_mamba_path() -> None:
    # Without mamba-ssm / causal-conv1d (no CUDA), transformers runs its PyTorch Mamba2
    # scan in training too; it must agree with the eval forward and give gradients.
    model = load().model
    ids, mask = batch()
    expected = logits(model, ids, mask)
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    if importlib.util.find_spec("mamba_ssm") is None:
        torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-6)
    assert torch.isfinite(out.loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []  # Mamba2 (A_log, D, dt_bias, conv1d, in/out_proj), attention, experts, routers


def test_routers_one_per_moe_layer_returning_logits_weights_indices() -> None:
    lm = load()
    family = make_family(NemotronConfig(preset=PRESET))
    infos = family.routers(lm.model)
    assert infos == [
        RouterInfo(
            layer=i,
            path=f"model.layers.{i}.mixer.gate",
            kind="sigmoid_group_topk",
            n_experts=8,
            top_k=2,
            normalize=True,
            scale=2.5,
        )
        for i in (1, 3)
    ]
    seen: list[Any] = []
    modules = dict(lm.model.named_modules())
    hooks = [modules[r.path].register_forward_hook(lambda _m, _i, out: seen.append(out)) for r in infos]
    ids, mask = batch()
    logits(lm.model, ids, mask)
    for h in hooks:
        h.remove()
    assert len(seen) == 2
    for router_logits, weights, indices in seen:
        assert router_logits.shape == (ids.numel(), 8)
        assert weights.shape == indices.shape == (ids.numel(), 2)
        torch.testing.assert_close(weights.sum(-1), torch.full((ids.numel(),), 2.5))  # renormalised x scaling factor
    linears = [n for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in family.lora_targets:  # the latent MoE's projections are in the Super preset (below)
        if "latent" not in target:
            assert any(n.endswith("." + target) for n in linears), target
    assert not any(n.endswith(".gate") for n in linears if n.split(".")[-1] in family.lora_targets)


# -- full-size configs ---------------------------------------------------------------------


def test_full_config_builds_on_the_meta_device_with_the_published_size() -> None:
    cfg = impl.full_config("nemotron-3-nano-30b-a3b")
    assert set(FULL_CONFIGS) == {"nemotron-3-nano-30b-a3b"}
    types = cfg.layers_block_type
    assert (len(types), types.count("linear_attention"), types.count("moe"), types.count("full_attention")) == (52, 23, 23, 6)
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(cfg)
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in params.values())
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    assert 31.5e9 < total < 31.7e9  # "31.6B total"
    assert 3.5e9 < active < 3.7e9  # "~3.6B active" (with embeddings)
    routers = impl.routers(model)
    assert len(routers) == 23 and routers[0].path == "model.layers.1.mixer.gate"
    assert {(r.n_experts, r.top_k) for r in routers} == {(128, 6)}
    with pytest.raises(KeyError, match="expected one of"):
        impl.full_config("nemotron-4")


# -- checkpoints and generation ----------------------------------------------------------


def test_save_then_from_pretrained_gives_identical_logits(tmp_path) -> None:
    lm = load(seed=3)
    family = make_family(NemotronConfig(preset=PRESET))
    family.save(lm, str(tmp_path / "ckpt"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="sdpa").eval()
    assert type(again).__name__ == "NemotronHForCausalLM"
    ids, mask = batch()
    assert torch.equal(logits(lm.model, ids, mask), logits(again, ids, mask))
    via_path = make_family(NemotronConfig(path=str(tmp_path / "ckpt"))).load(alphabet=None, seed=0)
    assert torch.equal(logits(lm.model, ids, mask), logits(via_path.model, ids, mask))
    assert via_path.tokenizer.get_vocab() == lm.tokenizer.get_vocab() and via_path.stop_token_ids == [1]


class _Greedy:
    temperature = 1.0

    def sample(self, logits: Any, generator: Any) -> SampleOutput:
        ids = logits.argmax(-1)
        return SampleOutput(ids, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])


def test_greedy_generation_through_the_embedded_engine() -> None:
    import skyrl_engines  # noqa: F401  (the embedded engine: a test requirement)
    from skyrl_host.plugins import build_host

    reg = build_host().registry.get("engines", "embedded")
    lm = load(seed=1)
    engine = reg.factory(reg.config())
    engine.start(lm)
    prompts = [lm.tokenizer.encode(p) for p in ("reverse 123:", "reverse 4:", "reverse 98765:")]
    out = engine.generate(prompts, n=2, sampler=_Greedy(), max_new_tokens=6, seed=0)
    assert out.n_sequences == 6
    # the same as a full recompute per step, one prompt at a time, no padding and no cache
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(len(out.response(2 * i))):
                ids.append(int(lm.model(torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] in lm.stop_token_ids:
                    break
        assert out.response(2 * i).tolist() == out.response(2 * i + 1).tolist() == ids[len(prompt) :]


# -- the larger Nemotron 3 models: latent MoE ------------------------------------------

SUPER = "tiny-nemotron-3-super"


def test_super_preset_routes_its_experts_in_a_latent_space() -> None:
    """The routed experts work on a projection of the hidden state (64 -> 32 -> 64), the
    router and the shared expert on the hidden state itself; routing is group-limited
    (4 groups, the best 2 kept) over 16 experts, 4 per token."""
    lm = load(preset=SUPER)
    cfg = lm.model.config
    assert cfg.layers_block_type == ["linear_attention", "moe", "full_attention", "moe", "linear_attention", "moe"]
    assert (cfg.moe_latent_size, cfg.n_group, cfg.topk_group) == (32, 4, 2)
    mixer = lm.model.model.layers[1].mixer
    assert (mixer.fc1_latent_proj.in_features, mixer.fc1_latent_proj.out_features) == (64, 32)
    assert (mixer.fc2_latent_proj.in_features, mixer.fc2_latent_proj.out_features) == (32, 64)
    assert tuple(mixer.experts.up_proj.shape) == (16, 32, 32)  # [experts, intermediate, latent]
    assert mixer.gate.weight.shape == (16, 64) and mixer.shared_experts.up_proj.in_features == 64
    assert [(r.path, r.n_experts, r.top_k) for r in lm.routers] == [
        (f"model.layers.{i}.mixer.gate", 16, 4) for i in (1, 3, 5)
    ]
    # the latent projections are dense linear layers: LoRA adapts them with the other projections
    assert {"fc1_latent_proj", "fc2_latent_proj"} <= set(impl.LORA_TARGETS)


def test_super_preset_trains_and_its_routes_stay_in_the_kept_groups() -> None:
    lm = load(preset=SUPER)
    model = lm.model
    ids, mask = batch()
    seen: list[Any] = []
    gate = model.get_submodule(lm.routers[0].path)
    hook = gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    hook.remove()
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []  # latent projections and experts included
    picked = seen[0]  # [tokens, 4] expert ids; 16 experts in 4 groups of 4, 2 groups kept per token
    groups = {tuple(sorted(set((row // 4).tolist()))) for row in picked}
    assert all(len(g) <= 2 for g in groups) and any(len(g) == 2 for g in groups)


def test_super_preset_saves_and_loads_by_path_with_identical_logits(tmp_path) -> None:
    family = make_family(NemotronConfig(preset=SUPER))
    lm = family.load(alphabet=ALPHABET, seed=3)
    family.save(lm, tmp_path / "super")
    again = make_family(NemotronConfig(path=str(tmp_path / "super"))).load(alphabet=None, seed=0)
    assert again.model.config.moe_latent_size == 32
    ids, mask = batch()
    torch.testing.assert_close(logits(again.model, ids, mask), logits(lm.model, ids, mask), rtol=0, atol=0)

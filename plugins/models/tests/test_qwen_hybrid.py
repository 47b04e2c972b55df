"""The qwen family's hybrid MoE models, Qwen3.5-MoE (``qwen3_5_moe``) and Qwen3-Next
(``qwen3_next``): tiny presets (architecture, determinism, training), routers and LoRA
targets (also of Qwen3-MoE's dense layers), checkpoints and loading (also the
vision-language Qwen3.5-MoE layout), generation through the embedded engine, and the
full-size configs on the meta device."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
import transformers

from skyrl_host.interfaces import LoadedModel, ModelFamily, RouterInfo, SampleOutput
from skyrl_models import _hf, _qwen_impl, qwen
from skyrl_models.qwen import FULL_PRESETS, QwenConfig, make_family

ALPHABET = "0123456789reverse :"
VOCAB = 3 + len(set(ALPHABET))  # 19
HYBRID = ["tiny-qwen3.5-moe", "tiny-qwen3-next"]
EXPECTED = {  # preset -> (model type, class, linear-attention projections)
    "tiny-qwen3.5-moe": (
        "qwen3_5_moe_text",
        "Qwen3_5MoeForCausalLM",
        {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"},
    ),
    "tiny-qwen3-next": ("qwen3_next", "Qwen3NextForCausalLM", {"in_proj_qkvz", "in_proj_ba", "out_proj"}),
}


def load(preset: str, seed: int = 0, **options: Any) -> LoadedModel:
    return make_family(QwenConfig(preset=preset, **options)).load(alphabet=ALPHABET, seed=seed)


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


# -- tiny presets ------------------------------------------------------------------------


@pytest.mark.parametrize("preset", HYBRID)
def test_hybrid_preset_architecture_and_size(preset: str) -> None:
    lm = load(preset)
    model, cfg = lm.model, lm.model.config
    model_type, cls, linear_projections = EXPECTED[preset]
    assert isinstance(make_family(QwenConfig(preset=preset)), ModelFamily)
    assert type(model).__name__ == cls and cfg.model_type == model_type
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert [hasattr(layer, "linear_attn") for layer in model.model.layers] == [True, True, True, False]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 32)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.shared_expert_intermediate_size == 64 and not cfg.tie_word_embeddings
    assert cfg.vocab_size == len(lm.tokenizer) == VOCAB and lm.stop_token_ids == [1] and not model.training
    # per MoE layer: router 8x64, experts 8 x (64x64 + 32x64), shared expert 3 x 64x64, its gate 64, 2 norms
    moe = 8 * 64 + 8 * (64 * 64 + 32 * 64) + 3 * 64 * 64 + 64 + 2 * 64
    # Gated DeltaNet: q,k (2 heads x 16), v,z (4 heads x 16), b,a (4 each), conv over q,k,v, 4+4, norm 16, out
    linear = 64 * (32 + 32 + 64 + 64 + 4 + 4) + (32 + 32 + 64) * 4 + 4 + 4 + 16 + 64 * 64
    # gated attention: q (and its gate) 4 x 2 x 32, k, v 2 x 32, o, q/k norms
    attention = 64 * 256 + 2 * 64 * 64 + 128 * 64 + 2 * 32
    embeddings = 2 * VOCAB * 64 + 64  # untied input and output, final norm
    assert sum(p.numel() for p in model.parameters()) == 4 * moe + 3 * linear + attention + embeddings == 336_200
    assert linear_projections <= linear_names(model)


@pytest.mark.parametrize("preset", HYBRID)
def test_hybrid_preset_is_deterministic_and_trains(preset: str) -> None:
    torch.manual_seed(1)
    expected_next = torch.rand(2)
    torch.manual_seed(1)
    a = load(preset, seed=5).model.state_dict()
    assert torch.equal(torch.rand(2), expected_next)  # the process's random state is untouched
    lm = load(preset, seed=5)
    assert all(torch.equal(t, a[k]) for k, t in lm.model.state_dict().items())
    other = load(preset, seed=6).model.state_dict()
    assert not torch.equal(a["model.layers.0.mlp.gate.weight"], other["model.layers.0.mlp.gate.weight"])

    model = lm.model.train()
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []  # Gated DeltaNet (A_log, dt_bias, conv1d, ...), attention, experts, routers, shared experts


@pytest.mark.parametrize("preset", HYBRID)
def test_hybrid_preset_takes_overrides(preset: str) -> None:
    cfg = load(preset, top_k=3, num_experts=4, intermediate_size=16, num_layers=8).model.config
    assert (cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_hidden_layers) == (3, 4, 16, 8)
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2


# -- routers and LoRA targets ----------------------------------------------------------------


@pytest.mark.parametrize("preset", HYBRID)
def test_hybrid_routers_and_lora_targets(preset: str) -> None:
    lm = load(preset)
    infos = make_family(QwenConfig(preset=preset)).routers(lm.model)
    assert list(lm.routers) == infos == [
        RouterInfo(
            layer=i,
            path=f"model.layers.{i}.mlp.gate",
            kind="softmax_topk",
            n_experts=8,
            top_k=2,
            normalize=True,
            scale=1.0,
        )
        for i in range(4)
    ]
    linears = linear_names(lm.model)
    present = [t for t in qwen.LORA_TARGETS if t in linears]
    assert set(present) >= {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj"}
    assert set(present) >= EXPECTED[preset][2]
    assert not {"gate", "shared_expert_gate"} & set(qwen.LORA_TARGETS)  # routers and gates are left alone


def test_dense_qwen3_has_no_routers_and_every_lora_target_is_a_linear_somewhere() -> None:
    dense = load("tiny").model
    assert _qwen_impl.routers(dense) == [] and load("tiny").routers == ()
    everywhere = set()
    for preset in qwen.PRESETS:
        everywhere |= linear_names(load(preset).model)
    assert set(qwen.LORA_TARGETS) <= everywhere


@pytest.mark.parametrize(
    ("changes", "moe_layers"),
    [
        (dict(decoder_sparse_step=2), [1, 3]),  # every second layer is sparse
        (dict(mlp_only_layers=[0, 2]), [1, 3]),
        (dict(decoder_sparse_step=1, mlp_only_layers=[3], norm_topk_prob=False), [0, 1, 2]),
    ],
)
def test_qwen3_moe_routers_follow_sparse_step_and_mlp_only_layers(changes: dict, moe_layers: list[int]) -> None:
    tokenizer = _hf.char_tokenizer(ALPHABET, model_max_length=512)
    cfg = _qwen_impl.preset_config(QwenConfig(preset="tiny-moe", num_layers=4), tokenizer)
    for key, value in changes.items():
        setattr(cfg, key, value)
    with _hf.seeded(0):
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    infos = _qwen_impl.routers(model)
    assert [r.layer for r in infos] == moe_layers
    assert [r.path for r in infos] == [f"model.layers.{i}.mlp.gate" for i in moe_layers]
    assert {r.normalize for r in infos} == {cfg.norm_topk_prob}
    dense = [i for i in range(4) if i not in moe_layers]
    assert all(hasattr(model.model.layers[i].mlp, "gate_proj") for i in dense)  # a dense MLP: gate_proj, no router


# -- checkpoints and loading -----------------------------------------------------------------


@pytest.mark.parametrize("preset", HYBRID)
def test_save_then_load_gives_identical_logits(preset: str, tmp_path: pathlib.Path) -> None:
    lm = load(preset, seed=2)
    family = make_family(QwenConfig(preset=preset))
    family.save(lm, str(tmp_path / "ckpt"))
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["model_type"] == EXPECTED[preset][0]
    ids, mask = batch()
    expected = logits(lm.model, ids, mask)
    back = make_family(QwenConfig(path=str(tmp_path / "ckpt"))).load(alphabet=None, seed=0)
    assert back.family == "qwen" and type(back.model).__name__ == EXPECTED[preset][1]
    assert back.tokenizer.get_vocab() == lm.tokenizer.get_vocab() and back.stop_token_ids == [1]
    assert torch.equal(logits(back.model, ids, mask), expected)
    assert list(back.routers) == list(lm.routers)
    # transformers' own loader: the same weights; left inside the memory-mapped file at
    # unaligned addresses, so CPU kernels may round the last bit differently (the family
    # copies such tensors into aligned memory, hence the exact match above)
    raw = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    torch.testing.assert_close(logits(raw, ids, mask), expected, rtol=0, atol=1e-6)


def test_a_vision_language_qwen3_5_moe_folder_loads_as_its_text_model(tmp_path: pathlib.Path) -> None:
    lm = load("tiny-qwen3.5-moe", seed=4)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    cfg = transformers.Qwen3_5MoeConfig(text_config=lm.model.config.to_dict(), vision_config=vision)
    with _hf.seeded(0):
        full = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    full.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    got = make_family(QwenConfig(path=str(tmp_path))).load(alphabet=None, seed=0)
    assert type(got.model).__name__ == "Qwen3_5MoeForCausalLM" and got.model.config.model_type == "qwen3_5_moe_text"
    assert not any(".visual." in n for n, _ in got.model.named_parameters())
    ids, mask = batch()
    assert torch.equal(logits(got.model, ids, mask), logits(full, ids, mask))
    assert [r.layer for r in got.routers] == [0, 1, 2, 3]


# -- generation ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", HYBRID)
def test_engine_logprobs_match_a_full_forward(preset: str, skyrl_host: Any) -> None:
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
    for i in range(len(prompts)):
        start, end = int(out.cu_seqlens[i]), int(out.cu_seqlens[i + 1])
        tokens = torch.as_tensor(out.tokens[start:end], dtype=torch.long)[None]
        n_prompt = int(out.prompt_lens[i])
        with torch.no_grad():
            full = torch.log_softmax(lm.model(input_ids=tokens).logits[0].float(), -1)
        expected = full[n_prompt - 1 : -1].gather(1, tokens[0, n_prompt:, None])[:, 0]
        got = torch.as_tensor(out.logprobs[start + n_prompt : end])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)  # cached recurrent decoding vs chunked


# -- full-size configs -------------------------------------------------------------------------


def test_full_size_configs_on_the_meta_device() -> None:
    from skyrl_models.commands import count_parameters

    expected = {  # name -> (total, active) in billions, as the model names say
        "qwen3-30b-a3b": (30.5, 3.3),
        "qwen3-235b-a22b": (235, 22),
        "qwen3-next-80b-a3b": (80, 3.9),  # "A3B" without the embeddings and the head
        "qwen3.5-397b-a17b": (397, 17),
    }
    assert set(FULL_PRESETS) == set(expected)
    for name, (total_b, active_b) in expected.items():
        cfg = qwen.full_config(name)
        assert cfg.model_type == FULL_PRESETS[name][0]
        total, active = count_parameters(cfg)
        assert abs(total / 1e9 - total_b) / total_b < 0.02, (name, total)
        assert abs(active / 1e9 - active_b) / active_b < 0.05, (name, active)
    cfg = qwen.full_config("qwen3-next-80b-a3b")
    assert cfg.layer_types.count("full_attention") == 12 and cfg.rope_parameters["rope_theta"] == 5e6
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(cfg)
    infos = _qwen_impl.routers(model)
    assert len(infos) == 48 and {(r.n_experts, r.top_k, r.normalize) for r in infos} == {(512, 10, True)}
    with pytest.raises(KeyError, match="expected one of"):
        qwen.full_config("qwen4")

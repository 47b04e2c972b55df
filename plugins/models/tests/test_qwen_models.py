"""The qwen family's models: presets (sizes, determinism, dtypes, MoE routers),
the character-level tokenizer, and Hugging Face checkpoints (save, load)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest
import torch
import transformers

from skyrl_host.errors import UserError
from skyrl_host.interfaces import LoadedModel, ModelFamily
from skyrl_models.qwen import QwenConfig, make_family

DIGITS = "0123456789"
ALPHABET = "0123456789reverse :"  # what reverse_digits prompts and answers are made of
VOCAB = 3 + len(set(ALPHABET))  # <pad>, <eos>, <unk> + 16 characters = 19


def load(seed: int = 0, alphabet: str | None = ALPHABET, **options: Any) -> LoadedModel:
    options.setdefault("preset", "tiny")
    return make_family(QwenConfig(**options)).load(alphabet=alphabet, seed=seed)


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def batch(vocab: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    return ids, mask


def logits(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# -- presets -------------------------------------------------------------------


def test_tiny_is_the_165k_qwen3() -> None:
    lm = load()
    assert isinstance(make_family(QwenConfig(preset="tiny")), ModelFamily)
    model, cfg = lm.model, lm.model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 4)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (32, 256, 512)
    assert cfg.vocab_size == len(lm.tokenizer) == VOCAB
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    # per layer: q, k, v, o (64x128 each) + q/k norms (32 each) + MLP (3 x 64x256) + 2 norms (64 each)
    per_layer = 4 * 64 * 128 + 2 * 32 + 3 * 64 * 256 + 2 * 64
    assert n_params(model) == 2 * per_layer + VOCAB * 64 + 64 == 165_504
    assert lm.family == "qwen" and lm.stop_token_ids == [lm.tokenizer.eos_token_id] == [1]
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert 0.015 < model.model.layers[0].mlp.up_proj.weight.std().item() < 0.025  # initializer_range 0.02


def test_tiny_moe_is_a_qwen3_moe_with_8_experts_top_2() -> None:
    lm = load(preset="tiny-moe")
    model, cfg = lm.model, lm.model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and cfg.model_type == "qwen3_moe"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 64, True)
    assert cfg.tie_word_embeddings and cfg.head_dim == 32
    # per layer: attention as in tiny + experts (8 x 3 x 64x64) + router (8x64) + 2 norms
    per_layer = 4 * 64 * 128 + 2 * 32 + 8 * 3 * 64 * 64 + 8 * 64 + 2 * 64
    assert n_params(model) == 2 * per_layer + VOCAB * 64 + 64 == 264_832


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
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    m1, m2 = load(seed=7, preset="tiny-moe").model.state_dict(), load(seed=7, preset="tiny-moe").model.state_dict()
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


def test_overrides_and_attention_implementation() -> None:
    lm = load(hidden_size=32, num_layers=1, num_heads=2, head_dim=16, intermediate_size=64, attn_implementation="eager")
    cfg = lm.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 1, 2, 2)
    assert (cfg.head_dim, cfg.intermediate_size) == (16, 64)
    assert cfg._attn_implementation == "eager"
    assert load().model.config._attn_implementation == "sdpa"
    moe = load(preset="tiny-moe", num_experts=4, top_k=1, intermediate_size=16).model.config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 1, 16)


def test_bfloat16_weights_are_the_float32_weights_rounded() -> None:
    f32, bf16 = load(seed=3), load(seed=3, dtype="bfloat16")
    state = f32.model.state_dict()
    for name, p in bf16.model.state_dict().items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, state[name].to(torch.bfloat16)), name
    out = logits(bf16.model, *batch(VOCAB))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_tiny_moe_forward_backward_and_routers() -> None:
    lm = load(preset="tiny-moe")
    model = lm.model.train()
    routers = [layer.mlp.gate for layer in model.model.layers]
    assert len(routers) == 2
    seen: list[Any] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: seen.append(out)) for r in routers]
    ids, mask = batch(VOCAB)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    for h in hooks:
        h.remove()
    assert torch.isfinite(loss)
    assert len(seen) == 2
    for router_logits, weights, indices in seen:  # (router_logits, routing_weights, expert_indices)
        assert router_logits.shape == (ids.numel(), 8)
        assert indices.shape == weights.shape == (ids.numel(), 2)
        assert torch.allclose(weights.sum(-1), torch.ones(ids.numel()))  # norm_topk_prob
    layer = model.model.layers[0].mlp
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0
    assert layer.experts.gate_up_proj.grad is not None and layer.experts.gate_up_proj.grad.abs().sum() > 0


# -- the tokenizer ----------------------------------------------------------------


def test_tokenizer_is_one_id_per_character_and_round_trips() -> None:
    tok = load().tokenizer
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    vocab = tok.get_vocab()
    assert len(vocab) == VOCAB and {"<pad>": 0, "<eos>": 1, "<unk>": 2}.items() <= vocab.items()
    assert [tok.pad_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2]
    for text in ["reverse 4071:", "  reverse  9:", "1704", "", " "]:
        ids = tok.encode(text)
        assert len(ids) == len(text) and all(i > 2 for i in ids)
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("reverse 4071:")) == list("reverse 4071:")
    assert tok.encode("4x7") == [vocab["4"], 2, vocab["7"]]  # unknown characters -> <unk>
    assert tok.decode(tok.encode("17") + [1], skip_special_tokens=True) == "17"
    padded = tok(["12", "1234"], padding=True)
    assert padded["input_ids"][0][:2] == [0, 0] and padded["attention_mask"][0] == [0, 0, 1, 1]


def test_tokenizer_vocabulary_depends_only_on_the_set_of_characters() -> None:
    a = load(alphabet="9876543210").tokenizer.get_vocab()
    b = load(alphabet=DIGITS + DIGITS).tokenizer.get_vocab()
    assert a == b and len(a) == 13


@pytest.mark.parametrize(
    ("alphabet", "message"), [(None, "the dataset provides no alphabet; "), ("", "alphabet is empty")]
)
def test_a_preset_needs_an_alphabet(alphabet: str | None, message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        load(alphabet=alphabet)
    assert info.value.problems[0].key == "model.preset"


# -- checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_save_then_from_pretrained_gives_identical_logits(tmp_path: pathlib.Path, preset: str) -> None:
    lm = load(seed=5, preset=preset)
    family = make_family(QwenConfig(preset=preset))
    out = tmp_path / "ckpt" / "step-1"  # the parent does not exist yet
    family.save(lm, str(out))
    files = set(os.listdir(out))
    expected = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= files
    assert os.listdir(out.parent) == ["step-1"]  # no temporary folder left behind
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids, mask = batch(VOCAB)
    assert torch.equal(logits(model, ids, mask), logits(lm.model, ids, mask))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == lm.tokenizer.get_vocab()
    assert tok.encode("reverse 4071:") == lm.tokenizer.encode("reverse 4071:")
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "<eos>", "<unk>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1


def test_load_a_saved_folder_through_the_family(tmp_path: pathlib.Path) -> None:
    lm = load(seed=2, preset="tiny-moe")
    make_family(QwenConfig(preset="tiny-moe")).save(lm, str(tmp_path / "m"))
    back = make_family(QwenConfig(path=str(tmp_path / "m"))).load(alphabet=None, seed=99)  # seed and alphabet unused
    assert back.family == "qwen" and back.stop_token_ids == [1] and not back.model.training
    ids, mask = batch(VOCAB)
    assert torch.equal(logits(back.model, ids, mask), logits(lm.model, ids, mask))
    assert back.tokenizer.decode(back.tokenizer.encode("reverse 12:")) == "reverse 12:"
    bf16 = make_family(QwenConfig(path=str(tmp_path / "m"), dtype="bfloat16")).load(alphabet=None, seed=0)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}


def test_saving_again_replaces_the_folder(tmp_path: pathlib.Path) -> None:
    family = make_family(QwenConfig(preset="tiny"))
    family.save(load(seed=1), str(tmp_path / "m"))
    (tmp_path / "m" / "stale.txt").write_text("from before")
    family.save(load(seed=2), str(tmp_path / "m"))
    assert os.listdir(tmp_path) == ["m"] and not (tmp_path / "m" / "stale.txt").exists()
    back = make_family(QwenConfig(path=str(tmp_path / "m"))).load(alphabet=None, seed=0)
    ids, mask = batch(VOCAB)
    assert torch.equal(logits(back.model, ids, mask), logits(load(seed=2).model, ids, mask))


def test_a_folder_of_another_model_type_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UserError) as info:
        make_family(QwenConfig(path=str(tmp_path))).load(alphabet=None, seed=0)
    problem = info.value.problems[0]
    assert problem.key == "model.path"
    assert "model family 'qwen' loads model types 'qwen3', 'qwen3_moe'" in problem.message
    assert "has model type 'llama'" in problem.message


def test_a_folder_without_tokenizer_or_weights_is_refused(tmp_path: pathlib.Path) -> None:
    family = make_family(QwenConfig(preset="tiny"))
    family.save(load(), str(tmp_path / "m"))
    (tmp_path / "m" / "tokenizer.json").unlink()
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    with pytest.raises(UserError, match="has no tokenizer files"):
        make_family(QwenConfig(path=str(tmp_path / "m"))).load(alphabet=None, seed=0)
    family.save(load(), str(tmp_path / "m"))
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="cannot load the model from"):
        make_family(QwenConfig(path=str(tmp_path / "m"))).load(alphabet=None, seed=0)

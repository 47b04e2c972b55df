"""Real-shaped checkpoints (skyrl_models.checkpoints, the skyrl_real_checkpoint fixture):
transformers loads them as downloaded checkpoints, and each family's ``load`` from the path
keeps the tokenizer, its chat template and the end-of-turn stop token."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from skyrl_models import glm, kimi, qwen
from skyrl_models.checkpoints import CHAT_TEMPLATE, FAMILY, IM_END, KINDS

FAMILIES: dict[str, Any] = {"qwen": (qwen.QwenConfig, qwen.make_family), "glm": (glm.GlmConfig, glm.make_family),
                            "kimi": (kimi.KimiConfig, kimi.make_family)}
MESSAGES = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 12 + 30?"}]


def test_the_qwen3_folder_has_qwen3_0_6b_widths_and_loads_with_auto_classes(skyrl_real_checkpoint) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = skyrl_real_checkpoint("qwen3")
    assert sorted(os.listdir(path)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "intermediate_size", "num_hidden_layers", "tie_word_embeddings",
                                   "dtype")} == {
        "model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "num_hidden_layers": 2, "tie_word_embeddings": True,
        "dtype": "bfloat16"}
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert 7000 < len(tok) <= config["vocab_size"] and config["vocab_size"] % 128 == 0  # padded embedding rows
    assert tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
    assert config["eos_token_id"] == tok.convert_tokens_to_ids(IM_END)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids("<|endoftext|>")]
    # a real BPE: words are single tokens with their space, digits one by one, specials whole
    assert tok.tokenize(" apples 123") == ["Ġapples", "Ġ", "1", "2", "3"]
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert tok.decode(ids) == text and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"]) and torch.isfinite(logits).all()


def test_building_is_a_pure_function_of_the_seed(skyrl_real_checkpoint, tmp_path) -> None:
    from safetensors.torch import load_file

    from skyrl_models.checkpoints import build_checkpoint

    again = build_checkpoint(tmp_path / "again", "qwen3_moe", seed=0, tokenizer=skyrl_real_checkpoint("qwen3_moe"))
    a, b = load_file(skyrl_real_checkpoint("qwen3_moe") / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load_file(skyrl_real_checkpoint("qwen3_moe", seed=1) / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert skyrl_real_checkpoint("qwen3_moe") == skyrl_real_checkpoint("qwen3_moe")  # built once per session


@pytest.mark.parametrize("kind", KINDS)
def test_the_family_loads_the_folder_with_its_tokenizer_template_and_stop_tokens(skyrl_real_checkpoint, kind) -> None:
    path = skyrl_real_checkpoint(kind)
    config_cls, make_family = FAMILIES[FAMILY[kind]]
    loaded = make_family(config_cls(path=str(path))).load(alphabet=None, seed=0)
    tok = loaded.tokenizer
    assert json.loads((path / "config.json").read_text())["model_type"] == kind
    assert tok.chat_template == CHAT_TEMPLATE and len(tok) > 7000
    im_end, eot = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids("<|endoftext|>")
    assert loaded.stop_token_ids == [im_end, eot]  # the end of a turn first, then the generation config's EOS
    assert loaded.model.dtype == torch.float32  # the family's default dtype, not the file's bfloat16
    assert (len(loaded.routers) > 0) == (kind != "qwen3")
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        assert torch.isfinite(loaded.model(torch.tensor([ids])).logits).all()
    # the Ray launcher's driver loads only the tokenizer: the same tokenizer and stop ids
    light = make_family(config_cls(path=str(path))).load_tokenizer(alphabet=None)
    assert light.stop_token_ids == loaded.stop_token_ids and light.tokenizer.chat_template == CHAT_TEMPLATE


def test_an_unknown_kind_is_refused(skyrl_real_checkpoint) -> None:
    with pytest.raises(ValueError, match="kind must be one of 'qwen3'"):
        skyrl_real_checkpoint("llama")

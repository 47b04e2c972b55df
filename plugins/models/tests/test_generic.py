"""The generic family ``hf``: any transformers causal LM, what probing finds in it, the
family a folder picks without ``family``, and the folders it refuses."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from skyrl_models._generic_impl import lora_targets, probe_routers
from skyrl_models.hf import MOE_PRESETS, PRESETS, HfConfig, make_family

ALPHABET = "0123456789:"
ROOT = pathlib.Path(__file__).resolve().parents[3]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def load(preset: str, seed: int = 0):
    return make_family(HfConfig(preset=preset)).load(alphabet=ALPHABET, seed=seed)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_builds_its_architecture_and_the_engine_scores_what_the_trainer_does(skyrl_host, preset) -> None:
    from skyrl_engines.embedded import Embedded, EmbeddedConfig
    from skyrl_samplers.processing import TruncatedSampler

    loaded = load(preset)
    model_type, numbers = PRESETS[preset]
    assert loaded.model.config.model_type == model_type
    assert loaded.model.config.num_hidden_layers == numbers["num_hidden_layers"] == 2
    assert loaded.family == "hf" and loaded.stop_token_ids == [loaded.tokenizer.eos_token_id]
    # The same seed builds the same weights.
    again = load(preset)
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), again.model.state_dict().values()))
    # One GRPO step on what the engine sampled: the trainer's pre-update logprobs are the engine's (fp32).
    engine = Embedded(EmbeddedConfig(return_routed_experts=preset in MOE_PRESETS))
    engine.start(loaded)
    batch = engine.generate([[3, 4, 5], [6, 7, 8, 9], [12]], n=4, sampler=TruncatedSampler(temperature=1.0),
                            max_new_tokens=6, seed=1)
    reg = skyrl_host.registry.get("backends", "torch")
    backend = reg.create(reg.config(lr=1e-3))
    replay = []
    if preset in MOE_PRESETS:
        r3 = skyrl_host.registry.get("replay_strategies", "r3")
        replay = [r3.create(r3.config() if r3.config else None)]
    backend.start(loaded, seed=0, total_steps=2, reference=False, replay=replay)
    algo_reg = skyrl_host.registry.get("algorithms", "grpo")
    algo = algo_reg.create(algo_reg.config())
    batch.rewards = np.random.default_rng(0).random(batch.n_sequences).astype(np.float32)
    adv = np.asarray(algo.advantages(batch, batch.rewards), dtype=np.float32)
    metrics = backend.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=6)
    assert metrics["logprob_diff_max"] <= 1e-5, (preset, metrics["logprob_diff_max"])
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


@pytest.mark.parametrize("preset, targets", [
    ("tiny-llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("tiny-phi3", ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")),  # Phi-3 fuses them: found, not listed
    ("tiny-mixtral", ("q_proj", "k_proj", "v_proj", "o_proj")),  # experts are fused 3-D parameters, the router no target
    ("tiny-qwen2-moe", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
])
def test_lora_targets_are_the_linear_layers_the_model_has(preset, targets) -> None:
    loaded = load(preset)
    assert tuple(loaded.lora_targets) == targets
    assert lora_targets(loaded.model, list(loaded.routers)) == targets


def test_routers_are_found_by_their_numbers_and_others_refused_with_the_reason() -> None:
    mixtral = load("tiny-mixtral")
    assert [(r.layer, r.path, r.kind, r.n_experts, r.top_k, r.normalize) for r in mixtral.routers] == [
        (0, "model.layers.0.mlp.gate", "softmax_topk", 4, 2, True),
        (1, "model.layers.1.mlp.gate", "softmax_topk", 4, 2, True)]
    # Qwen2-MoE without renormalisation: found as such (the probe tells the two apart).
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2_moe", **dict(PRESETS["tiny-qwen2-moe"][1], norm_topk_prob=False), vocab_size=16)
    torch.manual_seed(0)
    found, refused = probe_routers(AutoModelForCausalLM.from_config(cfg))
    assert [r.normalize for r in found] == [False, False] and refused == {}
    # PhiMoE's sparsemixer weighs its experts otherwise: router-shaped, refused for r3 with the reason.
    cfg = AutoConfig.for_model("phimoe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                               num_experts_per_tok=2, vocab_size=16)
    found, refused = probe_routers(AutoModelForCausalLM.from_config(cfg))
    assert found == [] and sorted(refused) == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    assert "otherwise than a softmax" in refused["model.layers.0.mlp.router"] or "top-2" in refused[
        "model.layers.0.mlp.router"]
    # A dense model has none.
    assert load("tiny-llama").routers == ()


def _save(tmp_path: pathlib.Path, preset: str) -> pathlib.Path:
    fam = make_family(HfConfig(preset=preset))
    loaded = fam.load(alphabet=ALPHABET, seed=3)
    folder = tmp_path / preset
    fam.save(loaded, str(folder))
    return folder


def test_a_saved_folder_loads_back_with_the_same_logits_and_picks_its_family(tmp_path, skyrl_host) -> None:
    folder = _save(tmp_path, "tiny-qwen2")
    loaded = make_family(HfConfig(path=str(folder))).load(alphabet=None, seed=0)
    again = load("tiny-qwen2", seed=3)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, again.model(ids).logits)
    # Without [model] family the folder's model_type picks it: qwen2 is no specific family's -> hf.
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "rl"\nsteps = 1\n[model]\npath = "{folder}"\n[dataset]\nname = "reverse_digits"\n'
                   'prefix = ""\n')
    out = subprocess.run([SKYRL, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[model]       hf" in out.stdout
    assert "family 'hf' chosen: no specific family covers config.json's model_type 'qwen2'" in out.stdout


def test_a_folder_of_a_specific_family_picks_that_family(tmp_path) -> None:
    reg_family = make_family  # noqa: F841 - the qwen family saves a qwen3 folder
    from skyrl_models.qwen import QwenConfig
    from skyrl_models.qwen import make_family as qwen_family

    fam = qwen_family(QwenConfig(preset="tiny"))
    fam.save(fam.load(alphabet=ALPHABET, seed=0), str(tmp_path / "qwen3"))
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "rl"\nsteps = 1\n[model]\npath = "{tmp_path / "qwen3"}"\n'
                   '[dataset]\nname = "reverse_digits"\nprefix = ""\n')
    out = subprocess.run([SKYRL, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[model]       qwen" in out.stdout and "config.json's model_type 'qwen3' is one of family 'qwen''s" in out.stdout


def _folder(tmp_path: pathlib.Path, name: str, config: dict) -> pathlib.Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config, message", [
    ({"model_type": "not_a_model_type_anyone_knows", "architectures": ["FooForCausalLM"]},
     "model type 'not_a_model_type_anyone_knows', which transformers 5.24.0 does not know"),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]},
     "holds BertForMaskedLM (model type 'bert'): not a causal language model"),
    ({"model_type": "vit", "architectures": ["ViTModel"]}, "holds ViTModel (model type 'vit'): not a causal language"),
    ({"model_type": "t5"}, "model type 't5': not a causal language model in transformers"),
    ({"model_type": "acme_lm", "auto_map": {"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"},
      "architectures": ["AcmeForCausalLM"]},
     "ships its own model code (modeling_acme.AcmeForCausalLM, config.json auto_map): it would run that Python code; "
     "refused unless the job sets [model] trust_remote_code = true"),
    ({"architectures": ["LlamaForCausalLM"]}, "config.json has no model_type"),
])
def test_folders_it_cannot_load_are_one_clear_message_with_exit_2(tmp_path, config, message) -> None:
    folder = _folder(tmp_path, "m", config)
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "rl"\nsteps = 1\n[model]\npath = "{folder}"\n[dataset]\nname = "reverse_digits"\n')
    out = subprocess.run([SKYRL, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and message in out.stderr, out.stderr
    assert "model.path" in out.stderr


def _moe_folder(tmp_path: pathlib.Path, model_type: str, **numbers) -> pathlib.Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from skyrl_models import _hf

    tokenizer = _hf.char_tokenizer(ALPHABET, model_max_length=512)
    cfg = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, **numbers, **_hf.vocab_ids(tokenizer))
    torch.manual_seed(0)
    folder = tmp_path / model_type
    _hf.save_folder(AutoModelForCausalLM.from_config(cfg), tokenizer, folder)
    return folder


R3_JOB = """[job]
kind = "rl"
steps = 1
[model]
path = "{folder}"
[dataset]
name = "reverse_digits"
prefix = ""
[engine]
return_routed_experts = true
[replay]
strategies = ["r3"]
"""


def test_r3_on_a_folder_is_refused_at_validate_where_its_routers_weigh_experts_otherwise(tmp_path) -> None:
    # PhiMoE (sparsemixer routing): router-shaped, other numbers -> refused with the reason.
    job = tmp_path / "phimoe.toml"
    job.write_text(R3_JOB.format(folder=_moe_folder(tmp_path, "phimoe", num_local_experts=4, num_experts_per_tok=2)))
    out = subprocess.run([SKYRL, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "replay.strategies: replay strategy 'r3' cannot replay the routers of" in out.stderr
    assert "model.layers.0.mlp.router: PhimoeTopKRouter" in out.stderr
    # OLMoE (softmax top-k, not renormalised): found, so r3 validates.
    job = tmp_path / "olmoe.toml"
    job.write_text(R3_JOB.format(folder=_moe_folder(tmp_path, "olmoe", num_experts=4, num_experts_per_tok=2)))
    out = subprocess.run([SKYRL, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[model]       hf" in out.stdout and "[replay]      r3" in out.stdout

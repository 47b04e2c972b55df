"""What the final save writes, as a user loads it: LoRA adapters in PEFT's format (the
real ``peft`` library loads them onto the base and gives the backend's own logits), the
merged model in ``final/`` (``from_pretrained`` loads it), the frozen base beside it,
and the final model in the job's ``[model] dtype`` without touching the trainer's tensors."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from skyrl_host.interfaces import ModelTraits
from skyrl_toolkit.launch import save_trained_model

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 2], [9, 8, 7, 6, 5, 4, 3, 2]])


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def safetensors_dtypes(folder: pathlib.Path) -> set[torch.dtype]:
    from safetensors import safe_open

    dtypes = set()
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    for file in files:
        with safe_open(str(file), "pt") as f:
            dtypes |= {f.get_tensor(k).dtype for k in f.keys()}
    return dtypes


def train_lora(tiny, steps=2, **opts):
    opts = dict(dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.05, lora_targets=TARGETS, lr=2e-2), **opts)
    be = tiny.make_backend(**opts)
    loaded = tiny.loaded(0)
    be.start(loaded, seed=0, total_steps=10, reference=False)
    batch = tiny.tiny_batch(0)
    for _ in range(steps):
        be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    return be, loaded


def test_adapters_load_in_peft_and_give_the_backends_logits(tiny, tmp_path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    be, _ = train_lora(tiny)
    folder = tmp_path / "adapter"
    be.save_adapters(str(folder), base_model="/models/base")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                   "use_rslora", "base_model_name_or_path", "bias")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05,
        "target_modules": TARGETS, "use_rslora": False, "base_model_name_or_path": "/models/base", "bias": "none",
    }
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    ours = dict(be.named_adapters())
    assert set(tensors) == {f"base_model.model.{k}.weight" for k in ours}
    assert all(torch.equal(tensors[f"base_model.model.{k}.weight"], v) for k, v in ours.items())

    base = tiny.tiny_model(0)  # the frozen base the adapters were trained on
    base_logits = logits(base)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    layer = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    assert layer.scaling["default"] == 8.0 / 4 and layer.r["default"] == 4
    # Exactly the adapted modules, none more.
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(be.lora.modules)
    be.module.eval()  # no dropout: compare the deterministic forward
    want = logits(be.module)
    got = logits(peft_model)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (want - base_logits).abs().max() > 1e-3  # the adapters trained: PEFT applies them


def test_targets_peft_would_match_beyond_ours_are_saved_as_paths(tiny, tmp_path) -> None:
    """A target that names nn.Linear and other modules: the backend adapts the Linear ones
    only; PEFT's suffix rule would also take the others, so the config lists paths."""
    from peft import PeftModel

    class Named(torch.nn.Module):  # a non-Linear module named like a target
        def forward(self, x):
            return x

    model = tiny.tiny_model(0)
    model.model.q_proj = Named()
    from skyrl_host.interfaces import LoadedModel

    be = tiny.make_backend(lora_rank=2, lora_targets=["q_proj"], lr=1e-2)
    be.start(LoadedModel(model, None, [1], family="test"), seed=0, total_steps=2, reference=False)
    be.save_adapters(str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    base = tiny.tiny_model(0)
    base.model.q_proj = Named()
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "a"))
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(config["target_modules"])


def digits_batch():
    """A few sequences in the qwen preset's vocabulary (the ten digits' ids and more)."""
    from skyrl_host.rollout import RolloutBatch

    prompts = [[3, 4, 5], [6, 7, 8, 9], [4, 4, 3], [10, 9, 8]]
    responses = [[5, 4, 3], [9, 8], [3, 4, 4, 2], [8, 9]]
    return RolloutBatch.from_sequences(prompts, responses, [[-2.3] * len(r) for r in responses], group_ids=[0, 0, 1, 1])


def traits(family) -> ModelTraits:
    """What the job's [model] choice declares for ``family``'s config (its dtype and folder)."""
    return ModelTraits(dtype=family.config.dtype, path=family.config.resolved_path)


def qwen(dtype: str, **kw):
    import skyrl_models.qwen as qwen

    family = qwen.make_family(qwen.QwenConfig(preset="tiny", dtype=dtype, **kw))
    return family, family.load(alphabet="0123456789", seed=0)


def test_save_trained_model_converts_on_the_way_out_and_keeps_the_base(tiny, tmp_path) -> None:
    """bf16 job, LoRA: final/ and final/base are bf16; the backend's tensors and the loaded
    model's (the frozen base, float32 in the trainer) are unchanged by the save."""
    from transformers import AutoModelForCausalLM

    family, loaded = qwen("bfloat16")
    original = {k: v.clone() for k, v in family.load(alphabet="0123456789", seed=0).model.state_dict().items()}
    be = tiny.make_backend(lora_rank=4, lr=2e-2)
    be.start(loaded, seed=0, total_steps=10, reference=False)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    batch = digits_batch()
    for _ in range(2):
        be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    weights = {k: v.clone() for k, v in be.named_weights()}
    adapters = {k: v.clone() for k, v in be.named_adapters()}
    base_before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    assert {v.dtype for v in base_before.values() if v.is_floating_point()} == {torch.float32}  # master weights

    final = tmp_path / "final"
    save_trained_model(be, family, loaded, str(final), traits(family))

    for k, v in be.named_weights():
        assert torch.equal(v, weights[k]) and v.dtype == torch.float32, k
    assert all(torch.equal(v, adapters[k]) for k, v in be.named_adapters())
    assert all(torch.equal(v, base_before[k]) for k, v in loaded.model.state_dict().items())
    assert all(v.dtype == torch.float32 for v in be.module.parameters())
    assert safetensors_dtypes(final) == {torch.bfloat16}
    assert safetensors_dtypes(final / "base") == {torch.bfloat16}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    merged = AutoModelForCausalLM.from_pretrained(final)
    assert merged.dtype == torch.bfloat16
    for k, v in merged.state_dict().items():
        assert torch.equal(v, weights[k].to(torch.bfloat16)), k
    base = AutoModelForCausalLM.from_pretrained(final / "base")
    assert all(torch.equal(v, original[k]) for k, v in base.state_dict().items())  # the model the job started from
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(final / "base")
    # The adapters (float32) on the base upcast to float32 give the backend's logits. (The
    # bf16 preset's rotary frequencies are bf16-rounded buffers, which the trainer upcast;
    # from_pretrained recomputes them: give the base the trainer's, to compare the adapters.)
    from peft import PeftModel

    base = base.float()
    for name, buf in be.module.named_buffers():
        if "rotary" in name:
            base.get_buffer(name).copy_(buf)
    peft_model = PeftModel.from_pretrained(base, str(final / "adapter")).eval()
    be.module.eval()
    torch.testing.assert_close(logits(peft_model, ids), logits(be.module, ids), rtol=0, atol=1e-5)


def test_lora_base_is_the_model_folder_when_the_job_loads_one(tiny, tmp_path) -> None:
    family, loaded = qwen("float32")
    family.save(loaded, str(tmp_path / "model"))
    import skyrl_models.qwen as qwen_mod

    family = qwen_mod.make_family(qwen_mod.QwenConfig(path=str(tmp_path / "model")))
    loaded = family.load(alphabet=None, seed=0)
    be = tiny.make_backend(lora_rank=2, lr=1e-2)
    be.start(loaded, seed=0, total_steps=2, reference=False)
    save_trained_model(be, family, loaded, str(tmp_path / "final"), traits(family))
    assert sorted(p.name for p in (tmp_path / "final").iterdir() if p.is_dir()) == ["adapter"]  # no copy of the base
    config = json.loads((tmp_path / "final" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "model")
    assert safetensors_dtypes(tmp_path / "final") == {torch.float32}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rl_job_saves_final_in_the_models_dtype(skyrl_cli, skyrl_tiny_rl_job, tmp_path, dtype) -> None:
    from transformers import AutoModelForCausalLM

    job = skyrl_tiny_rl_job(tmp_path, dtype, job={"steps": 2, "save_final": True}, model={"dtype": dtype})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    final = job.out / "final"
    want = getattr(torch, dtype)
    assert safetensors_dtypes(final) == {want}
    assert json.loads((final / "config.json").read_text())["dtype"] == dtype
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.dtype == want and torch.isfinite(logits(model, torch.tensor([[2, 3, 4]]))).all()
    assert not (final / "adapter").exists()


def test_rl_job_with_lora_saves_a_peft_adapter_beside_the_merged_model(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    job = skyrl_tiny_rl_job(tmp_path, "lora", job={"steps": 2, "save_final": True},
                            backend={"lr": 5e-3, "lora_rank": 4})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    final = job.out / "final"
    assert sorted(p.name for p in (final / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (final / "adapter_config.json").exists()  # final/ itself is the merged model
    merged = AutoModelForCausalLM.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(final / "base")
    # PEFT finds the base through base_model_name_or_path and gives the merged model's logits.
    peft_model = AutoPeftModelForCausalLM.from_pretrained(final / "adapter").eval()
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    torch.testing.assert_close(logits(peft_model, ids), logits(merged, ids), rtol=0, atol=1e-5)
    assert (logits(merged, ids) - logits(base, ids)).abs().max() > 1e-6  # trained: the adapters moved it

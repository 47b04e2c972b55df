"""LoRA in the torch backend (``lora_rank > 0``): the base is frozen and only the adapters
train; step 0 is the base model exactly; the reference policy is the base; merged
weights, adapter export and checkpoints; options and target errors."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from skyrl_backends.torch import TorchBackendConfig
from skyrl_host.errors import UserError
from skyrl_host.interfaces import LoadedModel
from skyrl_host.testing import run_gloo_ranks

HERE = pathlib.Path(__file__).resolve().parent

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def start(tiny, seed=0, reference=False, total_steps=10, model_seed=0, **opts):
    opts.setdefault("lora_rank", 4)
    opts.setdefault("lora_targets", TARGETS)
    be = tiny.make_backend(**opts)
    loaded = tiny.loaded(model_seed)
    be.start(loaded, seed=seed, total_steps=total_steps, reference=reference)
    return be, loaded


class NLL:
    """A supervised objective: the mean negative logprob of the loss tokens."""

    needs_reference = False

    def loss(self, inputs):
        return -(inputs.logprobs * inputs.mask).sum() / inputs.global_tokens, {}


def test_base_is_frozen_and_only_adapters_train(tiny) -> None:
    be, loaded = start(tiny, lr=1e-2)
    base = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    adapters = {k: v.clone() for k, v in be.named_adapters()}
    # Two adapters per targeted Linear of each of the 2 layers, with stable names and shapes.
    assert len(adapters) == 2 * 2 * len(TARGETS)
    assert adapters["model.layers.0.self_attn.q_proj.lora_A"].shape == (4, 64)
    assert adapters["model.layers.0.self_attn.q_proj.lora_B"].shape == (128, 4)
    assert all(not torch.any(v) for k, v in adapters.items() if k.endswith("lora_B"))  # B starts at zero
    trainable = {n for n, p in be.module.named_parameters() if p.requires_grad}
    assert trainable == set(adapters)
    in_optimizer = {id(p) for g in be.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in be.module.named_parameters() if n in adapters}

    batch = tiny.tiny_batch(0)
    for _ in range(3):
        be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    # The base tensors (shared with the caller's model) did not move by a bit.
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, base[k]), k
    after = dict(be.named_adapters())
    assert all(not torch.equal(after[k], adapters[k]) for k in adapters if k.endswith("lora_B"))
    # The caller's module tree carries no adapters (an engine serving it sees the base).
    assert not any("lora" in n for n in loaded.model.state_dict())


def test_step_zero_is_the_base_model_exactly(tiny) -> None:
    be, loaded = start(tiny, reference=True)
    base = loaded.model.state_dict()
    merged = dict(be.named_weights())
    assert merged.keys() == base.keys()
    assert all(torch.equal(merged[k], base[k]) for k in base)
    # Before any update the policy (base + adapters with B = 0) and the reference (the
    # base, adapters off) give identical logprobs: the first step's KL is exactly 0.
    batch = tiny.tiny_batch(3)
    m = be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(needs_reference=True), temperature=0.9,
                      max_new_tokens=8)
    assert m["kl"] == 0.0
    m = be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(needs_reference=True), temperature=0.9,
                      max_new_tokens=8)
    assert m["kl"] > 0.0


def test_reference_is_the_base_without_adapters(tiny) -> None:
    full = tiny.make_backend()
    full.start(tiny.loaded(0), seed=0, total_steps=10, reference=True)
    batch = tiny.tiny_batch(4)
    want = full.reference_logprobs(batch, temperature=0.8)
    be, _ = start(tiny, reference=True, lr=1e-2)
    for _ in range(2):
        be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=0.8, max_new_tokens=8)
    got = be.reference_logprobs(batch, temperature=0.8)
    assert (got == want).all()
    assert be.reference is be.module  # no second copy of the weights


def test_loss_decreases_on_a_tiny_supervised_task(tiny) -> None:
    be, _ = start(tiny, lr=2e-2, lora_rank=8)
    batch = tiny.tiny_batch(5)
    adv = tiny.tiny_advantages(batch)
    losses = [be.train_step(batch, adv, NLL(), temperature=1.0, max_new_tokens=8)["loss"] for _ in range(15)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_merged_weights_are_base_plus_scaled_low_rank_product(tiny) -> None:
    be, loaded = start(tiny, lr=1e-2, lora_alpha=8.0)
    batch = tiny.tiny_batch(0)
    be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    merged, base, ad = dict(be.named_weights()), loaded.model.state_dict(), dict(be.named_adapters())
    name = "model.layers.1.mlp.down_proj"
    want = base[f"{name}.weight"] + (ad[f"{name}.lora_B"] @ ad[f"{name}.lora_A"]) * (8.0 / 4)
    torch.testing.assert_close(merged[f"{name}.weight"], want, rtol=0, atol=1e-6)
    assert not torch.equal(merged[f"{name}.weight"], base[f"{name}.weight"])
    untouched = "model.layers.1.mlp.up_proj.weight"  # not a target
    assert torch.equal(merged[untouched], base[untouched])
    # The merged weights reproduce the adapted model's logprobs in a plain model.
    plain = tiny.tiny_model(0)
    plain.load_state_dict(merged)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        want_logits = plain(ids).logits
        got_logits = be.module(ids).logits
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5)
    assert be.adapter_config() == {"rank": 4, "alpha": 8.0, "targets": TARGETS}


def test_gradient_checkpointing_and_bf16_autocast_train_the_adapters(tiny) -> None:
    batch = tiny.tiny_batch(2)
    norms = {}
    for gc in (False, True):
        for dtype in ("float32", "bfloat16"):
            be, _ = start(tiny, lr=1e-2, gradient_checkpointing=gc, compute_dtype=dtype)
            norms[gc, dtype] = [be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=1.0,
                                              max_new_tokens=8)["grad_norm"] for _ in range(2)]
    assert norms[True, "float32"] == norms[False, "float32"]  # recomputation changes nothing
    assert norms[True, "bfloat16"] == norms[False, "bfloat16"]
    assert norms[False, "bfloat16"] == pytest.approx(norms[False, "float32"], rel=0.02)
    assert all(n > 0 for ns in norms.values() for n in ns)


def test_save_adapters_writes_a_peft_adapter(tiny, tmp_path) -> None:
    from safetensors.torch import load_file

    be, _ = start(tiny, lr=1e-2)
    batch = tiny.tiny_batch(0)
    be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    be.save_adapters(str(tmp_path / "adapter"))
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    ad = dict(be.named_adapters())
    assert tensors.keys() == {f"base_model.model.{k}.weight" for k in ad}
    assert all(torch.equal(tensors[f"base_model.model.{k}.weight"], ad[k]) for k in ad)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16
    assert config["target_modules"] == TARGETS  # (peft loads it: test_peft_format.py)


def test_checkpoint_round_trip_is_exact(tiny) -> None:
    batch, batch2 = tiny.tiny_batch(0), tiny.tiny_batch(1)
    opts = dict(lr=1e-2, weight_decay=0.1, warmup_steps=2)
    be, _ = start(tiny, **opts)
    for _ in range(2):
        be.train_step(batch, tiny.tiny_advantages(batch), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    state = be.state_dict()
    # Only the adapters are saved: the frozen base is rebuilt from the model family.
    assert set(state["model"]) == {k for k, _ in be.named_adapters()}
    assert state["lora"] == be.adapter_config()
    fresh, _ = start(tiny, seed=7, **opts)  # other adapter initialisation
    assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(fresh.named_adapters(), be.named_adapters()))
    fresh.load_state_dict(state)
    assert fresh.steps == 2
    for (k, a), (_, b) in zip(fresh.named_adapters(), be.named_adapters()):
        assert torch.equal(a, b), k
    # The optimizer and the schedule continue exactly.
    m1 = be.train_step(batch2, tiny.tiny_advantages(batch2), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    m2 = fresh.train_step(batch2, tiny.tiny_advantages(batch2), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    assert {k: v for k, v in m1.items() if "per_s" not in k and "time" not in k} == \
           {k: v for k, v in m2.items() if "per_s" not in k and "time" not in k}
    for (k, a), (_, b) in zip(fresh.named_adapters(), be.named_adapters()):
        assert torch.equal(a, b), k


def test_checkpoint_of_another_lora_setup_is_refused(tiny) -> None:
    be, _ = start(tiny)
    full = tiny.make_backend()
    full.start(tiny.loaded(0), seed=0, total_steps=10, reference=False)
    with pytest.raises(ValueError, match=r"written by full fine-tuning \(lora_rank = 0\), but this backend runs LoRA"):
        be.load_state_dict(full.state_dict())
    other, _ = start(tiny, lora_rank=2)
    with pytest.raises(ValueError, match="lora_rank, lora_alpha and lora_targets must match"):
        be.load_state_dict(other.state_dict())


def test_default_targets_come_from_the_model_family(tiny) -> None:
    import skyrl_models.qwen as qwen

    family = qwen.make_family(qwen.QwenConfig(preset="tiny"))
    loaded = family.load(alphabet="0123456789", seed=0)
    assert tuple(loaded.lora_targets) == tuple(qwen.LORA_TARGETS)
    be = tiny.make_backend(lora_rank=2)
    be.start(loaded, seed=0, total_steps=2, reference=False)
    # Of the family's targets (which cover every Qwen architecture) those this model has.
    assert be.adapter_config()["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_moe_experts_are_not_linear_and_attention_gets_adapters(tiny) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         vocab_size=32, decoder_sparse_step=1)
    torch.manual_seed(0)
    loaded = LoadedModel(Qwen3MoeForCausalLM(cfg), None, [1], family="qwen", lora_targets=("q_proj", "v_proj"))
    be = tiny.make_backend(lora_rank=2)
    be.start(loaded, seed=0, total_steps=2, reference=False)
    assert [k for k, _ in be.named_adapters()] == [
        "model.layers.0.self_attn.q_proj.lora_A", "model.layers.0.self_attn.q_proj.lora_B",
        "model.layers.0.self_attn.v_proj.lora_A", "model.layers.0.self_attn.v_proj.lora_B",
    ]
    bad = tiny.make_backend(lora_rank=2, lora_targets=["q_proj", "experts"])
    with pytest.raises(UserError, match=r"\[backend\] lora_targets: LoRA adapts nn.Linear modules only; target 'experts' "
                                        r"names model.layers.0.mlp.experts \(Qwen3MoeExperts\)"):
        bad.start(LoadedModel(Qwen3MoeForCausalLM(cfg), None, [1]), seed=0, total_steps=2, reference=False)


def test_unknown_or_missing_targets_are_user_errors(tiny) -> None:
    be = tiny.make_backend(lora_rank=2, lora_targets=["q_proj", "qkv"])
    with pytest.raises(UserError, match=r"\[backend\] lora_targets: LoRA targets \['qkv'\] match no nn.Linear module"):
        be.start(tiny.loaded(0), seed=0, total_steps=2, reference=False)
    be = tiny.make_backend(lora_rank=2)  # the test model's family declares no targets
    with pytest.raises(UserError, match=r"lora_rank = 2 needs lora_targets: the model family 'test' declares none"):
        be.start(tiny.loaded(0), seed=0, total_steps=2, reference=False)


def test_lora_options_are_validated() -> None:
    from skyrl_host.config import Located, structure_table

    out = Located("job.toml", {})
    bad = {"lora_rank": -1, "lora_alpha": 0, "lora_dropout": 1.0}
    assert structure_table(TorchBackendConfig, bad, "backend", out) is None
    assert {p.key for p in out.problems} == {f"backend.{k}" for k in bad}

    for table, key in (({"lora_targets": ["q_proj"]}, "lora_targets"), ({"lora_dropout": 0.1}, "lora_dropout"),
                       ({"lora_rank": 4, "lora_targets": ["model.q_proj"]}, "lora_targets")):
        out = Located("job.toml", {})
        assert structure_table(TorchBackendConfig, table, "backend", out) is None
        assert [p.key for p in out.problems] == [f"backend.{key}"], table

    out = Located("job.toml", {})
    ok = structure_table(TorchBackendConfig, {"lora_rank": 8, "lora_targets": ["q_proj", "v_proj"]}, "backend", out)
    assert out.problems == [] and ok.lora_rank == 8 and ok.lora_alpha == 16.0 and ok.lora_targets == ["q_proj", "v_proj"]
    assert TorchBackendConfig().lora_rank == 0  # full fine-tuning by default


@pytest.mark.slow
def test_ddp_and_fsdp2_train_the_adapters_like_one_process(dp_worker, lora_dp_worker, tmp_path) -> None:
    """Two gloo processes (the data-parallel test's uneven shards, float64): the adapters,
    merged weights and metrics equal the one-process run, a checkpoint written under
    DDP/FSDP2 (rank 0's state) restores the adapters exactly, and the saved PEFT adapter
    holds the full adapters."""
    from safetensors.torch import load_file

    got = run_gloo_ranks(HERE / "lora_dp_worker.py", "train", 2, str(tmp_path), timeout=150)[0]

    be, want_metrics = dp_worker.trained(**lora_dp_worker.LORA)
    want_adapters, want_weights = dict(be.named_adapters()), dict(be.named_weights())
    for mode in ("ddp", "fsdp2"):
        run = got[mode]
        assert run["adapters"].keys() == want_adapters.keys() and run["weights"].keys() == want_weights.keys()
        for name, a in want_adapters.items():
            torch.testing.assert_close(run["adapters"][name], a, atol=1e-12, rtol=0, msg=f"{mode} {name}")
            assert torch.equal(run["reloaded"][name], run["adapters"][name]), f"{mode} {name}"
        for name, w in want_weights.items():
            torch.testing.assert_close(run["weights"][name], w, atol=1e-12, rtol=0, msg=f"{mode} {name}")
        saved = load_file(str(tmp_path / mode / "adapter_model.safetensors"))
        assert saved.keys() == {f"base_model.model.{k}.weight" for k in want_adapters}
        for name, a in run["adapters"].items():  # float32, the full (gathered) tensors
            assert torch.equal(saved[f"base_model.model.{name}.weight"], a.float()), f"{mode} {name}"
        config = json.loads((tmp_path / mode / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["target_modules"] == lora_dp_worker.LORA["lora_targets"]
        for m, ref in zip(run["metrics"], want_metrics):
            for key in ("loss", "grad_norm", "kl", "entropy", "ratio_mean"):
                assert m[key] == pytest.approx(ref[key], rel=1e-10, abs=1e-12), (mode, key)

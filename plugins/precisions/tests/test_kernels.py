"""``[precision] kernels``: torchao's real low-precision matmuls in the trainer.

Rowwise FP8 runs on the CPU (torch's ``_scaled_mm`` has a CPU kernel), so here it is
tested for real: the layers it swaps, names and state dict unchanged, training, the wire
format and an engine fed through it. Blockwise FP8 (Hopper) and MXFP8 (Blackwell) need
their GPUs: here their refusals, and MXFP8's module on torchao's emulated kernels."""

from __future__ import annotations

import copy

import pytest
import torch

from skyrl_host.errors import UserError
from skyrl_precisions import _fakequant, _kernels
from skyrl_precisions._formats import FORMATS
from skyrl_precisions._precision import unpack_named

IDS = torch.tensor([[1, 5, 3, 2, 7, 4, 6, 2], [3, 3, 8, 1, 0, 9, 2, 4]])


@pytest.fixture(scope="module")
def host():
    from skyrl_host.plugins import build_host

    torch.set_num_threads(1)
    return build_host()


def tiny(host, preset: str = "tiny-moe"):
    reg = host.registry.get("models", "qwen")
    loaded = reg.create(reg.config(preset=preset)).load(alphabet="0123456789+=", seed=0)
    loaded.model.float().train()
    return loaded


def precision(host, name: str = "fp8", **options):
    reg = host.registry.get("precisions", name)
    return reg.create(reg.config(**options))


def rowwise(host, kernels: str = "torchao"):
    return precision(host, "fp8", scaling="rowwise", kernels=kernels)


def test_emulated_rowwise_linear_equals_torchaos_float8linear_on_cpu(host) -> None:
    """The same Linear, the same input: our fake-quantized rowwise forward against
    torchao's ``Float8Linear`` (rowwise recipe, real ``_scaled_mm`` on the CPU). torchao
    rounds the product to bfloat16 (``_scaled_mm`` gives no float32 output with rowwise
    scales), so its output is ours rounded to bfloat16: measured equal for every element
    (max relative gap to our float32 output 3.9e-3, under bfloat16's 2^-8 rounding bound);
    asserted: within one bfloat16 ulp (2^-7 relative) of ours rounded, >= 99.9% equal to
    it, and within 2^-7 of ours. Gradients (torchao quantizes them, we pass them straight
    through in float32): weight gradients 2.6e-2 apart (relative norm), asserted < 0.1."""
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    emulated = torch.nn.Sequential(torch.nn.Linear(256, 192, bias=False))
    real = copy.deepcopy(emulated)
    rowwise(host, "emulated").prepare_model(emulated)
    p = rowwise(host)
    p.prepare_model(real)
    assert p.kernels == "torchao" and type(real[0]) is Float8Linear
    x = torch.randn(3, 40, 256) * 3
    x[0, 0] *= 1e3  # one loud token: its own scale, nobody else's
    want, got = emulated(x.clone().requires_grad_()), real(x.clone().requires_grad_())
    rounded = want.detach().bfloat16().float()
    gap = (got - want).detach().abs() / want.detach().abs()
    assert float(((got.detach() - rounded).abs() / rounded.abs()).max()) <= 2 ** -7
    assert float((got.detach() == rounded).float().mean()) >= 0.999
    assert float(gap.max()) <= 2 ** -7 and float(gap.max()) > 0  # bf16 rounding, not a different quantization
    # The backward: straight-through float32 gradients against torchao's FP8 gradient matmuls.
    want.square().mean().backward()
    got.square().mean().backward()
    g_want, g_got = emulated[0].weight.grad, real[0].weight.grad
    assert 0 < float((g_got - g_want).norm() / g_want.norm()) < 0.1


def test_torchao_rowwise_swaps_exactly_the_chosen_linears_and_keeps_names_and_state(host) -> None:
    from torchao.float8.float8_linear import Float8Linear

    loaded = tiny(host)
    model = loaded.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    p = precision(host, "fp8", scaling="rowwise", kernels="torchao", keep=["o_proj"])
    names = p.prepare_model(model, keep=loaded.precision_keep)
    assert p.kernels == "torchao"
    swapped = set(_kernels.swapped(model))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert swapped == {f"model.layers.{i}.self_attn.{x}_proj" for i in (0, 1) for x in "qkv"}
    assert all(type(model.get_submodule(n)) is Float8Linear for n in swapped)
    # not swapped: the kept o_proj and the head (the routers and the experts are no Linear here)
    assert linears - swapped == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "lm_head"}
    assert type(model.get_submodule("model.layers.0.mlp.gate")).__name__ == "Qwen3MoeTopKRouter"
    chosen = _fakequant.chosen(model, FORMATS["fp8_rowwise"], loaded.precision_keep + ("o_proj",))
    hooked = {path for path, _ in chosen} - swapped
    assert hooked == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert all(any(isinstance(getattr(h, "__self__", None), _fakequant.FakeQuantHooks)
                   for h in model.get_submodule(path)._forward_pre_hooks.values()) for path in hooked)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("o_proj" in n for n in names)
    # the same parameter objects under the same names; the state dict unchanged
    assert all(a is b for (_, a), (_, b) in zip(params.items(), model.named_parameters(), strict=True))
    assert list(params) == [n for n, _ in model.named_parameters()]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_the_swap_keeps_hooks_and_extra_parameters_on_the_module(host) -> None:
    """LoRA puts parameters and a forward hook on the Linear itself: both survive."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    layer = model[0]
    layer.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(4, 64)))
    seen = []
    layer.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    rowwise(host).prepare_model(model)
    assert model[0] is layer and [n for n, _ in model.named_parameters()] == ["0.weight", "0.lora_A"]
    model(torch.randn(5, 64))
    assert seen == [torch.Size([5, 32])]


def test_a_few_torchao_training_steps_reduce_a_loss(host) -> None:
    loaded = tiny(host, "tiny")
    model = loaded.model
    p = rowwise(host)
    p.prepare_model(model, keep=loaded.precision_keep)
    assert len(_kernels.swapped(model)) == 14  # 7 Linear layers a block, 2 blocks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        logits = model(IDS).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        p.invalidate()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses  # measured 2.78 -> 1.13


def test_the_wire_is_rowwise_and_an_engine_copy_serves_the_trainers_numbers(host) -> None:
    """The sender packs ``fp8_rowwise``; an engine with a model of its own (torchao's
    modules taken off, weights through pack/unpack, activations fake-quantized) computes
    an emulated trainer's logits exactly (measured gap 0), and a torchao trainer's up to
    torchao's bfloat16 rounding of each swapped layer's output (measured max gap 2.0e-2 on
    logits up to 0.88: the rounding moves activations across e4m3 steps downstream). That
    rounding is the whole difference: the emulated model with its outputs rounded to
    bfloat16 at the same layers gives the torchao trainer's logits (measured gap 0)."""
    gaps = {}
    for kernels in ("torchao", "emulated"):
        loaded = tiny(host)
        model = loaded.model
        engine, rounded = copy.deepcopy(model), copy.deepcopy(model)
        p = rowwise(host, kernels)
        p.prepare_model(model, keep=loaded.precision_keep)
        named = list(p.pack(model.state_dict().items()))
        wire = dict(named)
        tags = [n for n in wire if "@" in n]
        assert len(tags) == len(p.quantized) and all(n.endswith("@fp8_rowwise") for n in tags)
        q = "model.layers.0.self_attn.q_proj.weight"
        assert wire[q].dtype == torch.float8_e4m3fn and wire[f"{q}@fp8_rowwise"].shape == (128,)
        # what an engine copying the trained model holds, before its first weights arrive
        served = copy.deepcopy(model)
        served.load_state_dict(engine.state_dict())
        rowwise(host, kernels).prepare_model(served, keep=loaded.precision_keep, train=False, source=model)
        assert not _kernels.swapped(served)
        assert all(type(m) is torch.nn.Linear for n, m in served.named_modules() if n.endswith("q_proj"))
        params = dict(served.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, t in unpack_named(named, torch.float32):
                params[name].copy_(t)
            trainer = model(IDS).logits
            gaps[kernels] = float((served(IDS).logits - trainer).abs().max())
        if kernels == "torchao":
            rowwise(host, "emulated").prepare_model(rounded, keep=loaded.precision_keep)
            for path in _kernels.swapped(model):
                rounded.get_submodule(path).register_forward_hook(lambda m, a, out: out.bfloat16().float())
            with torch.no_grad():
                assert float((rounded(IDS).logits - trainer).abs().max()) < 1e-5
    assert gaps["emulated"] < 1e-5, gaps
    assert 1e-4 < gaps["torchao"] < 0.05, gaps


def test_an_engine_sharing_the_trainers_tensors_runs_its_kernels_too(host) -> None:
    """An engine tree of its own over the trainer's very tensors (as with LoRA, whose
    trainer keeps a tree of its own): it gets torchao's modules too, and computes
    exactly the trainer's logits."""
    loaded = tiny(host)
    model = loaded.model
    engine = copy.deepcopy(model, {id(t): t for t in list(model.parameters()) + list(model.buffers())})
    p = rowwise(host)
    p.prepare_model(model, keep=loaded.precision_keep)
    p.prepare_model(engine, keep=loaded.precision_keep, train=False)
    assert _kernels.swapped(engine) == _kernels.swapped(model) != []
    with torch.no_grad():
        assert torch.equal(engine.eval()(IDS).logits, model.eval()(IDS).logits)


def test_auto_is_emulated_on_the_cpu(host) -> None:
    for options in ({}, {"scaling": "rowwise"}):
        loaded = tiny(host, "tiny")
        p = precision(host, "fp8", **options)
        assert p.config.kernels == "auto" and p.kernels is None
        p.prepare_model(loaded.model, keep=loaded.precision_keep)
        assert p.kernels == "emulated" and not _kernels.swapped(loaded.model)


@pytest.mark.parametrize(("name", "options", "message"), [
    ("fp8", {}, r"\[precision\] kernels = \"torchao\": blockwise FP8 matmuls need a Hopper-class CUDA GPU \(SM90 or "
                r"newer\) and triton; the model is on cpu; kernels = \"emulated\" computes the same numerics without "
                r"them, and scaling = \"rowwise\" has torchao kernels on the CPU"),
    ("mxfp8", {}, r"\[precision\] kernels = \"torchao\": MXFP8 matmuls need a Blackwell GPU \(SM100\); the model is "
                  r"on cpu; kernels = \"emulated\" computes the same numerics without them"),
])
def test_torchao_where_it_cannot_run_is_a_user_error(host, name: str, options: dict, message: str) -> None:
    loaded = tiny(host, "tiny")
    p = precision(host, name, kernels="torchao", **options)
    with pytest.raises(UserError, match=message):
        p.prepare_model(loaded.model, keep=loaded.precision_keep)
    assert not _kernels.swapped(loaded.model)


def test_torchao_kernels_without_quantized_activations_is_refused_when_the_job_is_read(host) -> None:
    with pytest.raises(ValueError, match="kernels: \"torchao\" quantizes the layers' inputs too"):
        precision(host, "fp8", scaling="rowwise", kernels="torchao", activations=False)
    p = precision(host, "fp8", scaling="rowwise", activations=False)  # auto: weights-only stays emulated
    loaded = tiny(host, "tiny")
    p.prepare_model(loaded.model, keep=loaded.precision_keep)
    assert p.kernels == "emulated"


def test_mxfp8_module_computes_the_emulated_numbers_on_torchaos_emulated_kernels() -> None:
    """MXFP8's swapped module, run on torchao's emulated MX kernels (a CPU has no MXFP8
    matmul): its forward equals our fake-quantized mxfp8 forward exactly, and a token
    count that is no multiple of 32 trains (padded for torchao's weight-gradient cast)."""
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    layer = model[0]
    assert _kernels.swap(model, ["0"], "mxfp8") == ["0"] and model[0] is layer
    layer.kernel_preference = KernelPreference.EMULATED
    fmt = FORMATS["mxfp8"]
    x = torch.randn(7, 64, requires_grad=True)
    out = model(x)
    w = fmt.fake_weight(layer.weight.detach())
    want = torch.nn.functional.linear(fmt.fake_activation(x.detach()), w, layer.bias)
    assert torch.equal(out, want)
    out.square().mean().backward()
    assert layer.weight.grad.shape == (96, 64) and x.grad.shape == (7, 64) and torch.isfinite(layer.weight.grad).all()
    assert _kernels.restore(model) == 1 and type(layer) is torch.nn.Linear


def test_validate_names_the_kernels_problems(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    job = skyrl_tiny_rl_job(tmp_path, "weights_only",
                            precision={"name": "fp8", "kernels": "torchao", "activations": False})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "precision.kernels" in result.stderr and "set activations = true" in result.stderr
    job = skyrl_tiny_rl_job(tmp_path, "megatron", precision={"name": "fp8", "scaling": "rowwise", "kernels": "torchao"},
                            backend={"name": "megatron"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2
    assert "backend 'megatron' computes the precision with layers of its own" in result.stderr, result.stderr
    job = skyrl_tiny_rl_job(tmp_path, "ok", precision={"name": "fp8", "scaling": "rowwise", "kernels": "torchao"})
    assert skyrl_cli("validate", str(job.path)).exit_code == 0


def test_lora_on_torchaos_kernels_in_one_process(host) -> None:
    """The torch backend with LoRA on a rowwise-FP8 base through torchao: the trainer's
    own module tree gets torchao's modules (with LoRA's adapters and hook still on them),
    the engine sharing the frozen base gets them too (the caller's tree stays plain), the
    adapters train, and trainer and engine agree at every step (measured gap <= 4.8e-7)."""
    import numpy as np

    from skyrl_weightsync.inproc import Inproc

    def create(kind: str, name: str, **options):
        reg = host.registry.get(kind, name)
        return reg.create(reg.config(**options))

    loaded = create("models", "qwen", preset="tiny").load(alphabet="0123456789", seed=5)
    p = rowwise(host)
    backend = create("backends", "torch", lora_rank=4, lr=1e-2)
    backend.start(loaded, seed=0, total_steps=2, reference=False, precision=p)
    engine = create("engines", "embedded")
    engine.start(loaded, precision=p)
    assert len(_kernels.swapped(backend.module)) == len(_kernels.swapped(engine.model)) == 14
    assert not _kernels.swapped(loaded.model)
    sampler, algorithm, transport = create("samplers", "temperature"), create("algorithms", "grpo"), Inproc()
    for version in (1, 2):
        batch = engine.generate([[1, 2, 3, 4], [5, 6, 7, 8]], n=4, sampler=sampler, max_new_tokens=6, seed=version)
        adv = np.random.default_rng(version).standard_normal(batch.n_tokens).astype(np.float32)
        metrics = backend.train_step(batch, adv, algorithm, temperature=1.0, max_new_tokens=6)
        assert metrics["logprob_diff_max"] < 1e-5, metrics["logprob_diff_max"]
        transport.publish(backend, engine, version)
    assert any(float(t.abs().max()) > 0 for n, t in backend.named_adapters() if n.endswith("lora_B"))

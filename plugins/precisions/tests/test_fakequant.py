"""Fake quantization in the trainer: which layers, exact forward values, straight-through
gradients, master weights untouched, and the engine's side (payload + scales back to the
very weights the trainer computed with)."""

from __future__ import annotations

import copy

import pytest
import torch

from skyrl_precisions import _fakequant
from skyrl_precisions._formats import FORMATS
from skyrl_precisions._precision import Precision, unpack_named


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


def precision(host, name: str, **options):
    reg = host.registry.get("precisions", name)
    return reg.create(reg.config(**options))


def test_the_chosen_layers_skip_router_embeddings_norms_and_head(host) -> None:
    loaded = tiny(host)
    chosen = dict(_fakequant.chosen(loaded.model, FORMATS["fp8"], loaded.precision_keep))
    names = {f"{path}.{p}" for path, ps in chosen.items() for p in ps}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.down_proj" in names
    assert not any(".mlp.gate." in n or "embed" in n or "lm_head" in n or "norm" in n for n in names)


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "int4"])
def test_forward_uses_the_quantized_weights_and_gradients_pass_straight_through(host, name: str) -> None:
    loaded = tiny(host)
    model = loaded.model
    ids = torch.tensor([[1, 5, 3, 2, 7, 4, 6, 2]])
    # The reference: a copy whose chosen weights ARE the fake-quantized values (leaf tensors).
    ref = copy.deepcopy(model)
    p = precision(host, name, **({} if name == "int4" else {"activations": False}))
    names = p.prepare_model(model, keep=loaded.precision_keep)
    assert names == p.quantized and len(names) > 10
    fmt = FORMATS[name]
    with torch.no_grad():
        for n in names:
            ref.get_parameter(n).copy_(fmt.fake_weight(ref.get_parameter(n)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out, want = model(ids).logits, ref(ids).logits
    assert torch.equal(out, want)
    out.square().mean().backward()
    want.square().mean().backward()
    for n in names:  # straight-through: the master weight gets the quantized weight's gradient
        assert torch.equal(model.get_parameter(n).grad, ref.get_parameter(n).grad), n
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)  # masters untouched
    assert all(isinstance(prm, torch.nn.Parameter) for prm in model.parameters())


def test_activations_are_quantized_too_for_fp8(host) -> None:
    loaded = tiny(host)
    model = loaded.model
    ids = torch.tensor([[1, 5, 3, 2, 7, 4, 6, 2]])
    weights_only = copy.deepcopy(model)
    precision(host, "fp8").prepare_model(model, keep=loaded.precision_keep)
    precision(host, "fp8", activations=False).prepare_model(weights_only, keep=loaded.precision_keep)
    gap = (model(ids).logits - weights_only(ids).logits).abs().max()
    assert 0 < gap < 0.1  # 1x128 tiles of e4m3: a small, nonzero change


def test_an_optimizer_step_requantizes(host) -> None:
    loaded = tiny(host, "tiny")
    model = loaded.model
    p = precision(host, "int4")
    p.prepare_model(model, keep=loaded.precision_keep)
    ids = torch.tensor([[1, 5, 3, 2, 7]])
    first = model(ids).logits
    first.square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    p.invalidate()
    second = model(ids).logits
    fresh = copy.deepcopy(model)
    _fakequant.remove(fresh)
    with torch.no_grad():
        for n in p.quantized:
            fresh.get_parameter(n).copy_(FORMATS["int4"].fake_weight(fresh.get_parameter(n)))
    assert not torch.equal(first, second) and torch.equal(second, fresh(ids).logits)


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "int4"])
def test_the_wire_carries_payload_and_scales_and_the_engine_gets_the_trainers_numbers(host, name: str) -> None:
    loaded = tiny(host)
    p = precision(host, name)
    p.prepare_model(loaded.model, keep=loaded.precision_keep)
    named = list(p.pack(loaded.model.state_dict().items()))
    tags = [n for n, _ in named if "@" in n]
    assert len(tags) == len(p.quantized) and all(n.endswith(f"@{name}") for n in tags)
    wire = dict(named)
    payload = wire[p.quantized[0]]
    assert payload.dtype == {"fp8": torch.float8_e4m3fn, "mxfp8": torch.float8_e4m3fn, "int4": torch.uint8}[name]
    back = dict(unpack_named(named, torch.float32))
    assert back.keys() == loaded.model.state_dict().keys()
    for n in p.quantized:
        assert torch.equal(back[n], FORMATS[name].fake_weight(loaded.model.get_parameter(n).detach())), n
    # A payload whose scales went missing is refused, naming the weight (for int4 the
    # engine refuses the packed shape).
    if name != "int4":
        broken = [(n, t) for n, t in named if n != f"{p.quantized[0]}@{name}"]
        with pytest.raises(ValueError, match=f"weight '{p.quantized[0]}': a quantized payload arrived without its scales"):
            dict(unpack_named(broken, torch.float32))
    with pytest.raises(ValueError, match="unknown quantized format 'fp4'"):
        dict(unpack_named([("w", torch.zeros(2)), ("w@fp4", torch.ones(1))], torch.float32))


def test_engine_copy_serves_quantized_weights_and_drops_the_trainers_hooks(host) -> None:
    loaded = tiny(host)
    p = precision(host, "fp8")
    p.prepare_model(loaded.model, keep=loaded.precision_keep)
    engine_model = copy.deepcopy(loaded.model).to(torch.bfloat16)
    names = Precision("fp8", p.config).prepare_model(engine_model, keep=loaded.precision_keep, train=False,
                                                     source=loaded.model)
    assert names == p.quantized
    for n in names:
        want = FORMATS["fp8"].fake_weight(loaded.model.get_parameter(n).detach()).to(torch.bfloat16)
        assert torch.equal(engine_model.get_parameter(n), want), n
    hooks = [h for m in engine_model.modules() for h in m._forward_pre_hooks.values()]
    assert all(not h.__self__.weights for h in hooks)  # serving hooks: activations only

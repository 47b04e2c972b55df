"""bf16 compute through weight copies (``compute_weights = "copy"``, the default under
``compute_dtype = "bfloat16"``): one bf16 cast of the weights per optimizer update, float32
masters, gradients and AdamW around it, nothing of the copy seen outside the update."""

from __future__ import annotations

import pytest
import torch


def start(tiny, seed=0, reference=False, **opts):
    be = tiny.make_backend(**opts)
    be.start(tiny.loaded(seed), seed=seed, total_steps=10, reference=reference)
    return be


def grads_seen_by_the_optimizer(be):
    seen: dict[str, torch.Tensor] = {}

    def hook(_opt, _args, _kwargs):
        seen.update({n: (p.grad.dtype, p.dtype, p.grad.detach().clone()) for n, p in be.module.named_parameters()
                     if p.grad is not None})

    be.optimizer.register_step_pre_hook(hook)
    return seen


def test_the_update_computes_in_bf16_and_the_optimizer_sees_float32(tiny) -> None:
    batch, adv = tiny.tiny_batch(3, n=6), None
    adv = tiny.tiny_advantages(batch)
    be = start(tiny, compute_dtype="bfloat16", lr=1e-2)
    assert be._compute_copy is not None
    before = {n: p.detach().clone() for n, p in be.module.named_parameters()}
    dtypes_in_forward: set[torch.dtype] = set()
    handle = be.module.get_input_embeddings().register_forward_hook(
        lambda m, a, out: dtypes_in_forward.add(m.weight.dtype))
    seen = grads_seen_by_the_optimizer(be)
    algo = tiny.TokenMean()
    m = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    handle.remove()
    assert dtypes_in_forward == {torch.bfloat16}  # the forward ran on the copy
    assert seen and all(g == torch.float32 and p == torch.float32 for g, p, _ in seen.values())
    after = dict(be.module.named_parameters())
    assert all(p.dtype == torch.float32 and p.grad is None for p in after.values())  # masters back, grads freed
    assert max(float((after[n].detach() - before[n]).abs().max()) for n in before) > 1e-4  # the update happened
    assert algo.calls[0].logprobs.dtype == torch.float32 and torch.isfinite(torch.tensor(m["loss"]))


def test_micro_batches_accumulate_in_float32_and_copy_stays_near_autocast(tiny) -> None:
    """Split into micro-batches or not, the summed gradient is the same (up to bf16 noise of
    each forward), and the copy's gradients are near autocast's."""
    batch = tiny.tiny_batch(4, n=8)
    adv = tiny.tiny_advantages(batch)
    runs = {}
    for name, opts in (("copy-1", dict(micro_batch_tokens=4096)), ("copy-4", dict(micro_batch_tokens=24)),
                       ("autocast", dict(micro_batch_tokens=4096, compute_weights="autocast")),
                       ("fp32", dict(micro_batch_tokens=4096, compute_dtype="float32"))):
        be = start(tiny, **{"compute_dtype": "bfloat16", **opts})
        seen = grads_seen_by_the_optimizer(be)
        m = be.train_step(batch, adv, tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
        runs[name] = ({n: g for n, (_, _, g) in seen.items()}, m)
    assert runs["autocast"][0] and runs["copy-1"][0].keys() == runs["fp32"][0].keys()
    flat = {k: torch.cat([g.flatten() for g in v[0].values()]) for k, v in runs.items()}

    def rel(a, b):
        return float((flat[a] - flat[b]).norm() / flat[b].norm())

    assert rel("copy-4", "copy-1") < 0.03
    assert rel("copy-1", "fp32") < 0.08 and rel("autocast", "fp32") < 0.08
    assert runs["copy-1"][1]["grad_norm"] == pytest.approx(runs["fp32"][1]["grad_norm"], rel=0.05)


def test_a_failure_inside_the_update_leaves_the_float32_masters_untouched(tiny) -> None:
    batch = tiny.tiny_batch(5, n=6)
    adv = tiny.tiny_advantages(batch)
    be = start(tiny, compute_dtype="bfloat16", micro_batch_tokens=16)
    before = {n: p.detach().clone() for n, p in be.module.named_parameters()}

    class FailsOnTheSecond(tiny.TokenMean):
        def loss(self, inputs):
            if len(self.calls) == 1:
                raise RuntimeError("the algorithm failed")
            return super().loss(inputs)

    with pytest.raises(RuntimeError, match="the algorithm failed"):
        be.train_step(batch, adv, FailsOnTheSecond(), temperature=1.0, max_new_tokens=8)
    for n, p in be.module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[n]), n
    be.train_step(batch, adv, tiny.TokenMean(), temperature=1.0, max_new_tokens=8)  # and it trains on afterwards


def test_copies_only_where_they_apply(tiny) -> None:
    assert start(tiny, compute_dtype="float32")._compute_copy is None
    assert start(tiny, compute_dtype="bfloat16", compute_weights="autocast")._compute_copy is None
    be = start(tiny, compute_dtype="bfloat16", reference=True)
    assert be._compute_copy is not None
    assert all(p.dtype == torch.bfloat16 for p in be.reference.parameters())  # frozen: cast once for good
    assert all(p.dtype == torch.float32 for p in be.module.parameters())

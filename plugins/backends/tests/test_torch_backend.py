"""The torch backend in one process: packing, micro-batching, schedules, clipping,
checkpointing, bf16, reference/KL, registration and light imports."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from skyrl_backends._optimizer import LrSchedule
from skyrl_backends._packing import layout_rows, pack_groups
from skyrl_backends.torch import TorchBackendConfig


def start(tiny, seed=0, reference=False, total_steps=10, model_kw=None, **opts):
    be = tiny.make_backend(**opts)
    be.start(tiny.loaded(seed, **(model_kw or {})), seed=seed, total_steps=total_steps, reference=reference)
    return be


def capture_grads(be):
    """Gradients as the optimizer sees them (after accumulation and clipping)."""
    grads: dict[str, torch.Tensor] = {}

    def hook(_opt, _args, _kwargs):
        grads.clear()
        grads.update({n: p.grad.detach().clone() for n, p in be.module.named_parameters() if p.grad is not None})

    be.optimizer.register_step_pre_hook(hook)
    return grads


def padded_reference(model, batch, adv, temperature):
    """Loss, per-token logprobs and gradients from a padded [B, L] batch with an
    attention mask and per-row positions: no packing at all."""
    lens = batch.seq_lens
    S, L = batch.n_sequences, int(lens.max())
    ids = torch.zeros(S, L, dtype=torch.long)
    att = torch.zeros(S, L, dtype=torch.long)
    for i in range(S):
        ids[i, : lens[i]] = torch.as_tensor(batch.sequence(i).astype(np.int64))
        att[i, : lens[i]] = 1
    pos = torch.arange(L)[None].expand(S, L)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lps, advs = [], []
    for i in range(S):
        start = int(batch.cu_seqlens[i])
        for t in range(1, int(lens[i])):
            if batch.loss_mask[start + t]:
                lps.append(logp[i, t - 1, ids[i, t]])
                advs.append(float(adv[start + t]))
    lp = torch.stack(lps)
    a = torch.tensor(advs)
    loss = -(a * torch.exp(lp - lp.detach())).sum() / len(lps)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), lp.detach(), grads


# -- (1) packing ---------------------------------------------------------------


# (pack_length, batch): one row of every sequence; several rows with whole sequences
# (lengths 7 4 | 10 6 | 9 | 16 | 20 | 18 | 7 | 19 for pack_length 16: rows of two
# sequences, sequences longer than pack_length in rows of their own, R = 20, pad tails).
PACKINGS = {"one_row": (4096, dict(seed=0, n=6)), "rows": (16, dict(seed=1, n=10, response=(1, 16)))}


def packed_rows(be, batch, adv):
    """The micro-batches' (ids, pos) the backend builds for ``batch``."""
    return [(mb.ids, mb.pos) for micros in be._plan(batch, adv) for mb in micros]


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_micro_batch_equals_padded_batch(tiny, attn, packing) -> None:
    pack_length, spec = PACKINGS[packing]
    spec = dict(spec)
    batch = tiny.tiny_batch(spec.pop("seed"), **spec)
    adv = tiny.tiny_advantages(batch)
    temperature = 0.7
    ref_loss, ref_lp, ref_grads = padded_reference(tiny.tiny_model(0, attn=attn), batch, adv, temperature)

    be = start(tiny, micro_batch_tokens=4096, pack_length=pack_length, max_grad_norm=0.0, model_kw={"attn": attn})
    assert not be._lm.full_logits  # the output head runs on the loss positions only
    [(ids, pos)] = packed_rows(be, batch, adv)  # one micro-batch
    lens = batch.seq_lens
    if packing == "one_row":
        assert ids.shape == (1, batch.n_tokens)
    elif attn == "sdpa":  # a sequence longer than pack_length: one flat row, attention per sequence
        assert ids.shape == (1, batch.n_tokens) and lens.max() > pack_length
    else:
        assert ids.shape == (8, int(lens.max())) and lens.max() > pack_length  # a long sequence sets R
        assert ((pos[:, 1:] - pos[:, :-1]) != 1).sum(1).max() >= 2  # a row with two sequences and a pad tail
        assert ids.numel() > batch.n_tokens  # pad tails
    grads = capture_grads(be)
    algo = tiny.TokenMean()
    m = be.train_step(batch, adv, algo, temperature=temperature, max_new_tokens=8)

    assert len(algo.calls) == 1 and algo.calls[0].n_seqs == batch.n_sequences  # one micro-batch held every sequence
    torch.testing.assert_close(algo.calls[0].logprobs.detach(), ref_lp, atol=1e-5, rtol=0)
    assert m["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=0, msg=name)
    # The engine-vs-trainer diff metric is measured against the pre-update logprobs.
    engine = batch.logprobs[batch.loss_mask.astype(bool) & (batch.positions() > 0)]
    diffs = np.abs(engine - ref_lp.numpy())
    assert m["logprob_diff_mean"] == pytest.approx(diffs.mean(), abs=1e-5)
    assert m["logprob_diff_max"] == pytest.approx(diffs.max(), abs=1e-5)


def test_packing_without_restarted_positions_would_attend_across_sequences(tiny) -> None:
    """The control for the test above: the same row with positions 0..n-1 (one long
    sequence) gives other logprobs, so the packed result is not a coincidence."""
    batch = tiny.tiny_batch(0, n=3)
    model = tiny.tiny_model(0)
    ids = torch.as_tensor(batch.tokens.astype(np.int64))[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=torch.as_tensor(batch.positions())[None], use_cache=False).logits
        joined = model(input_ids=ids, position_ids=torch.arange(batch.n_tokens)[None], use_cache=False).logits
        cached = model(input_ids=ids, position_ids=torch.as_tensor(batch.positions())[None]).logits
    second = slice(int(batch.cu_seqlens[1]), None)
    assert (packed[0, second] - joined[0, second]).abs().max() > 1e-3
    # transformers only detects packing without a cache: the backend passes use_cache=False.
    assert (packed[0, second] - cached[0, second]).abs().max() > 1e-3


def test_layout_rows_places_whole_sequences_and_restarts_pad_positions() -> None:
    lens = np.array([3, 2, 6, 1, 2])
    where, pos, n_rows, R = layout_rows(lens, 5)
    assert (n_rows, R) == (3, 6)  # rows [3, 2] [6] [1, 2]: the 6-long sequence sets R
    assert where.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert pos.reshape(n_rows, R).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [0, 0, 1, 0, 1, 2]]
    where, pos, n_rows, R = layout_rows(lens, 100)
    assert (n_rows, R) == (1, 14) and where.tolist() == list(range(14))


def test_pack_groups_keeps_order_and_whole_sequences() -> None:
    lens = np.array([3, 4, 10, 2, 2, 7])
    assert pack_groups(lens, range(6), 8) == [[0, 1], [2], [3, 4], [5]]
    assert pack_groups(lens, range(6), 100) == [[0, 1, 2, 3, 4, 5]]
    assert pack_groups(lens, [3, 4], 1) == [[3], [4]]
    assert pack_groups(lens, [], 8) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pack_length_changes_speed_not_results(tiny, dtype) -> None:
    """The same micro-batch in one row or in rows of at most 32 tokens: the same
    logprobs, loss, metrics, gradients (1e-6 in float32) and update. (flat_rows = "long":
    the padded rows' layouts; "auto" on a CPU lays this batch out as one flat row.)"""
    batch = tiny.tiny_batch(3, n=24)
    adv = tiny.tiny_advantages(batch, seed=4)
    results = []
    for pack_length in (32, 4096):
        be = start(tiny, micro_batch_tokens=4096, pack_length=pack_length, flat_rows="long", model_kw={"dtype": dtype})
        [(ids, _)] = packed_rows(be, batch, adv)
        grads = capture_grads(be)
        algo = tiny.TokenMean(metrics=True)
        m = be.train_step(batch, adv, algo, temperature=0.8, max_new_tokens=8)
        results.append((ids.shape, algo.calls[0].logprobs.detach(), m, grads, tiny.params(be)))
    (shape_small, lp_small, m_small, g_small, p_small), (shape_big, lp_big, m_big, g_big, p_big) = results
    assert shape_small[0] >= 6 and shape_small[1] <= 32 and shape_big == (1, batch.n_tokens)
    torch.testing.assert_close(lp_small, lp_big, atol=1e-6, rtol=0)
    assert g_small.keys() == g_big.keys()
    for name in g_big:
        torch.testing.assert_close(g_small[name], g_big[name], atol=1e-6, rtol=0, msg=name)
    if dtype == torch.float64:
        for name in p_big:
            torch.testing.assert_close(p_small[name], p_big[name], atol=1e-10, rtol=0, msg=name)
    for key in ("loss", "entropy", "grad_norm", "logprob_diff_mean", "logprob_diff_max", "tokens", "loss_tokens"):
        assert m_small[key] == pytest.approx(m_big[key], abs=1e-6), key


def test_model_that_transforms_its_logits_gets_the_full_forward(tiny) -> None:
    """A model whose forward changes the output head's logits (here: times 2) is
    detected at start and trained through its own forward (all logits, indexed)."""
    batch = tiny.tiny_batch(0, n=6)
    adv = tiny.tiny_advantages(batch)
    out = {}
    for scaled in (False, True):
        loaded = tiny.loaded(0)
        model = loaded.model
        if scaled:
            forward = model.forward

            def doubled(*args, **kwargs):
                res = forward(*args, **kwargs)
                res.logits = res.logits * 2.0
                return res

            model.forward = doubled
        be = tiny.make_backend(pack_length=8)
        be.start(loaded, seed=0, total_steps=1, reference=False)
        assert be._lm.full_logits == scaled
        algo = tiny.TokenMean()
        be.train_step(batch, adv, algo, temperature=2.0 if scaled else 1.0, max_new_tokens=8)
        out[scaled] = algo.calls[0].logprobs.detach()
    # logits * 2 at temperature 2 is the plain model at temperature 1.
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=0)


# -- (2) micro-batch split invariance -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_micro_batch_split_gives_the_same_gradients_and_update(tiny, dtype) -> None:
    """Gradients agree to 1e-6 in float32. The updated parameters are compared in
    float64: Adam's first update is about lr * sign(grad), so float32 rounding noise
    in a near-zero gradient entry (~1e-9) can move a weight by up to 2 * lr."""
    batch = tiny.tiny_batch(2, n=8)
    adv = tiny.tiny_advantages(batch, seed=3)
    results = []
    for budget in (9, 4096):  # several micro-batches (some sequences longer than 9 go alone), one
        be = start(tiny, micro_batch_tokens=budget, model_kw={"dtype": dtype})
        grads = capture_grads(be)
        algo = tiny.TokenMean(metrics=True)
        m = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
        results.append((len(algo.calls), m, grads, tiny.params(be)))
    (n_small, m_small, g_small, p_small), (n_big, m_big, g_big, p_big) = results
    assert n_small >= 4 and n_big == 1
    for name in g_big:
        torch.testing.assert_close(g_small[name], g_big[name], atol=1e-6, rtol=0, msg=name)
    if dtype == torch.float64:
        for name in p_big:
            torch.testing.assert_close(p_small[name], p_big[name], atol=1e-10, rtol=0, msg=name)
    for key in ("loss", "entropy", "grad_norm", "logprob_diff_mean", "ratio_mean"):
        assert m_small[key] == pytest.approx(m_big[key], abs=1e-5), key
    assert m_small["ratio_mean"] == pytest.approx(1.0)  # one update: old logprobs are the current ones
    assert m_small["tokens"] == batch.n_tokens and m_small["sequences"] == batch.n_sequences


def test_mini_batches_take_old_logprobs_from_before_the_first_update(tiny) -> None:
    batch = tiny.tiny_batch(4, n=8)
    adv = tiny.tiny_advantages(batch)
    be = start(tiny, mini_batches=2, micro_batch_tokens=4096, lr=1e-2)
    algo = tiny.TokenMean()
    m = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    assert m["updates"] == 2 and len(algo.calls) == 2
    first, second = algo.calls
    assert torch.equal(first.logprobs.detach(), first.old_logprobs)  # ratio exactly 1 before any update
    assert (second.logprobs.detach() - second.old_logprobs).abs().max() > 1e-4  # one update later
    assert first.global_tokens + second.global_tokens == m["loss_tokens"]
    assert be.scheduler.last_epoch == 2


# -- (4) schedule and clipping ----------------------------------------------------


def test_warmup_then_constant_and_cosine(tiny) -> None:
    batch = tiny.tiny_batch(1, n=2)
    adv = tiny.tiny_advantages(batch)
    be = start(tiny, lr=1e-2, warmup_steps=3)
    lrs = [be.train_step(batch, adv, tiny.TokenMean(), temperature=1.0, max_new_tokens=8)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])

    sched = LrSchedule(warmup=1, total=5, kind="cosine", min_ratio=0.1)
    expected = [0.5] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)] + [0.1]
    assert [sched(u) for u in range(6)] == pytest.approx(expected)
    be = start(tiny, lr=1e-2, warmup_steps=1, schedule="cosine", min_lr_ratio=0.1, total_steps=5)
    lrs = [be.train_step(batch, adv, tiny.TokenMean(), temperature=1.0, max_new_tokens=8)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([1e-2 * f for f in expected[:5]])


def test_grad_clipping_caps_the_norm(tiny) -> None:
    batch = tiny.tiny_batch(1, n=4)
    adv = tiny.tiny_advantages(batch)
    norms = {}
    for cap in (0.0, 1e-3):
        be = start(tiny, max_grad_norm=cap)
        grads = capture_grads(be)
        m = be.train_step(batch, adv, tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
        norms[cap] = (m["grad_norm"], float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))))
    raw, seen = norms[0.0]
    assert seen == pytest.approx(raw, rel=1e-5) and raw > 1e-2
    raw_c, seen_c = norms[1e-3]
    assert raw_c == pytest.approx(raw, rel=1e-5)  # the metric is the norm before clipping
    assert seen_c == pytest.approx(1e-3, rel=1e-3)


# -- (5) gradient checkpointing, (6) bf16 -----------------------------------------------


@pytest.mark.parametrize("pack_length", [256, 12])
def test_gradient_checkpointing_gives_the_same_gradients(tiny, pack_length) -> None:
    batch = tiny.tiny_batch(5, n=6)
    adv = tiny.tiny_advantages(batch)
    out = []
    for gc in (False, True):
        be = start(tiny, gradient_checkpointing=gc, micro_batch_tokens=20, pack_length=pack_length)
        grads = capture_grads(be)
        be.train_step(batch, adv, tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
        out.append(grads)
    for name in out[0]:
        torch.testing.assert_close(out[1][name], out[0][name], atol=1e-6, rtol=0, msg=name)


def test_bfloat16_compute_runs_and_is_close(tiny) -> None:
    batch = tiny.tiny_batch(6, n=6)
    adv = tiny.tiny_advantages(batch)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        be = start(tiny, compute_dtype=dtype, model_kw={"dtype": torch.bfloat16} if dtype == "bfloat16" else None)
        algo = tiny.TokenMean()
        m = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
        assert all(p.dtype == torch.float32 for p in be.module.parameters())  # fp32 master weights
        runs[dtype] = (m, algo.calls[0].logprobs.detach(), tiny.params(be))
    (m32, lp32, p32), (m16, lp16, p16) = runs["float32"], runs["bfloat16"]
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, lp32, atol=5e-2, rtol=0)
    assert m16["loss"] == pytest.approx(m32["loss"], abs=2e-2)
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.1)
    assert all(torch.isfinite(v).all() for v in p16.values())


# -- (7) checkpoints -------------------------------------------------------------------


def test_state_dict_round_trip_continues_bit_identically(tiny) -> None:
    batches = [tiny.tiny_batch(s, n=4) for s in (10, 11, 12)]
    advs = [tiny.tiny_advantages(b, seed=s) for s, b in enumerate(batches)]
    opts = dict(lr=1e-2, warmup_steps=2, schedule="cosine", weight_decay=0.1, micro_batch_tokens=16)
    a = start(tiny, total_steps=5, **opts)
    for b, v in zip(batches[:2], advs[:2]):
        a.train_step(b, v, tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert set(state) == {"format", "model", "optimizer", "scheduler", "steps"} and state["steps"] == 2

    b_ = start(tiny, seed=99, total_steps=5, **opts)  # other initial weights: the load must replace them
    b_.load_state_dict(state)
    assert b_.steps == 2
    ma = a.train_step(batches[2], advs[2], tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    mb = b_.train_step(batches[2], advs[2], tiny.TokenMean(), temperature=1.0, max_new_tokens=8)
    pa, pb = tiny.params(a), tiny.params(b_)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    for key in ("loss", "grad_norm", "lr"):
        assert ma[key] == mb[key], key


def test_named_weights_are_the_hugging_face_state(tiny) -> None:
    be = start(tiny)
    names = dict(be.named_weights())
    assert names.keys() == tiny.tiny_model(0).state_dict().keys()
    assert "lm_head.weight" in names and names["lm_head.weight"].data_ptr() == names["model.embed_tokens.weight"].data_ptr()


# -- (8) it learns, and the reference -----------------------------------------------------


def test_good_tokens_gain_probability(tiny) -> None:
    batch = tiny.tiny_batch(7, n=8)
    adv = np.where(np.repeat(np.arange(8) % 2 == 0, batch.seq_lens), 1.0, -1.0).astype(np.float32) * batch.loss_mask
    good = torch.as_tensor(adv[batch.loss_mask.astype(bool) & (batch.positions() > 0)] > 0)
    be = start(tiny, lr=3e-3)
    algo = tiny.TokenMean()
    for _ in range(6):
        be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    first, last = algo.calls[0].logprobs.detach(), algo.calls[-1].logprobs.detach()
    assert (last[good] - first[good]).mean() > 0.3
    assert (last[~good] - first[~good]).mean() < -0.3


def test_reference_logprobs_and_kl(tiny) -> None:
    batch = tiny.tiny_batch(8, n=4)
    adv = tiny.tiny_advantages(batch)
    be = start(tiny, reference=True, lr=1e-2)
    algo = tiny.TokenMean(needs_reference=True)
    m1 = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    assert torch.equal(algo.calls[0].ref_logprobs, algo.calls[0].logprobs.detach())
    assert m1["kl"] == 0.0
    m2 = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    assert m2["kl"] > 0.0
    assert all(not p.requires_grad for p in be.reference.parameters())

    no_ref = start(tiny, reference=False)
    with pytest.raises(RuntimeError, match="reference"):
        no_ref.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)


def test_metrics_and_empty_responses(tiny) -> None:
    batch = tiny.tiny_batch(9, n=4)
    batch.loss_mask[batch.cu_seqlens[1] : batch.cu_seqlens[2]] = 0  # one sequence does not train
    adv = tiny.tiny_advantages(batch) * batch.loss_mask
    be = start(tiny)
    algo = tiny.TokenMean()
    m = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    for key in ("loss", "entropy", "grad_norm", "lr", "logprob_diff_mean", "logprob_diff_max", "tokens_per_s",
                "tokens", "loss_tokens", "sequences"):
        assert key in m and math.isfinite(m[key]), key
    assert "kl" not in m
    assert algo.calls[0].n_seqs == 3 and algo.calls[0].global_seqs == 3  # only sequences with loss tokens
    assert set(algo.calls[0].seq_ids.tolist()) == {0, 1, 2}
    assert 0 < m["entropy"] <= math.log(32)

    batch.loss_mask[:] = 0  # nothing trains: no update at all
    before = tiny.params(be)
    m = be.train_step(batch, adv * 0, algo, temperature=1.0, max_new_tokens=8)
    assert m["updates"] == 0 and all(torch.equal(before[k], v) for k, v in tiny.params(be).items())


def test_data_parallel_needs_an_initialised_process_group(tiny) -> None:
    with pytest.raises(RuntimeError, match="torch.distributed"):
        start(tiny, data_parallel="ddp")


# -- registration, options, light import ------------------------------------------------


def test_registered_through_the_installed_entry_point(skyrl_host) -> None:
    import skyrl_backends.torch as module

    reg = skyrl_host.registry.get("backends", "torch")
    assert reg.factory is module.create and reg.config is TorchBackendConfig
    assert reg.origin.distribution == "skyrl-backends"
    assert skyrl_host.records["torch"].entry_point == "skyrl_backends.torch"


def test_options_are_validated() -> None:
    from skyrl_host.config import Located, structure_table  # the host's own validation, as in its tests

    out = Located("job.toml", {})
    assert structure_table(TorchBackendConfig, {"data_parallel": "fsdp", "lr": "high"}, "backend", out) is None
    assert {p.key for p in out.problems} == {"backend.data_parallel", "backend.lr"}
    assert "did you mean 'fsdp2'" in str(out.problems)

    out = Located("job.toml", {})
    bad = {"lr": 0, "betas": [0.9, 1.5], "micro_batch_tokens": 0, "max_grad_norm": -1, "warmup_steps": -1,
           "pack_length": 0}
    assert structure_table(TorchBackendConfig, bad, "backend", out) is None
    assert {p.key for p in out.problems} == {f"backend.{k}" for k in bad}

    out = Located("job.toml", {})
    assert structure_table(TorchBackendConfig, {"min_lr_ratio": 0.5}, "backend", out) is None
    assert [p.key for p in out.problems] == ["backend.min_lr_ratio"]  # needs schedule = "cosine"

    out = Located("job.toml", {})
    ok = structure_table(TorchBackendConfig, {"schedule": "cosine", "min_lr_ratio": 0.5, "betas": [0.9, 0.95]}, "backend", out)
    assert out.problems == [] and ok.betas == (0.9, 0.95) and ok.data_parallel == "none" and ok.pack_length == 256


def test_the_registered_module_does_not_import_torch() -> None:
    code = "import sys, skyrl_backends.torch; print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []

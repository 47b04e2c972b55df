"""Long sequences in one flat row with per-sequence attention (``_packing.layout_flat``,
``segment_sdpa``): the same numbers as padded rows, no padding, and only where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_backends._packing import layout_flat, segment_attention_supported


def test_layout_flat_groups_sequences_by_length_without_padding() -> None:
    lens = np.array([4, 2, 4, 3])
    where, pos, segments = layout_flat(lens)
    # Shortest first, ties in batch order: 2 | 3 | 4 4.
    assert segments.groups == [(0, 1, 2), (2, 1, 3), (5, 2, 4)]
    assert sorted(where.tolist()) == list(range(13))  # every slot holds one real token
    assert where[:4].tolist() == [5, 6, 7, 8] and where[4:6].tolist() == [0, 1] and where[6:10].tolist() == [9, 10, 11, 12]
    assert pos.tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3]


def _train(tiny, batch, adv, *, segments: bool, **opts):
    be = tiny.make_backend(micro_batch_tokens=4096, max_grad_norm=0.0, **opts)
    be.start(tiny.loaded(0), seed=0, total_steps=10, reference=False)
    be._segment_attention = segments and be._segment_attention
    plan = be._plan(batch, adv)
    grads: dict[str, torch.Tensor] = {}
    be.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.detach().clone() for n, p in be.module.named_parameters()}))
    algo = tiny.TokenMean()
    m = be.train_step(batch, adv, algo, temperature=0.7, max_new_tokens=8)
    return plan, torch.cat([c.logprobs.detach() for c in algo.calls]), m, grads


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_flat_row_gives_the_padded_rows_numbers(tiny, gradient_checkpointing) -> None:
    """Sequences of 3-24 tokens with pack_length 8: padded rows (R = the longest) vs one
    flat row with attention per sequence: the same logprobs, loss and gradients."""
    batch = tiny.tiny_batch(2, n=12, prompt=(2, 8), response=(1, 16))
    adv = tiny.tiny_advantages(batch)
    runs = [_train(tiny, batch, adv, segments=s, pack_length=8, gradient_checkpointing=gradient_checkpointing)
            for s in (False, True)]
    (rows_plan, rows_lp, rows_m, rows_g), (flat_plan, flat_lp, flat_m, flat_g) = runs
    [[rows_mb]], [[flat_mb]] = rows_plan, flat_plan
    assert rows_mb.ids.shape[0] > 1 and rows_mb.ids.numel() > batch.n_tokens  # rows padded to the longest
    assert flat_mb.ids.shape == (1, batch.n_tokens)  # no padding at all
    assert len(flat_mb.model_kwargs["skyrl_segments"].groups) > 1
    torch.testing.assert_close(flat_lp, rows_lp, atol=1e-5, rtol=0)
    assert flat_m["loss"] == pytest.approx(rows_m["loss"], abs=1e-6)
    assert flat_m["grad_norm"] == pytest.approx(rows_m["grad_norm"], rel=1e-5)
    for name, g in rows_g.items():
        torch.testing.assert_close(flat_g[name], g, atol=1e-5, rtol=0, msg=name)


def test_flat_rows_chooses_which_micro_batches_go_flat_and_eager_attention_keeps_padding(tiny) -> None:
    """``flat_rows``: 'long' keeps sequences that fit pack_length in shared rows (and
    lays out only a micro-batch with a longer one flat); 'always' and 'auto' on a CPU
    lay out every micro-batch flat; 'never' keeps rows even for a long sequence; a model
    without sdpa attention never gets flat rows."""
    batch = tiny.tiny_batch(3, n=10)  # lengths 3-14
    adv = tiny.tiny_advantages(batch)

    def plan(**opts):
        be = tiny.make_backend(**opts)
        be.start(tiny.loaded(0), seed=0, total_steps=10, reference=False)
        [[mb]] = be._plan(batch, adv)
        return be, mb

    be, mb = plan(pack_length=16, flat_rows="long")
    assert be._segment_attention and mb.model_kwargs == {} and mb.ids.shape[1] <= 16  # shared rows
    be, mb = plan(pack_length=4, flat_rows="long")
    assert mb.ids.shape == (1, batch.n_tokens) and "skyrl_segments" in mb.model_kwargs  # a sequence over 4: flat
    for mode in ("always", "auto"):  # the CPU: flat even though every sequence fits pack_length
        be, mb = plan(pack_length=16, flat_rows=mode)
        assert mb.ids.shape == (1, batch.n_tokens) and "skyrl_segments" in mb.model_kwargs, mode
    be, mb = plan(pack_length=4, flat_rows="never")
    assert not be._segment_attention and mb.model_kwargs == {} and mb.ids.numel() > batch.n_tokens  # padded rows
    assert not segment_attention_supported(tiny.tiny_model(0, attn="eager"), torch.device("cpu"))
    be = tiny.make_backend(pack_length=4, flat_rows="always")
    be.start(tiny.loaded(0, attn="eager"), seed=0, total_steps=10, reference=False)
    [[mb]] = be._plan(batch, adv)
    assert mb.model_kwargs == {} and mb.ids.shape[0] == batch.n_sequences

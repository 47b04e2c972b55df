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
    _same_training((flat_lp, flat_m, flat_g), (rows_lp, rows_m, rows_g))


def _same_training(got, want) -> None:
    """Logprobs, loss, gradient norm and every gradient equal to float32 rounding."""
    (got_lp, got_m, got_g), (want_lp, want_m, want_g) = got, want
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    assert got_m["loss"] == pytest.approx(want_m["loss"], abs=1e-6)
    assert got_m["grad_norm"] == pytest.approx(want_m["grad_norm"], rel=1e-5)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, atol=1e-5, rtol=0, msg=name)


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


def test_layout_flat_puts_a_shared_prompt_once_before_its_samples() -> None:
    # Sequences 1, 2, 3 share a 3-token prompt (lengths 5, 4, 6); 0 and 4 go alone.
    lens = np.array([2, 5, 4, 6, 3])
    where, pos, segments = layout_flat(lens, [([1, 2, 3], 3)])
    assert segments.groups == [(0, 1, 2), (2, 1, 3)]
    assert segments.trees == [(5, 3, (2, 1, 3))]  # the prompt once, then 2 + 1 + 3 own tokens
    assert len(pos) == 2 + 3 + 3 + 2 + 1 + 3  # 14 slots for 20 tokens
    cu = np.concatenate([[0], np.cumsum(lens)])
    assert where[cu[1] : cu[2]].tolist() == [5, 6, 7, 8, 9]
    assert where[cu[2] : cu[3]].tolist() == [5, 6, 7, 10]
    assert where[cu[3] : cu[4]].tolist() == [5, 6, 7, 11, 12, 13]
    assert pos.tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3, 4, 3, 3, 4, 5]
    [mask] = segments.tree_masks(torch.device("cpu"))
    assert mask.shape == (9, 9)
    assert mask[5].tolist() == [True] * 3 + [False] * 2 + [True] + [False] * 3  # sample 2's token: the prompt, itself
    assert mask[8].tolist() == [True] * 3 + [False] * 3 + [True] * 3  # sample 3's last: the prompt and its own 3
    assert mask[1].tolist() == [True] * 2 + [False] * 7  # the prompt is causal


def test_shared_prompts_are_runs_of_equal_prompts_without_loss_tokens() -> None:
    from skyrl_backends._packing import shared_prompts

    prompts = [[5, 6], [5, 6], [5, 6], [7, 6], [7, 6], [7, 6, 1], [9], [9]]
    answers = [[1, 2], [3], [4, 4], [2], [2, 3], [8], [], [1]]
    seqs = [p + a for p, a in zip(prompts, answers)]
    lens = np.array([len(s) for s in seqs])
    cu = np.concatenate([[0], np.cumsum(lens)])
    tokens = np.concatenate([np.array(s) for s in seqs])
    prompt_lens = np.array([len(p) for p in prompts])
    trains = np.concatenate([[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)]).astype(bool)
    # 0-2 share [5, 6]; 3-4 share [7, 6] (5's prompt is longer); 6 has no answer, so 7 shares with nobody.
    assert shared_prompts(tokens, cu, prompt_lens, trains, list(range(8))) == [([0, 1, 2], 2), ([3, 4], 2)]
    trains[cu[1]] = True  # a loss token inside sequence 1's prompt: it shares nothing
    assert shared_prompts(tokens, cu, prompt_lens, trains, list(range(8))) == [([3, 4], 2)]
    # Members are positions in the micro-batch's own list of sequences.
    assert shared_prompts(tokens, cu, prompt_lens, trains, [3, 4, 5]) == [([0, 1], 2)]


def _grouped_batch(groups: int, n: int, seed: int = 0, vocab: int = 32):
    """``groups`` prompts of 6-12 tokens, ``n`` answers of 1-12 tokens to each."""
    from skyrl_host.rollout import RolloutBatch

    rng = np.random.default_rng(seed)
    prompts, answers, lps = [], [], []
    for _ in range(groups):
        p = rng.integers(2, vocab, rng.integers(6, 13)).tolist()
        for _ in range(n):
            a = rng.integers(2, vocab, rng.integers(1, 13)).tolist()
            prompts.append(p)
            answers.append(a)
            lps.append((-3.4 + 0.05 * rng.standard_normal(len(a))).tolist())
    return RolloutBatch.from_sequences(prompts, answers, lps, group_ids=[i // n for i in range(groups * n)])


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_shared_prompts_give_the_unshared_numbers_on_fewer_tokens(tiny, gradient_checkpointing) -> None:
    """4 prompts x 4 answers in flat rows: each prompt computed once (its answers attend
    to it) gives the same logprobs, loss and gradients as every sequence on its own."""
    batch = _grouped_batch(4, 4)
    adv = tiny.tiny_advantages(batch)
    runs = [_train(tiny, batch, adv, segments=True, flat_rows="always", share_prompts=share,
                   gradient_checkpointing=gradient_checkpointing) for share in (False, True)]
    (alone_plan, alone_lp, alone_m, alone_g), (shared_plan, shared_lp, shared_m, shared_g) = runs
    [[alone_mb]], [[shared_mb]] = alone_plan, shared_plan
    prompt_tokens = int(batch.prompt_lens.sum())
    assert alone_mb.ids.shape == (1, batch.n_tokens)
    assert shared_mb.ids.shape == (1, batch.n_tokens - prompt_tokens * 3 // 4)  # each prompt once instead of 4 times
    assert len(shared_mb.model_kwargs["skyrl_segments"].trees) == 4
    assert shared_mb.n_loss == alone_mb.n_loss == int(batch.loss_mask.sum())
    _same_training((shared_lp, shared_m, shared_g), (alone_lp, alone_m, alone_g))


def test_replay_strategies_keep_prompts_unshared(tiny) -> None:
    be = tiny.make_backend(flat_rows="always")
    be.start(tiny.loaded(0), seed=0, total_steps=10, reference=False)
    assert be._share_prompts
    be.replay = [object()]  # a replay strategy reads per-token side channels slot by slot
    [[mb]] = be._plan(_grouped_batch(2, 3), tiny.tiny_advantages(_grouped_batch(2, 3)))
    assert mb.model_kwargs["skyrl_segments"].trees == [] and mb.ids.shape == (1, _grouped_batch(2, 3).n_tokens)


def test_the_micro_batch_budget_counts_a_shared_prompt_once() -> None:
    from skyrl_backends._packing import pack_groups

    lens = np.array([10, 10, 10, 10])
    saved = {1: 8, 2: 8}  # 1 and 2 share 8 prompt tokens with the sequence before them; 3 does not
    assert pack_groups(lens, range(4), 20) == [[0, 1], [2, 3]]
    assert pack_groups(lens, range(4), 20, saved) == [[0, 1, 2], [3]]  # 10 + 2 + 2
    # A sequence that starts a micro-batch pays its whole prompt: 1 does not fit beside 0
    # at budget 11, so it opens the next one with 10 tokens and 2 adds 2.
    assert pack_groups(lens, range(4), 11, saved) == [[0], [1], [2], [3]]
    assert pack_groups(lens, range(4), 12, saved) == [[0, 1], [2], [3]]

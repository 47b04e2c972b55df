"""RolloutBatch: packing, selection, concatenation, side channels, transport arrays."""

from __future__ import annotations

import numpy as np
import pytest

from skyrl_host.rollout import CSR, RolloutBatch


def batch3() -> RolloutBatch:
    b = RolloutBatch.from_sequences(
        prompts=[[5, 6], [7], [8, 9, 10]],
        responses=[[1, 2, 3], [4], [11, 12]],
        response_logprobs=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6]],
        group_ids=[0, 0, 1],
        versions=4,
        truncated=[False, True, False],
    )
    b.rewards = np.array([1.0, 0.0, 0.5], dtype=np.float32)
    # token-aligned: one row per token (12 tokens); CSR: one row per generated token (6)
    b.side_channels["routed"] = np.arange(12, dtype=np.uint8).reshape(12, 1)
    b.side_channels["support"] = CSR.from_rows([[1, 9], [2], [3, 7, 8], [4], [11], [12, 13]])
    b.validate()
    return b


def test_packing() -> None:
    b = batch3()
    assert b.tokens.tolist() == [5, 6, 1, 2, 3, 7, 4, 8, 9, 10, 11, 12]
    assert b.cu_seqlens.tolist() == [0, 5, 7, 12] and b.cu_seqlens.dtype == np.int64
    assert b.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1]
    assert b.response(2).tolist() == [11, 12] and b.prompt(0).tolist() == [5, 6]
    assert b.positions().tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4]
    assert b.seq_ids().tolist() == [0] * 5 + [1] * 2 + [2] * 5
    assert b.versions.tolist() == [4, 4, 4] and b.response_lens.tolist() == [3, 1, 2]


def test_validate_names_the_bad_array() -> None:
    b = batch3()
    b.side_channels["support"] = CSR.from_rows([[1]] * 5)
    with pytest.raises(ValueError, match="side channel 'support' has 5 rows, expected one per generated token \\(6\\)"):
        b.validate()


def test_select_keeps_side_channels_aligned() -> None:
    b = batch3()
    s = b.select([2, 0])
    s.validate()
    assert s.tokens.tolist() == [8, 9, 10, 11, 12, 5, 6, 1, 2, 3]
    assert s.rewards.tolist() == [0.5, 1.0] and s.group_ids.tolist() == [1, 0]
    assert s.side_channels["routed"][:, 0].tolist() == [7, 8, 9, 10, 11, 0, 1, 2, 3, 4]
    support = s.side_channels["support"]
    assert [support.row(i).tolist() for i in range(support.n_rows)] == [[11], [12, 13], [1, 9], [2], [3, 7, 8]]


def test_concat_and_transport_round_trip() -> None:
    b = batch3()
    both = RolloutBatch.concat([b.select([1]), b.select([0, 2])])
    both.validate()
    assert both.n_sequences == 3 and both.cu_seqlens.tolist() == [0, 2, 7, 12]
    support = both.side_channels["support"]
    assert [support.row(i).tolist() for i in range(support.n_rows)] == [[4], [1, 9], [2], [3, 7, 8], [11], [12, 13]]
    arrays = both.to_arrays()
    assert {"side.support.offsets", "side.support.values", "side.routed"} <= set(arrays)
    back = RolloutBatch.from_arrays(arrays)
    assert back.tokens.tolist() == both.tokens.tolist()
    assert back.side_channels["support"].values.tolist() == support.values.tolist()
    assert back.side_channels["routed"].tolist() == both.side_channels["routed"].tolist()


def test_csr_take_is_vectorised_and_exact() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, rng.integers(0, 6)).tolist() for _ in range(200)]
    csr = CSR.from_rows(rows)
    pick = rng.permutation(200)[:50]
    got = csr.take(pick)
    assert [got.row(i).tolist() for i in range(50)] == [rows[i] for i in pick]


def _conversations() -> RolloutBatch:
    batch = RolloutBatch.from_sequences(
        [[1, 2], [3]], [[4, 5, 6], [7, 8]], [[-0.1, -0.2, -0.3], [-0.4, -0.5]], group_ids=[0, 1]
    )
    batch.side_channels["routed_experts"] = np.arange(batch.n_tokens * 2, dtype=np.uint8).reshape(-1, 1, 2)
    batch.side_channels["sample_support"] = CSR.from_rows([[4, 9], [5], [6, 1, 2], [7], [8, 3]])
    return batch


def _segment() -> RolloutBatch:
    # Each sequence: the conversation's last token, the new turn's tokens, a response.
    seg = RolloutBatch.from_sequences([[6, 20, 21], [8, 22]], [[30, 31], [32]], [[-1.0, -1.1], [-1.2]], group_ids=[0, 1])
    seg.versions[:] = 3
    seg.side_channels["routed_experts"] = (100 + np.arange(seg.n_tokens * 2, dtype=np.uint8)).reshape(-1, 1, 2)
    seg.side_channels["sample_support"] = CSR.from_rows([[30, 5], [31], [32, 1]])
    return seg


def test_append_turn_joins_conversations_and_their_side_channels() -> None:
    conv, seg = _conversations(), _segment()
    out = conv.append_turn(seg)
    assert out.sequence(0).tolist() == [1, 2, 4, 5, 6, 20, 21, 30, 31]
    assert out.sequence(1).tolist() == [3, 7, 8, 22, 32]
    assert out.prompt_lens.tolist() == [2, 1]  # the original prompt; the turns are in loss_mask
    assert out.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1] + [0, 1, 1, 0, 1]
    np.testing.assert_allclose(out.logprobs[out.loss_mask == 1], [-0.1, -0.2, -0.3, -1.0, -1.1, -0.4, -0.5, -1.2])
    assert out.versions.tolist() == [0, 0] and np.isnan(out.rewards).all()
    routes = out.side_channels["routed_experts"].reshape(-1, 2)[:, 0].tolist()
    old, new = conv.side_channels["routed_experts"].reshape(-1, 2)[:, 0], seg.side_channels["routed_experts"].reshape(-1, 2)[:, 0]
    # Conversation 0: its first 4 rows, then the segment's 5 (its first row replaces the old last one).
    assert routes[:9] == old[:4].tolist() + new[:5].tolist()
    assert routes[9:] == old[5:7].tolist() + new[5:].tolist()
    support = out.side_channels["sample_support"]
    assert [support.row(i).tolist() for i in range(support.n_rows)] == [
        [4, 9], [5], [6, 1, 2], [30, 5], [31], [7], [8, 3], [32, 1]
    ]
    out.validate()


def test_append_turn_refuses_a_segment_of_other_conversations() -> None:
    conv, seg = _conversations(), _segment()
    with pytest.raises(ValueError, match="segment sequence 0 does not continue conversation 0"):
        conv.select([1, 0]).append_turn(seg)
    with pytest.raises(ValueError, match="the segment has 1 sequences, the conversations 2"):
        conv.append_turn(seg.select([0]))
    bare = _segment()
    del bare.side_channels["sample_support"]
    with pytest.raises(ValueError, match="side channels differ"):
        conv.append_turn(bare)

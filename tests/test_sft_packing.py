"""The sft job's data path: drawing pieces and packing them through the corpora's
``read_pieces_into`` (the CorpusPieces capability) gives exactly the pieces and the
batches of the previous path (documents copied from their views, piece by piece), on
mixed and shuffled corpora of two token dtypes, with and without a loss mask, with
long documents split or truncated, and a corpus without the capability in the mix."""

from __future__ import annotations

import numpy as np
import pytest

from skyrl_datasets.corpus import CorpusWriter
from skyrl_datasets.mix import Mix, MixConfig
from skyrl_datasets.pretokenized import PretokenizedReader
from skyrl_datasets.sequential import Sequential
from skyrl_datasets.shuffled import Shuffled
from skyrl_host.contracts import has
from skyrl_host.interfaces import CorpusPieces
from skyrl_host.jobs.sft import PackedSteps, pack_documents, pieces_of
from skyrl_host.rollout import RolloutBatch

MAX_SEQ_LEN = 64
BUDGET = 256


# -- the path before read_pieces_into, as it was (the reference) ---------------------------


def old_take_pieces(state, step):
    """The driver's take_pieces before the change: state = [strategy, corpora, pending, drawn]."""
    strategy, corpora, long_documents = state["strategy"], state["corpora"], state["long_documents"]
    taken, used, barren = [], 0, 0
    while True:
        if not state["pending"]:
            d, i = strategy.draw(step)
            state["drawn"][d] += 1
            length = int(corpora[d].lengths[i])
            state["pending"] = [[d, i, a, b] for a, b in pieces_of(length, MAX_SEQ_LEN, long_documents)]
            barren = 0 if state["pending"] else barren + 1
            assert barren <= sum(c.n_docs for c in corpora)
            continue
        n = state["pending"][0][3] - state["pending"][0][2]
        if used + n > BUDGET:
            return taken
        taken.append(state["pending"].pop(0))
        used += n
        if used == BUDGET:
            return taken


def old_pack_documents(corpora, pieces):
    """pack_documents before the change: every piece copied from the views."""
    lens = np.asarray([end - start for _, _, start, end in pieces], dtype=np.int64)
    cu = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    n = int(cu[-1])
    tokens = np.empty(n, dtype=np.int32)
    mask = np.ones(n, dtype=np.uint8)
    for k, (d, i, start, end) in enumerate(pieces):
        a, b = int(cu[k]), int(cu[k + 1])
        tokens[a:b] = corpora[d].tokens(i)[start:end]
        m = corpora[d].mask(i)
        if m is not None:
            mask[a:b] = m[start:end]
    s = len(pieces)
    return RolloutBatch(
        tokens=tokens, cu_seqlens=cu, prompt_lens=np.zeros(s, dtype=np.int32), logprobs=np.zeros(n, dtype=np.float32),
        loss_mask=mask, group_ids=np.arange(s, dtype=np.int64), versions=np.zeros(s, dtype=np.int64),
        truncated=np.zeros(s, dtype=bool), rewards=np.zeros(s, dtype=np.float32),
    )


# -- corpora -------------------------------------------------------------------------------


class ViewsOnly:
    """A third party's corpus that offers the Corpus Protocol but not CorpusPieces (here:
    the views of a real corpus)."""

    def __init__(self, corpus):
        self._c = corpus
        self.n_docs, self.lengths, self.meta = corpus.n_docs, corpus.lengths, corpus.meta

    def tokens(self, i):
        return self._c.tokens(i)

    def mask(self, i):
        return self._c.mask(i)

    def read_into(self, i, tokens_out, mask_out=None):
        return self._c.read_into(i, tokens_out, mask_out)

    def close(self):
        self._c.close()


def write(prefix, n_docs, vocab, seed, with_mask):
    rng = np.random.default_rng(seed)
    # mostly short documents, some longer than MAX_SEQ_LEN (split or truncated), a few of 0 or 1 token
    lengths = np.where(rng.random(n_docs) < 0.2, rng.integers(MAX_SEQ_LEN + 1, 4 * MAX_SEQ_LEN, n_docs),
                       rng.integers(0, 40, n_docs))
    with CorpusWriter(prefix, vocab_size=vocab, eos_id=1, tokenizer="test", with_mask=with_mask) as w:
        for n in lengths:
            ids = rng.integers(0, vocab, int(n))
            w.add(ids, rng.integers(0, 2, int(n)).astype(np.uint8) if with_mask else None)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    write(root / "masked16", 150, 1000, 1, True)  # uint16 ids, a loss mask
    write(root / "plain32", 90, 100_000, 2, False)  # int32 ids, no mask
    write(root / "third", 60, 500, 3, True)  # read through a corpus without the capability
    reader = PretokenizedReader()
    opened = [reader.open(str(root / name)) for name in ("masked16", "plain32", "third")]
    opened[2] = ViewsOnly(opened[2])
    yield opened
    for c in opened:
        c.close()


STRATEGIES = {
    "mix": lambda: Mix(MixConfig(weights=[0.5, 0.3, 0.2])),
    "shuffled": Shuffled,
    "sequential": Sequential,
}


@pytest.mark.parametrize("long_documents", ["split", "truncate"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_read_pieces_into_packs_exactly_what_the_views_did(corpora, strategy, long_documents) -> None:
    assert [has(c, CorpusPieces) for c in corpora] == [True, True, False]
    new = STRATEGIES[strategy]()
    new.bind([c.lengths for c in corpora], 7)
    old = STRATEGIES[strategy]()
    old.bind([c.lengths for c in corpora], 7)
    data = PackedSteps(corpora, new, tokens_per_step=BUDGET, max_seq_len=MAX_SEQ_LEN, long_documents=long_documents)
    state = {"strategy": old, "corpora": corpora, "long_documents": long_documents, "pending": [], "drawn": [0, 0, 0]}
    seen = {"datasets": set(), "cut": 0, "steps with two dtypes": 0}
    for step in range(1, 61):
        want_pieces = old_take_pieces(state, step)
        pieces, batch = data.next_batch(step)
        assert pieces == want_pieces, step
        assert data.pending == state["pending"] and data.drawn == state["drawn"]
        want = old_pack_documents(corpora, want_pieces)
        for field in ("tokens", "cu_seqlens", "loss_mask", "prompt_lens", "logprobs", "group_ids", "versions"):
            got, expected = getattr(batch, field), getattr(want, field)
            assert got.dtype == expected.dtype and np.array_equal(got, expected), (step, field)
        seen["datasets"] |= {p[0] for p in pieces}
        seen["cut"] += sum(p[2] > 0 or p[3] < int(corpora[p[0]].lengths[p[1]]) for p in pieces)
        seen["steps with two dtypes"] += {0, 1} <= {p[0] for p in pieces}
    # the run covered what it claims to: every corpus, cut documents, uint16 and int32 in one step
    assert seen["cut"] > 5
    if strategy != "sequential":
        assert seen["datasets"] == {0, 1, 2} and seen["steps with two dtypes"] > 5


def test_a_resumed_data_path_continues_exactly(corpora) -> None:
    def fresh():
        s = Mix(MixConfig(weights=[0.5, 0.3, 0.2]))
        s.bind([c.lengths for c in corpora], 3)
        return PackedSteps(corpora, s, tokens_per_step=BUDGET, max_seq_len=MAX_SEQ_LEN)

    whole = fresh()
    first = [whole.next_batch(step) for step in range(1, 21)]
    part = fresh()
    for step in range(1, 9):
        part.next_batch(step)
    resumed = fresh()
    resumed.load_state_dict(part.state_dict())
    for step in range(9, 21):
        pieces, batch = resumed.next_batch(step)
        assert pieces == first[step - 1][0]
        assert np.array_equal(batch.tokens, first[step - 1][1].tokens)
        assert np.array_equal(batch.loss_mask, first[step - 1][1].loss_mask)


def test_pack_documents_asks_for_the_capability_itself(corpora) -> None:
    pieces = [[0, 3, 0, int(corpora[0].lengths[3])], [2, 5, 0, int(corpora[2].lengths[5])], [1, 0, 0, 2]]
    pieces = [p for p in pieces if p[3] > 0]
    batch = pack_documents(corpora, pieces)
    assert np.array_equal(batch.tokens, old_pack_documents(corpora, pieces).tokens)
    assert np.array_equal(batch.loss_mask, old_pack_documents(corpora, pieces).loss_mask)

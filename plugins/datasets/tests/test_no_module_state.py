"""No module-global mutable state in the datasets, precisions and algorithms plugins:
the corpora's page budget lives in a ResidentBudget (one per reader, or per corpus),
the tokenizer of `skyrl data tokenize` in a ChunkTokenizer; module tables are read-only."""

from __future__ import annotations

import importlib
import multiprocessing
import pkgutil
import weakref

import numpy as np
import pytest

from skyrl_datasets import corpus as corpus_mod
from skyrl_datasets.corpus import CorpusWriter, ResidentBudget, open_corpus
from skyrl_datasets.pretokenized import PretokenizedReader

MUTABLE = (dict, list, set, bytearray, weakref.WeakSet, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)


def plugin_modules():
    for package in ("skyrl_datasets", "skyrl_precisions", "skyrl_algorithms"):
        pkg = importlib.import_module(package)
        yield pkg
        for info in pkgutil.iter_modules(pkg.__path__, package + "."):
            yield importlib.import_module(info.name)


def test_no_module_holds_a_mutable_container() -> None:
    found = [
        f"{m.__name__}.{name}: {type(value).__name__}"
        for m in plugin_modules()
        for name, value in vars(m).items()
        if not name.startswith("__") and type(value) in MUTABLE
    ]
    assert found == []
    with pytest.raises(TypeError):
        corpus_mod.MEGATRON_DTYPES[9] = np.uint32  # type: ignore[index]


def write(prefix, n=40) -> str:
    with CorpusWriter(str(prefix), vocab_size=50, eos_id=1, tokenizer="test") as w:
        for i in range(n):
            w.add(list(range(2, 10 + i % 7)) + [1])
    return str(prefix)


class Clock:
    """A stand-in for the process's file-backed resident bytes."""

    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


def released(corpus, calls):
    original = corpus.release_pages

    def spy():
        calls.append(corpus.location)
        original()

    corpus.release_pages = spy


def test_corpora_of_one_reader_release_their_pages_together(tmp_path, monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(corpus_mod, "_shared_resident_bytes", clock)
    reader = PretokenizedReader()
    a, b = reader.open(write(tmp_path / "a")), reader.open(write(tmp_path / "b"))
    alone = open_corpus(write(tmp_path / "c"))
    calls: list[str] = []
    for c in (a, b, alone):
        released(c, calls)
    assert a._budget is b._budget and alone._budget is not a._budget
    for i in range(corpus_mod.CHECK_EVERY):  # the first check sets the baseline
        a.tokens(i % a.n_docs)
    clock.value = a.max_resident_bytes + 1  # grown past the budget: reading a releases a and b
    for i in range(corpus_mod.CHECK_EVERY):
        a.tokens(i % a.n_docs)
    assert sorted(calls) == [str(tmp_path / "a"), str(tmp_path / "b")]
    b.close()
    assert len(a._budget) == 1  # a closed corpus leaves its budget
    a.close()
    alone.close()


def test_a_budget_opens_like_open_corpus(tmp_path) -> None:
    prefix = write(tmp_path / "c")
    budget = ResidentBudget()
    with budget.open(prefix, max_resident_bytes=None) as c, open_corpus(prefix) as d:
        assert (c.n_docs, c.max_resident_bytes, len(budget)) == (d.n_docs, None, 1)
        assert [c.tokens(i).tolist() for i in range(5)] == [d.tokens(i).tolist() for i in range(5)]
    assert len(budget) == 0


def test_tokenize_in_process_leaves_no_state_behind(tmp_path, tiny_tokenizer) -> None:
    from skyrl_datasets.pretokenize import Options, tokenize

    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"text": "hello {i}"}}\n' for i in range(20)))
    opts = Options(inputs=(str(src),), tokenizer=str(tiny_tokenizer), out=str(tmp_path / "c"))
    result = tokenize(opts, workers=1)
    assert result["n_docs"] == 20
    assert not hasattr(multiprocessing.current_process(), "chunk_tokenizer")
    assert open_corpus(str(tmp_path / "c")).n_docs == 20

"""``[corpus] reader = "pretokenized"`` (the sft job's default): opens corpora written by
``skyrl data tokenize`` or Megatron's .bin/.idx, from local prefixes or fsspec URLs
(remote ones read lazily through a local cache; see :mod:`skyrl_datasets.corpus`)."""

from __future__ import annotations

from typing import Any, Mapping

from skyrl_host import hookimpl


class PretokenizedReader:
    """The :class:`skyrl_host.interfaces.CorpusReader` over :func:`skyrl_datasets.corpus.open_corpus`.

    The corpora it opens share one :class:`skyrl_datasets.corpus.ResidentBudget` (made
    with the reader, living as long as it or they do): when the file-backed memory the
    job's reads mapped grows past the budget, all of them release their pages."""

    def __init__(self, config: Any = None):
        self.config = config
        self._budget: Any = None

    def open(self, path: str, *, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None) -> Any:
        from skyrl_datasets.corpus import ResidentBudget

        if self._budget is None:
            self._budget = ResidentBudget()
        return self._budget.open(path, storage_options=dict(storage_options) if storage_options else None, cache_dir=cache_dir)


@hookimpl
def skyrl_register_corpus_readers(register: Any) -> None:
    register(
        "pretokenized",
        PretokenizedReader,
        description="Pretokenized corpora (skyrl data tokenize, or Megatron .bin/.idx), local or at an fsspec URL",
    )

"""``[corpus] reader = "pretokenized"`` (the sft job's default): opens corpora written by
``skyrl data tokenize`` or Megatron's .bin/.idx, from local prefixes or fsspec URLs
(remote ones read lazily through a local cache; see :mod:`skyrl_datasets.corpus`)."""

from __future__ import annotations

from typing import Any, Mapping

from skyrl_host import hookimpl


class PretokenizedReader:
    """The :class:`skyrl_host.interfaces.CorpusReader` over :func:`skyrl_datasets.corpus.open_corpus`."""

    def __init__(self, config: Any = None):
        self.config = config

    def open(self, path: str, *, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None) -> Any:
        from skyrl_datasets.corpus import open_corpus

        return open_corpus(path, storage_options=dict(storage_options) if storage_options else None, cache_dir=cache_dir)


@hookimpl
def skyrl_register_corpus_readers(register: Any) -> None:
    register(
        "pretokenized",
        PretokenizedReader,
        description="Pretokenized corpora (skyrl data tokenize, or Megatron .bin/.idx), local or at an fsspec URL",
    )

"""Fixtures for the corpus and `skyrl data` tests. The tokenizer helpers live in
``_tokenizer.py``, loaded by path (the tests run with --import-mode=importlib) as the module
``skyrl_datasets_tests_tokenizer``, which test modules import by that name."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
KIT = "skyrl_datasets_tests_tokenizer"


def load_kit():
    if KIT not in sys.modules:
        spec = importlib.util.spec_from_file_location(KIT, HERE / "_tokenizer.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[KIT] = module
        spec.loader.exec_module(module)
    return sys.modules[KIT]


load_kit()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The folder of a tiny byte-level BPE tokenizer with a ChatML template."""
    return load_kit().build_tokenizer(tmp_path_factory.mktemp("tokenizer"))

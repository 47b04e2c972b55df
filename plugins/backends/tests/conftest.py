"""Fixtures for the torch backend tests: ``tiny`` is the helper module ``_tiny.py``
(loaded by path, so it is shared with the data-parallel worker script)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def load_tiny():
    name = "skyrl_backends_tests_tiny"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "_tiny.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def tiny():
    return load_tiny()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is as fast and does not fight other processes for the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

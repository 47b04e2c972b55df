"""Fixtures for the torch backend tests: ``tiny`` is the helper module ``_tiny.py`` and
``dp_worker`` / ``lora_dp_worker`` are the data-parallel tests' rank functions (each
loaded by path, so they are shared with the ranks that ``run_gloo_ranks`` starts)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def load(filename: str):
    """The module ``HERE/filename``, loaded once by path as ``skyrl_backends_tests_<stem>``."""
    name = "skyrl_backends_tests_" + pathlib.Path(filename).stem.lstrip("_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / filename)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def tiny():
    return load("_tiny.py")


@pytest.fixture(scope="session")
def dp_worker():
    return load("dp_worker.py")


@pytest.fixture(scope="session")
def lora_dp_worker():
    return load("lora_dp_worker.py")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is as fast and does not fight other processes for the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def mcore_worker():
    return load("mcore_worker.py")

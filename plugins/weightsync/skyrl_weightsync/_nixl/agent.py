"""NIXL itself, for the ``nixl`` transport: its Python API (imported on first use), agents
with one backend, the :class:`Poller` that drives a serving agent's progress, and
:class:`NixlError`. Imports neither torch nor NIXL at import time."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import uuid
from typing import Any


class NixlError(RuntimeError):
    """A sync or publish that failed; the engine keeps its last version."""


def nixl_api() -> Any:
    """NIXL's Python API module: ``nixl._api`` or, failing that, ``nixl_cu12._api`` (the wheel's name)."""
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nixl_cu12 import _api  # type: ignore[import-not-found]
        except ImportError:
            from skyrl_host.errors import UserError
            from skyrl_weightsync._nixl_hint import INSTALL_HINT

            raise UserError(f"the nixl transport needs NIXL, which is not installed: {INSTALL_HINT}") from None
    _quiet(logging.getLogger("nixl"))
    return _api


def _quiet(logger: logging.Logger) -> None:
    # NIXL logs every agent's creation at INFO on stdout; stdout belongs to the program
    # (the benchmarks print JSON there). NIXL_LOG_LEVEL still wins.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    for h in logger.handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


def make_agent(name: str, backend: str = "UCX", *, progress_thread: bool = False, polled: bool = False) -> Any:
    """A NIXL agent with one backend; ``polled``: a :class:`Poller` thread will call it too
    (then NIXL locks its state on every call)."""
    api = nixl_api()
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if polled else None
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend],
                                                       sync_mode=sync))
    if backend not in agent.backends:
        raise NixlError(f"NIXL backend {backend!r} is not available here (NIXL has: {agent.get_plugin_list()})")
    return agent


def agent_name(role: str) -> str:
    """A name no other agent has: the role, host, process and a random tag."""
    return f"skyrl-nixl-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def memory_of(t: Any) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor's memory."""
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)


class Poller(threading.Thread):
    """Drives a serving agent's progress every ``interval`` seconds. A peer's READ needs
    the serving side to answer now and then (connection set-up; on TCP every read is
    emulated with messages); NIXL's own progress thread does it by spinning, half a core
    even when idle, on every trainer rank.

    Its owner starts it and calls ``stop()`` when it closes. A started poller also stops
    at interpreter exit (an ``atexit`` hook it registers at ``start`` and removes at
    ``stop``): a daemon thread still inside NIXL when the interpreter finalizes would be
    unwound through C++ frames, and the process aborts ("terminate called ...")."""

    def __init__(self, agent: Any, interval: float = 1e-3):
        super().__init__(name=f"nixl-progress-{agent.name}", daemon=True)
        self.agent, self.interval, self.stopped = agent, interval, threading.Event()

    def start(self) -> None:
        atexit.register(self._halt)
        super().start()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.agent.get_new_notifs()  # progresses the backend's workers
            except Exception:  # noqa: BLE001 - an agent being torn down
                return

    def _halt(self) -> None:
        self.stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join()

    def stop(self) -> None:
        self._halt()
        atexit.unregister(self._halt)

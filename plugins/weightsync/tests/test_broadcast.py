"""broadcast between two processes over gloo: the engine process receives every version
byte-exact in reused buckets (one collective per bucket), and a trainer that dies
mid-version leaves the engine on its last complete version."""

from __future__ import annotations

import math
import os

import pytest

from skyrl_host.testing import run_gloo_ranks

WORKER = os.path.join(os.path.dirname(__file__), "broadcast_worker.py")


def run_pair(mode: str) -> tuple[dict, dict]:
    # With "die" the trainer rank exits mid-version: no barrier (the engine rank returns alone).
    sender, receiver = run_gloo_ranks(WORKER, "run", 2, mode, timeout=240, group_timeout=20, barrier=mode != "die")
    return sender, receiver


def test_versions_arrive_byte_exact_in_buckets() -> None:
    sender, receiver = run_pair("ok")
    for v in ("v1", "v2"):
        assert receiver[v]["equal"] and receiver[v]["version"] == int(v[1])
        total = sender[v]["sync_bytes"]
        assert sender[v]["sync_collectives"] == math.ceil(total / (4096 + 7))  # buckets, not one call per tensor


def test_a_trainer_dying_mid_version_leaves_the_engine_whole() -> None:
    sender, receiver = run_pair("die")
    assert sender is None  # the trainer died before returning
    assert isinstance(receiver["die"], dict), receiver["die"]
    assert receiver["die"]["version"] == 2 and receiver["die"]["still_v2"]


def test_broadcast_needs_engine_processes(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path = skyrl_tiny_rl_job(tmp_path, job={"steps": 1}, weight_sync={"transport": "broadcast"}).path
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    line = path.read_text().splitlines().index('transport = "broadcast"') + 1
    assert f"{path}:{line}: weight_sync.transport: transport 'broadcast' needs the engine in processes of its own" \
        in result.stderr


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

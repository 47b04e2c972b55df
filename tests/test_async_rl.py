"""``[job] mode = "async"``: the rollout thread runs ahead of the trainer by
``max_staleness`` weight versions; the schedule is fixed by the bound, so k = 0 is the
synchronous run, and a run resumed after kill -9 reproduces the uninterrupted one."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from skyrl_host.statefile import load_state
from skyrl_host.testing import learning_metrics, step_rows

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")
ASYNC_ONLY = ("staleness_mean", "staleness_max")


def write_job(make_job, tmp_path, name, steps=4, every=0, share=False, **job):
    made = make_job(tmp_path, name,
                    job={"steps": steps, "batch_size": 4, "checkpoint_every": every,
                         "output_dir": tmp_path / f"{name}_out", **job},
                    engine={"name": "embedded", "dtype": "auto", "share_weights": share},
                    backend={"lr": 1e-3, "micro_batch_tokens": 128})
    return made.path, made.out


def test_async_with_staleness_0_is_the_synchronous_run(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    sync_path, sync_out = write_job(skyrl_tiny_rl_job, tmp_path, "sync")
    async_path, async_out = write_job(skyrl_tiny_rl_job, tmp_path, "async0", mode="async", max_staleness=0)
    for path in (sync_path, async_path):
        result = skyrl_cli("run", str(path))
        assert result.exit_code == 0, result.stderr
    want = [learning_metrics(r) for r in step_rows(sync_out)]
    got = [{k: v for k, v in learning_metrics(r).items() if k not in ASYNC_ONLY} for r in step_rows(async_out)]
    assert got == want
    assert [r["staleness_max"] for r in step_rows(async_out)] == [0.0] * 4


def test_async_trains_each_step_on_weights_k_versions_old(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, out = write_job(skyrl_tiny_rl_job, tmp_path, "async2", steps=6, mode="async", max_staleness=2)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(out)
    # Step t is generated with version max(0, t - 1 - k), trained after version t - 1.
    assert [r["weight_version"] for r in rows] == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert all(r["staleness_mean"] == r["staleness_max"] for r in rows)
    for key in ("rollout_wait_time_s", "publish_wait_time_s", "engine_idle_fraction"):
        assert all(key in r for r in rows), key
    assert all(0.0 <= r["engine_idle_fraction"] <= 1.0 for r in rows)
    # The off-policy gap shows up where the trainer's weights moved past the engine's.
    assert rows[0]["logprob_diff_max"] < 1e-4 and rows[3]["logprob_diff_max"] > 1e-4


@pytest.mark.parametrize("background", ["off", "on"])
def test_async_delta_sends_and_fetches_while_generating(skyrl_cli, skyrl_tiny_rl_job, tmp_path, background) -> None:
    """With the delta transport the trainer writes version v (``background = "on"``: from
    a snapshot, in the sender's thread, while it trains on) and the receiver fetches and
    verifies it while the engine generates; the pause is the apply alone. Lossless
    float32 deltas: the same run as handing the tensors over in-process."""
    inproc_path, inproc_out = write_job(skyrl_tiny_rl_job, tmp_path, "inproc", steps=5, mode="async")
    delta_path, delta_out = write_job(skyrl_tiny_rl_job, tmp_path, "delta", steps=5, mode="async")
    delta_path.write_text(delta_path.read_text() + f"""
[weight_sync]
transport = "delta"
uri = "{(tmp_path / 'versions').as_uri()}"
dtype = "float32"
background = "{background}"
""")
    for path in (inproc_path, delta_path):
        result = skyrl_cli("run", str(path))
        assert result.exit_code == 0, result.stderr
    want = [learning_metrics(r) for r in step_rows(inproc_out)]
    rows = step_rows(delta_out)
    assert [learning_metrics(r) for r in rows] == want
    # The rollout thread applies version v (from what the prefetch fetched: no fetch inside
    # the pause) between two rollouts while the trainer trains on; row v + 1 reports it.
    # The last version is written, never applied (no rollout needs it).
    assert "sync_applied" not in rows[0] and [r["sync_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    if background == "on":  # the trainer was held for the snapshot; the writing is reported with the apply
        assert all(r["sync_snapshot_s"] > 0 for r in rows) and "sync_bytes" not in rows[0]
        assert all(r["sync_bytes"] > 0 for r in rows[1:])
    else:
        assert all(r["sync_bytes"] > 0 and "sync_snapshot_s" not in r for r in rows)
    for r in rows[1:]:
        assert r["sync_applied"] == 1.0 and "sync_fetch_s" not in r
        assert 0.0 < r["sync_pause_s"] and r["sync_apply_s"] <= r["sync_pause_s"]
    assert sorted(p.name for p in (tmp_path / "versions").iterdir())  # the versions were written there


def test_async_refuses_an_engine_sharing_the_trainers_tensors(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, out = write_job(skyrl_tiny_rl_job, tmp_path, "shared", share=True, mode="async")
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 2, result.stderr
    assert "share_weights = false" in result.stderr and "Traceback" not in result.stderr


def test_async_resume_after_kill_reproduces_the_uninterrupted_run(skyrl_tiny_rl_job, tmp_path) -> None:
    steps, k = 8, 2
    full_path, full_out = write_job(skyrl_tiny_rl_job, tmp_path, "full", steps=steps, every=2, mode="async",
                                    max_staleness=k)
    proc = subprocess.run([SKYRL, "run", str(full_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    expected = [learning_metrics(r, transport=True) for r in step_rows(full_out)]

    path, out = write_job(skyrl_tiny_rl_job, tmp_path, "killed", steps=steps, every=2, mode="async", max_staleness=k)
    killed = subprocess.Popen([SKYRL, "run", str(path)], cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = out / "checkpoints" / "step_000004"
    deadline = time.time() + 300
    while not ckpt.exists():
        assert killed.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    # The checkpoint holds the rollouts generated but not trained: steps 5 and 6 (made with
    # versions 2 and 3, which the resumed run cannot remake), perhaps 7 (version 4).
    saved = load_state(ckpt / "rollouts.safetensors")
    assert saved["steps"][:2] == [5, 6] and set(saved["steps"]) <= {5, 6, 7}
    resumed = subprocess.run([SKYRL, "run", str(path), "--resume"], capture_output=True, text=True, timeout=600,
                             cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr
    assert "(resumed after step 4)" in resumed.stderr
    got = [learning_metrics(r, transport=True) for r in step_rows(out)]
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # every step once: no prompt twice, none lost
    assert got == expected


def test_async_multi_turn_with_routes_and_support_replayed(skyrl_cli, tmp_path) -> None:
    """A multi-turn game on a MoE preset, async (k = 1), routes and support sets recorded
    per turn and replayed by the trainer: each step trains on its own version's
    trajectories (none spans two versions), and at equal weights (step 1) the trainer
    reproduces the engine's logprobs through r3 + support within 1e-5."""
    path = tmp_path / "job.toml"
    path.write_text(f"""
[job]
kind = "rl"
seed = 2
steps = 4
batch_size = 4
n_samples = 4
max_new_tokens = 2
max_turns = 3
max_total_tokens = 16
checkpoint_every = 0
save_final = false
threads = 1
mode = "async"
max_staleness = 1
output_dir = "{tmp_path / 'out'}"

[model]
family = "kimi"
preset = "tiny-kimi"

[dataset]
name = "guess_number"

[environment]
name = "guess_number"

[engine]
name = "embedded"
share_weights = false
return_routed_experts = true

[sampler]
name = "top_p"
top_p = 0.9
return_support = true

[replay]
strategies = ["r3", "support"]
""")
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(tmp_path / "out")
    assert [r["weight_version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["turns_mean"] > 1.0 for r in rows)
    assert rows[0]["logprob_diff_max"] <= 1e-5, rows[0]["logprob_diff_max"]


def test_async_lora_shares_the_frozen_base(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """A LoRA backend: the engine may serve the trainer's frozen base (nothing copied)
    and gets copies of the adapters; k = 0 equals the synchronous LoRA run."""
    def lora_job(name, **job):
        made = skyrl_tiny_rl_job(tmp_path, name,
                                 job={"steps": 4, "batch_size": 4, "output_dir": tmp_path / f"{name}_out", **job},
                                 backend={"lr": 1e-2, "micro_batch_tokens": 128, "lora_rank": 4, "lora_alpha": 8.0})
        return made.path, made.out

    sync_path, sync_out = lora_job("sync")
    async_path, async_out = lora_job("async", mode="async", max_staleness=0)
    for path in (sync_path, async_path):
        result = skyrl_cli("run", str(path))
        assert result.exit_code == 0, result.stderr
    want = [learning_metrics(r) for r in step_rows(sync_out)]
    got = [{k: v for k, v in learning_metrics(r).items() if k not in ASYNC_ONLY} for r in step_rows(async_out)]
    assert got == want
    assert step_rows(async_out)[0]["logprob_diff_max"] < 1e-4


def test_in_flight_and_aborting_updates_land_inside_generations(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """weight_updates = "in_flight": the trainer publishes at once and the engine switches
    weights between two decode steps; "abort": the requests in progress are resubmitted
    with what they generated, prefilled again with the new weights. Long generations
    against short train steps, so samples span two versions, and still none is more than
    k = 1 version old; both runs report the same metrics ("abort" adds resubmitted_requests)."""
    def job(name, updates, **engine):
        made = skyrl_tiny_rl_job(
            tmp_path, name,
            job={"steps": 6, "batch_size": 2, "n_samples": 4, "max_new_tokens": 48, "mode": "async",
                 "max_staleness": 1, "weight_updates": updates, "output_dir": tmp_path / f"{name}_out"},
            engine={"name": "embedded", "dtype": "auto", "share_weights": False, **engine},
            backend={"lr": 1e-3, "micro_batch_tokens": 512})
        return made.path, made.out

    runs = {}
    for updates in ("in_flight", "abort"):
        path, _ = job(f"refused_{updates}", updates)
        result = skyrl_cli("run", str(path))
        assert result.exit_code == 2, result.stderr
        assert f'weight_updates = "{updates}"' in result.stderr and "return_token_versions = true" in result.stderr
        path, out = job(updates, updates, return_token_versions=True)
        result = skyrl_cli("run", str(path))
        assert result.exit_code == 0, result.stderr
        rows = runs[updates] = step_rows(out)
        assert [r["step"] for r in rows] == list(range(1, 7))
        assert all(r["staleness_max"] <= 1.0 and 0.0 <= r["token_staleness_mean"] <= 1.0 for r in rows)
        assert any(r["mixed_version_fraction"] > 0.0 for r in rows), [r["mixed_version_fraction"] for r in rows]
        # A mixed sample is as old as its oldest token, so its tokens are on average younger.
        assert any(r["token_staleness_mean"] < r["staleness_mean"] for r in rows)
        assert all(abs(r["loss"]) < 1e3 and 0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert [set(r) for r in runs["abort"]] == [set(r) | {"resubmitted_requests"} for r in runs["in_flight"]]
    # A sample spans two versions only where its request was resubmitted.
    assert sum(r["resubmitted_requests"] for r in runs["abort"]) > 0
    assert all(r["resubmitted_requests"] > 0 for r in runs["abort"] if r["mixed_version_fraction"] > 0)


def test_updates_inside_generations_are_refused_where_they_cannot_work(skyrl_cli, skyrl_tiny_rl_job,
                                                                      tmp_path) -> None:
    """From validate and from run before anything starts, a one-line error naming the key:
    updates landing inside generations without per-token versions (also for a Ray engine
    actor, whose capabilities the driver cannot see), and weight_updates = "abort" with
    recorded routes (a resubmitted request would have two sets)."""
    cases = {
        "ray": ("in_flight", {"launcher": "ray"}, {"return_token_versions": False}, "return_token_versions = true"),
        "routes": ("abort", None, {"return_routed_experts": True}, "return_routed_experts"),
    }
    for name, (updates, cluster, engine, says) in cases.items():
        made = skyrl_tiny_rl_job(tmp_path, name, job={"steps": 2, "mode": "async", "weight_updates": updates},
                                 cluster=cluster, engine={"share_weights": False, "return_token_versions": True,
                                                          **engine})
        for command in ("validate", "run"):
            result = skyrl_cli(command, str(made.path))
            assert result.exit_code == 2, (name, command, result.stderr)
            assert "job.weight_updates" in result.stderr and says in result.stderr, result.stderr
            assert "Traceback" not in result.stderr

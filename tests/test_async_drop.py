"""``[job] stale_samples = "drop"``: the rollout thread never waits for a weight
version; a rollout more than ``max_staleness`` versions old when the trainer takes it is
dropped and its prompts generated again. A slow trainer (a test algorithm sleeping in
``advantages``, which runs in the trainer's thread) lets the rollout thread run ahead, so
rollouts are dropped; what must hold whatever the timing: every trained sample is at most
k versions old and every dataset position (a batch of prompts) is trained exactly once,
also across kill -9 and --resume."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from skyrl_host import hookimpl
from skyrl_host.statefile import load_state
from skyrl_host.testing import step_rows

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")

SLOW_GRPO = '''
import time
from skyrl_host import hookimpl
from skyrl_algorithms.grpo import Grpo, GrpoConfig

class SlowGrpo(Grpo):
    """GRPO whose trainer-side step takes {delay} s longer."""

    def advantages(self, batch, rewards):
        time.sleep({delay})
        return super().advantages(batch, rewards)

@hookimpl
def skyrl_register_algorithms(register):
    register("slow_grpo", SlowGrpo, config=GrpoConfig, description="GRPO with a slow trainer (tests)")
'''


def slow_grpo_site(tmp_path: pathlib.Path, delay: float = 0.25) -> pathlib.Path:
    """A folder for PYTHONPATH holding the slow_grpo plugin as an installed distribution."""
    site = tmp_path / "site"
    info = site / "slow_grpo_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "slow_grpo_plugin.py").write_text(SLOW_GRPO.format(delay=delay))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slow-grpo-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[skyrl]\nslow_grpo = slow_grpo_plugin\n")
    return site


def drop_job(make_job, tmp_path, name, *, steps=8, k=1, every=0, algorithm="slow_grpo", **job):
    made = make_job(tmp_path, name,
                    job={"steps": steps, "batch_size": 4, "checkpoint_every": every, "mode": "async",
                         "max_staleness": k, "stale_samples": "drop", "output_dir": tmp_path / f"{name}_out", **job},
                    algorithm={"name": algorithm},
                    engine={"name": "embedded", "dtype": "auto", "share_weights": False},
                    backend={"lr": 1e-3, "micro_batch_tokens": 128})
    return made.path, made.out


def check_invariants(rows, steps, k):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Each dataset position (the prompts of dataset.batch(p)) trained once, none lost.
    assert sorted(r["dataset_position"] for r in rows) == [float(p) for p in range(1, steps + 1)]
    assert all(r["staleness_max"] <= k for r in rows), [r["staleness_max"] for r in rows]
    assert all(r["step"] - 1 - r["weight_version"] <= k for r in rows)


class SlowTrainer:
    """The slow_grpo algorithm, registered in this process."""

    @hookimpl
    def skyrl_register_algorithms(self, register):
        from skyrl_algorithms.grpo import Grpo, GrpoConfig

        class SlowGrpo(Grpo):
            def advantages(self, batch, rewards):
                time.sleep(0.25)
                return super().advantages(batch, rewards)

        register("slow_grpo", SlowGrpo, config=GrpoConfig, description="GRPO with a slow trainer (tests)")


def test_drop_trains_nothing_older_than_k_and_every_prompt_once(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job,
                                                                 tmp_path) -> None:
    skyrl_plugin(SlowTrainer(), "slow_trainer")
    path, out = drop_job(skyrl_tiny_rl_job, tmp_path, "drop")
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(out)
    check_invariants(rows, 8, 1)
    # The rollout thread ran ahead of the slow trainer: some rollouts were too old.
    assert sum(r["dropped_samples"] for r in rows) > 0, [r["dropped_samples"] for r in rows]
    assert all(r["dropped_samples"] % 4 == 0 for r in rows)  # whole rollouts (groups of n_samples = 4)


def test_drop_resume_after_kill_trains_every_prompt_once(skyrl_tiny_rl_job, tmp_path) -> None:
    steps, k = 8, 1
    env = dict(os.environ, PYTHONPATH=str(slow_grpo_site(tmp_path)), PYTHONUNBUFFERED="1")
    path, out = drop_job(skyrl_tiny_rl_job, tmp_path, "killed", steps=steps, k=k, every=2)
    killed = subprocess.Popen([SKYRL, "run", str(path)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = out / "checkpoints" / "step_000004"
    deadline = time.time() + 300
    while not ckpt.exists():
        assert killed.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    saved = load_state(ckpt / "rollouts.safetensors")
    assert saved["stale_samples"] == "drop"
    trained = {r["dataset_position"] for r in step_rows(out) if r["step"] <= 4}
    # The checkpoint accounts for every position not trained by step 4: buffered, to generate again, or new.
    untrained = set(saved["positions"]) | set(saved["regenerate"]) | set(range(saved["next_position"], steps + 1))
    assert sorted(trained | untrained) == list(range(1, steps + 1)) and not trained & untrained
    resumed = subprocess.run([SKYRL, "run", str(path), "--resume"], capture_output=True, text=True, timeout=600,
                             cwd=ROOT, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "(resumed after step 4)" in resumed.stderr
    rows = step_rows(out)
    check_invariants(rows, steps, k)
    assert sum(r["dropped_samples"] for r in rows) > 0


def test_stale_samples_is_refused_where_it_makes_no_sense(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    cases = {
        "sync": ({"mode": "sync", "stale_samples": "drop"}, 'needs mode = "async"'),
        "k0": ({"mode": "async", "max_staleness": 0, "stale_samples": "drop"}, "max_staleness = 0"),
        "typo": ({"mode": "async", "stale_samples": "discard"}, "'wait', 'drop'"),
    }
    for name, (job, says) in cases.items():
        made = skyrl_tiny_rl_job(tmp_path, name, job={"steps": 2, **job}, engine={"share_weights": False})
        for command in ("validate", "run"):
            result = skyrl_cli(command, str(made.path))
            assert result.exit_code == 2, (name, command, result.stderr)
            assert "job.stale_samples" in result.stderr and says in result.stderr, result.stderr
            assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr

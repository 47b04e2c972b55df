"""The RL job end to end on a tiny model: metrics, final checkpoint, dynamic-sampling
refill, and resume after kill -9 reproducing the uninterrupted run."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from skyrl_host import hookimpl
from skyrl_host.interfaces import Task
from skyrl_host.statefile import load_state
from skyrl_host.testing import learning_metrics, step_rows

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def write_job(make_job, tmp_path, name="job", steps=4, every=0, algorithm="grpo", dataset=None, **algorithm_options):
    """The tiny RL job as this module runs it (``make_job``: the skyrl_tiny_rl_job fixture):
    4 prompts of 4 samples a step, lr 1e-3, the default engine and save_final."""
    job = make_job(tmp_path, name,
                   job={"steps": steps, "batch_size": 4, "checkpoint_every": every, "save_final": None,
                        "output_dir": tmp_path / f"{name}_out"},
                   dataset=dataset or {"prefix": None}, engine=None,
                   algorithm={"name": algorithm, **algorithm_options},
                   backend={"lr": 1e-3, "micro_batch_tokens": 128})
    return job.path, job.out


def test_rl_job_runs_and_saves_a_loadable_model(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    import torch
    import transformers

    path, out = write_job(skyrl_tiny_rl_job, tmp_path)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward_mean", "reward_std", "accuracy", "response_length_mean", "loss", "entropy",
                "clip_fraction", "logprob_diff_mean", "logprob_diff_max", "gen_tokens_per_s",
                "train_tokens_per_s", "step_time"):
        assert key in rows[0], key
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    # Step s generates with the weights published after step s - 1 (version 0: the initial weights).
    assert [r["weight_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[0]["logprob_diff_max"] < 1e-4  # engine and trainer score the same distribution
    assert (out / "plot.png").exists()
    final = out / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    tok = transformers.AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok.encode("reverse 123:")])
    ckpt = load_state(sorted((out / "checkpoints").iterdir())[-1] / "backend.safetensors")
    state = {k: v for k, v in ckpt["model"].items()} if "model" in ckpt else None
    assert state is not None
    ref = transformers.AutoModelForCausalLM.from_pretrained(final)
    ref.load_state_dict(state, strict=True)  # the checkpoint holds exactly the model's tensors
    assert torch.equal(model(ids).logits, ref(ids).logits)


def test_resume_after_kill_reproduces_the_uninterrupted_run(skyrl_tiny_rl_job, tmp_path) -> None:
    steps = 6
    full_path, full_out = write_job(skyrl_tiny_rl_job, tmp_path, "full", steps=steps, every=2)
    proc = subprocess.run([SKYRL, "run", str(full_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    expected = [learning_metrics(r, transport=True) for r in step_rows(full_out)]
    assert "reward_std" in expected[0]

    path, out = write_job(skyrl_tiny_rl_job, tmp_path, "killed", steps=steps, every=2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    killed = subprocess.Popen([SKYRL, "run", str(path)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step_000004").exists():
        assert killed.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = subprocess.run([SKYRL, "run", str(path), "--resume"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr
    assert "(resumed after step 4)" in resumed.stderr
    got = [learning_metrics(r, transport=True) for r in step_rows(out)]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert got == expected


class Mixed:
    """Half the prompts are trivial (every sample earns 1: an all-equal group),
    half are scored by the first character of the response."""

    alphabet = "ab0123456789"

    def __init__(self, config, seed=0):
        self.seed = seed

    def batch(self, step, size):
        return [Task(prompt=("a" if i % 2 == 0 else "b") + str(step % 10), answer="1") for i in range(size)]

    def reward(self, task, completion):
        if task.prompt.startswith("a"):
            return 1.0
        return 1.0 if completion[:1] in "01234" else 0.0


class MixedPlugin:
    @hookimpl
    def skyrl_register_datasets(self, register):
        register("mixed_test", Mixed, description="half all-equal groups")


def test_dynamic_sampling_refills_dropped_groups(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job, tmp_path) -> None:
    skyrl_plugin(MixedPlugin(), "mixed_plugin")
    path, out = write_job(skyrl_tiny_rl_job, tmp_path, steps=2, algorithm="dapo",
                          dataset={"name": "mixed_test", "min_len": None, "max_len": None, "prefix": None})
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    for row in step_rows(out):
        assert row["refill_rounds"] >= 1  # the first round keeps at most the 2 "b" groups
        assert row["kept_groups"] <= 4
        assert row["sequences"] == row["kept_groups"] * 4


def test_kl_in_reward_penalises_rewards(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, out = write_job(skyrl_tiny_rl_job, tmp_path, steps=3, kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(out)
    assert rows[0]["kl_reward_penalty_mean"] == pytest.approx(0.0, abs=1e-5)  # step 1: policy == reference
    assert any(abs(r["kl_reward_penalty_mean"]) > 1e-4 for r in rows[1:])  # then they part


@pytest.mark.parametrize(
    "family, preset",
    [
        ("qwen", "tiny-moe"), ("qwen", "tiny-qwen3.5-moe"), ("qwen", "tiny-qwen3-next"),
        ("glm", "tiny-glm4-moe"), ("glm", "tiny-glm4-moe-lite"), ("glm", "tiny-glm-moe-dsa"), ("glm", "tiny-glm5-next"),
        ("kimi", "tiny-kimi"), ("kimi", "tiny-deepseek-v3.2"), ("kimi", "tiny-kimi-linear"), ("nemotron", "tiny-nemotron-h"),
        ("nemotron", "tiny-nemotron-3-super"),
        ("qwen", "tiny-qwen3.5"),
    ],
)
def test_every_family_runs_the_rl_loop(skyrl_cli, skyrl_tiny_rl_job, tmp_path, family, preset) -> None:
    """Every family's loop, MoE models with r3 (which, on GLM-5 and DeepSeek-V3.2, also
    replays the sparse-attention indexer's key picks): the trainer's logprobs are the
    engine's, within the same bound for every family."""
    path, out = write_job(skyrl_tiny_rl_job, tmp_path, steps=2)
    moe = preset != "tiny-qwen3.5"
    replay = ["--set", "replay.strategies=['r3']", "--set", "engine.return_routed_experts=true"] if moe else []
    result = skyrl_cli("run", str(path), "--set", f"model.family='{family}'", "--set", f"model.preset='{preset}'",
                       "--set", "job.save_final=false", *replay)
    assert result.exit_code == 0, result.stderr
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["logprob_diff_max"] < 1e-4 for r in rows), [r["logprob_diff_max"] for r in rows]

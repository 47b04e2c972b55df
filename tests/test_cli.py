"""The `skyrl` command line as a user sees it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from skyrl_host import hookimpl
from skyrl_host.cli import make_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def skyrl(*args, env=None, cwd=ROOT):
    full = dict(os.environ, **(env or {}))
    return subprocess.run([SKYRL, *args], capture_output=True, text=True, env=full, cwd=cwd, timeout=120)


def test_version_lists_host_and_plugin_distributions(skyrl_cli) -> None:
    out = skyrl_cli("--version").stdout.splitlines()
    assert out[0] == "skyrl-host 0.1.0"
    assert "  skyrl-letter-count 0.1.0" in out


def test_help_on_every_command(skyrl_host, skyrl_cli) -> None:
    commands = sorted(make_cli(skyrl_host).commands)
    assert {"run", "validate", "plugins"} <= set(commands)
    top = skyrl_cli("--help")
    assert top.exit_code == 0 and "SKYRL_DISABLE_PLUGINS" in top.stdout
    for name in commands:
        result = skyrl_cli(name, "--help")
        assert result.exit_code == 0, name
        assert f"Usage: skyrl {name}" in result.stdout


def test_plugins_text_lists_distribution_hooks_and_names(skyrl_cli) -> None:
    out = skyrl_cli("plugins").stdout
    assert "letter_count  [loaded]  skyrl-letter-count 0.1.0  skyrl_letter_count\n" in out
    assert (
        "    hooks: skyrl_register_datasets\n"
        "    dataset letter_count: Count a letter in a random word; partial credit for near misses\n"
    ) in out
    assert "reward_check  [loaded]  skyrl-host 0.1.0  skyrl_host.jobs.reward_check\n" in out
    assert "    job kind reward_check: Audit a dataset: reproducible batches, rewards in [0, 1], references earn 1\n" in out


def test_plugins_json_and_hook_filter(skyrl_cli) -> None:
    data = json.loads(skyrl_cli("plugins", "--json").stdout)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["letter_count"]["distribution"] == "skyrl-letter-count"
    assert by_name["letter_count"]["version"] == "0.1.0"
    assert by_name["letter_count"]["registered"] == {"datasets": ["letter_count"]}
    assert by_name["metrics_jsonl"]["hooks"] == ["skyrl_job_finished", "skyrl_job_started", "skyrl_step_finished"]
    assert data["conflicts"] == []
    only = json.loads(skyrl_cli("plugins", "--json", "--hook", "skyrl_register_datasets").stdout)
    assert "letter_count" in [p["name"] for p in only["plugins"]]
    assert all("skyrl_register_datasets" in p["hooks"] for p in only["plugins"])


def test_plugins_unknown_hook_is_a_user_error(skyrl_cli) -> None:
    result = skyrl_cli("plugins", "--hook", "skyrl_register_dataset")
    assert result.exit_code == 2
    assert result.stderr == (
        "error: --hook: unknown hook 'skyrl_register_dataset' (did you mean 'skyrl_register_datasets'?)\n"
    )


def test_plugins_shows_conflicts(skyrl_cli, skyrl_plugin) -> None:
    class Clash:
        @hookimpl
        def skyrl_register_datasets(self, register):
            register("letter_count", dict, description="a second letter_count")

    skyrl_plugin(Clash(), "clash")
    out = skyrl_cli("plugins").stdout
    assert (
        "conflict: dataset 'letter_count' is registered by plugin 'letter_count' (skyrl-letter-count 0.1.0) "
        "and plugin 'clash'"
    ) in out


def test_blocked_plugins_are_listed_with_all() -> None:
    env = {"SKYRL_DISABLE_PLUGINS": "letter_count"}
    plain = skyrl("plugins", env=env)
    assert plain.returncode == 0
    assert "letter_count" not in plain.stdout.split("(")[0]
    assert "1 blocked by SKYRL_DISABLE_PLUGINS/SKYRL_LOAD_PLUGINS; --all lists them" in plain.stdout
    every = json.loads(skyrl("plugins", "--json", "--all", env=env).stdout)
    rec = next(p for p in every["plugins"] if p["name"] == "letter_count")
    assert (rec["status"], rec["error"], rec["hooks"]) == ("blocked", "blocked by SKYRL_DISABLE_PLUGINS", [])
    result = skyrl("validate", "examples/reward_check.toml", env=env)
    assert result.returncode == 2
    assert result.stderr == (
        "error: examples/reward_check.toml:11: dataset.name: dataset 'letter_count' would come from "
        "plugin 'letter_count' (skyrl-letter-count 0.1.0), which is blocked by SKYRL_DISABLE_PLUGINS\n"
    )


def test_run_twice_needs_overwrite(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["run", "examples/reward_check.toml", "--set", f"job.output_dir='{out}'", "--set", "job.steps=2"]
    first = skyrl(*args)
    assert first.returncode == 0, first.stderr
    assert f"reward_check job 'reward_check' completed 2 step(s)" in first.stderr
    second = skyrl(*args)
    assert second.returncode == 2
    assert f"'{out}' already holds a run; pass --resume to continue it, --overwrite to replace it" in second.stderr
    assert "Traceback" not in second.stderr
    third = skyrl(*args, "--overwrite")
    assert third.returncode == 0, third.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r.get("step")) for r in rows] == ["start", 1, 2, "end"]
    assert rows[-1]["status"] == "completed"


def test_a_failing_check_exits_1_without_traceback(skyrl_cli, skyrl_plugin, tmp_path) -> None:
    from skyrl_host.interfaces import Task

    class Wrong:
        def __init__(self, config, seed=0):
            pass

        def batch(self, step, size):
            return [Task(prompt=f"p{step}-{i}", answer="yes") for i in range(size)]

        def reward(self, task, completion):
            return 0.5 if completion == "yes" else 0.0

    class Plugin:
        @hookimpl
        def skyrl_register_datasets(self, register):
            register("wrong", Wrong, description="a reward that never gives full credit")

    skyrl_plugin(Plugin(), "wrong_plugin")
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "reward_check"\nsteps = 2\nbatch_size = 4\noutput_dir = "{tmp_path / "o"}"\n'
                   '[dataset]\nname = "wrong"\n')
    result = skyrl_cli("run", str(job))
    assert result.exit_code == 1
    assert "error: reward check failed: step 1: reference answer 'yes' to 'p1-0' earned 0.5" in result.stderr
    assert "Traceback" not in result.stderr
    end = json.loads((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["status"] == "failed" and end["error"].startswith("JobFailed: reward check failed")


@pytest.mark.slow
def test_reward_check_example_runs(tmp_path) -> None:
    """examples/reward_check.toml, run from another folder."""
    result = skyrl("run", str(ROOT / "examples" / "reward_check.toml"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(x) for x in (tmp_path / "runs" / "reward_check" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert len(steps) == 20
    assert all(r["reward_reference_mean"] == 1.0 for r in steps)
    assert all(r["reward_empty_mean"] == 0.0 for r in steps)
    assert all(0.1 < r["reward_shuffled_mean"] < 0.7 for r in steps)

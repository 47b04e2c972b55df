"""End to end through the `skyrl` command line (in-process, with the skyrl_cli
fixture): registration, reward_check jobs on each dataset, located validate errors."""

from __future__ import annotations

import json
import pathlib
import sys
import textwrap

import pytest

import skyrl_datasets.arithmetic
import skyrl_datasets.jsonl
import skyrl_datasets.reverse_digits

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"


def job_file(tmp_path: pathlib.Path, dataset: str, *, steps: int = 3, batch_size: int = 16) -> pathlib.Path:
    job = tmp_path / "job.toml"
    job.write_text(
        f'[job]\nkind = "reward_check"\nsteps = {steps}\nbatch_size = {batch_size}\noutput_dir = "{tmp_path / "run"}"\n\n'
        + textwrap.dedent(dataset)
    )
    return job


@pytest.mark.parametrize(
    ("name", "module", "factory"),
    [
        ("arithmetic", skyrl_datasets.arithmetic, "Arithmetic"),
        ("reverse_digits", skyrl_datasets.reverse_digits, "ReverseDigits"),
        ("jsonl", skyrl_datasets.jsonl, "Jsonl"),
    ],
)
def test_registered_through_installed_entry_points(skyrl_host, name, module, factory) -> None:
    reg = skyrl_host.registry.get("datasets", name)
    assert reg.factory is getattr(module, factory)
    assert reg.origin.distribution == "skyrl-datasets"
    assert skyrl_host.records[name].entry_point == f"skyrl_datasets.{name}"
    assert skyrl_host.pm.get_plugin(name) is module


@pytest.mark.parametrize(
    "dataset",
    [
        '[dataset]\nname = "arithmetic"\noperations = ["+", "-", "*"]\nmax_digits = 3\n',
        '[dataset]\nname = "arithmetic"\noperations = ["-"]\nallow_negative = true\n',
        '[dataset]\nname = "reverse_digits"\n',
        '[dataset]\nname = "reverse_digits"\nmin_len = 1\nmax_len = 10\n',
    ],
    ids=["arithmetic", "arithmetic-negative", "reverse_digits", "reverse_digits-1-10"],
)
def test_reward_check_passes_on_generated_tasks(skyrl_cli, tmp_path, dataset: str) -> None:
    result = skyrl_cli("run", str(job_file(tmp_path, dataset)))
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward_reference_mean" in r.get("metrics", r)]
    assert len(steps) == 3


def write_records(tmp_path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("shuffle", ["true", "false"])
def test_reward_check_passes_on_jsonl_exact(skyrl_cli, tmp_path, shuffle: str) -> None:
    path = write_records(tmp_path, [{"prompt": f"q{i}?", "answer": f"a{i}", "n": i} for i in range(5)])
    job = job_file(tmp_path, f'[dataset]\nname = "jsonl"\npath = "{path}"\nshuffle = {shuffle}\n', batch_size=4)
    result = skyrl_cli("run", str(job))
    assert result.exit_code == 0, result.stderr


def test_reward_check_passes_on_jsonl_regex_and_module_function(skyrl_cli, tmp_path, monkeypatch) -> None:
    path = write_records(tmp_path, [{"prompt": f"{i}+{i}?", "answer": f"{2 * i}|{2 * i}\\.0"} for i in range(6)])
    result = skyrl_cli("run", str(job_file(tmp_path, f'[dataset]\nname = "jsonl"\npath = "{path}"\nreward = "regex"\n')))
    assert result.exit_code == 0, result.stderr

    (tmp_path / "skyrl_cli_test_reward.py").write_text(
        "def score(task, completion):\n    return float(completion.strip() == task.answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "skyrl_cli_test_reward", raising=False)
    path = write_records(tmp_path, [{"prompt": f"say {i}", "answer": str(i)} for i in range(6)])
    job = job_file(tmp_path, f'[dataset]\nname = "jsonl"\npath = "{path}"\nreward = "skyrl_cli_test_reward:score"\n')
    result = skyrl_cli("run", str(job), "--overwrite")
    sys.modules.pop("skyrl_cli_test_reward", None)
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("example", ["arithmetic_check.toml", "reverse_digits_check.toml", "jsonl_check.toml"])
def test_example_job_files_pass(skyrl_cli, tmp_path, monkeypatch, example: str) -> None:
    monkeypatch.chdir(ROOT)  # jsonl_check.toml names its data relative to the repository root
    result = skyrl_cli("run", str(EXAMPLES / example), "--set", f"job.output_dir={json.dumps(str(tmp_path / 'run'))}")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_validate_reports_min_digits_above_max_digits(skyrl_cli, tmp_path) -> None:
    job = job_file(tmp_path, '[dataset]\nname = "arithmetic"\nmin_digits = 4\nmax_digits = 2\n')
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2
    # A check across two keys runs in __attrs_post_init__ and names its key with OptionError.
    assert f"error: {job}:9: dataset.min_digits: expected at most max_digits (2), found 4" in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_reports_bad_arithmetic_keys(skyrl_cli, tmp_path) -> None:
    job = job_file(tmp_path, '[dataset]\nname = "arithmetic"\noperations = ["+", "/"]\nmin_digits = 0\n')
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2
    assert f"{job}:9: dataset.operations: expected each operation to be one of '+', '-', '*', found '/'" in result.stderr
    assert f"{job}:10: dataset.min_digits: expected a value > 0, found 0" in result.stderr


def test_validate_reports_a_missing_jsonl_path_and_a_bad_reward(skyrl_cli, tmp_path) -> None:
    missing = tmp_path / "nope.jsonl"
    job = job_file(tmp_path, f'[dataset]\nname = "jsonl"\npath = "{missing}"\nreward = "exakt"\n')
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2
    assert f"{job}:9: dataset.path: expected an existing file, found nothing at {str(missing)!r}" in result.stderr
    assert (
        f"{job}:10: dataset.reward: expected 'exact', 'regex' or 'module:function', found 'exakt' (did you mean 'exact'?)"
        in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_validate_reports_a_folder_path_and_an_unknown_reward_module(skyrl_cli, tmp_path) -> None:
    job = job_file(tmp_path, f'[dataset]\nname = "jsonl"\npath = "{tmp_path}"\nreward = "skyrl_no_such_module_y:score"\n')
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2
    assert f"{job}:9: dataset.path: expected an existing file, found a folder {str(tmp_path)!r}" in result.stderr
    assert f"{job}:10: dataset.reward: cannot find module 'skyrl_no_such_module_y'" in result.stderr


def test_validate_does_not_read_the_file_but_run_reports_malformed_lines(skyrl_cli, tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", answer: 2}\n{"answer": "3"}\n')
    job = job_file(tmp_path, f'[dataset]\nname = "jsonl"\npath = "{path}"\n')
    assert skyrl_cli("validate", str(job)).exit_code == 0
    result = skyrl_cli("run", str(job))
    assert result.exit_code == 2
    assert f"{path}:2: invalid JSON: " in result.stderr
    assert f"{path}:3: missing the prompt key 'prompt'" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_reports_a_missing_reward_function(skyrl_cli, tmp_path) -> None:
    path = write_records(tmp_path, [{"prompt": "a", "answer": "1"}])
    job = job_file(tmp_path, f'[dataset]\nname = "jsonl"\npath = "{path}"\nreward = "json:no_such_function"\n')
    assert skyrl_cli("validate", str(job)).exit_code == 0
    result = skyrl_cli("run", str(job))
    assert result.exit_code == 2
    assert "error: dataset.reward: module 'json' has no attribute 'no_such_function'" in result.stderr
    assert "Traceback" not in result.stderr

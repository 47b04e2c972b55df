"""The [sampler] table through the host's job-file validation, with a test job
kind that uses a sampler: located errors, greedy's empty table, composition of
options, and --explain showing each name's defaults."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from skyrl_host import hookimpl
from skyrl_host.config import load_job
from skyrl_host.errors import UserError
from skyrl_samplers.top_p import TopPConfig


class SamplerJob:
    """Job kind "sampler_check": only a [sampler] table, required."""

    @hookimpl
    def skyrl_register_jobs(self, register: Any) -> None:
        register("sampler_check", object, description="uses a sampler only", slots={"sampler": None})


@pytest.fixture
def sampler_job(skyrl_plugin: Any) -> Any:
    return skyrl_plugin(SamplerJob(), name="sampler_check_kind")


def job_file(tmp_path: pathlib.Path, sampler: str) -> pathlib.Path:
    path = tmp_path / "job.toml"
    path.write_text('[job]\nkind = "sampler_check"\n\n[sampler]\n' + sampler)  # sampler keys start on line 5
    return path


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        ('name = "top_p"\ntop_p = 1.5\n', "6: sampler.top_p: expected a value in (0, 1], found 1.5"),
        ('name = "top_p"\ntop_p = 0\n', "6: sampler.top_p: expected a value in (0, 1], found 0.0"),
        ('name = "temperature"\ntemperature = 0\n', "6: sampler.temperature: expected a value > 0, found 0.0"),
        ('name = "top_k"\ntop_k = -1\n', "6: sampler.top_k: expected a value >= 0, found -1"),
        ('name = "top_k"\ntop_k = 2.5\n', "6: sampler.top_k: expected an integer, found float 2.5"),
        ('name = "min_p"\nmin_p = 1\n', "6: sampler.min_p: expected a value in [0, 1), found 1.0"),
        ('name = "min_p"\nmin_p = -0.1\n', "6: sampler.min_p: expected a value in [0, 1), found -0.1"),
        ('name = "top_p"\ntopp = 0.9\n', "6: sampler.topp: unknown key (did you mean 'top_p'?)"),
        (
            'name = "greedy"\ntemperature = 0.7\n',
            "6: sampler.temperature: unknown key",
        ),
        ('name = "top-p"\n', "5: sampler.name: unknown sampler 'top-p' (did you mean 'top_p'?)"),
    ],
)
def test_validate_reports_located_errors(
    sampler_job: Any, skyrl_cli: Any, tmp_path: pathlib.Path, sampler: str, expected: str
) -> None:
    path = job_file(tmp_path, sampler)
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert f"error: {path}:{expected}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_load_job_collects_every_sampler_error(sampler_job: Any, skyrl_host: Any, tmp_path: pathlib.Path) -> None:
    path = job_file(tmp_path, 'name = "top_p"\ntemperature = -1.0\ntop_p = 1.5\nmin_p = 1.0\n')
    with pytest.raises(UserError) as info:
        load_job(path, skyrl_host)
    messages = [(p.key, p.line, p.message) for p in info.value.problems]
    assert messages == [
        ("sampler.temperature", 6, "expected a value > 0, found -1.0"),
        ("sampler.top_p", 7, "expected a value in (0, 1], found 1.5"),
        ("sampler.min_p", 8, "expected a value in [0, 1), found 1.0"),
    ]


def test_a_name_with_other_options_applies_all_of_them(
    sampler_job: Any, skyrl_host: Any, tmp_path: pathlib.Path
) -> None:
    spec = load_job(job_file(tmp_path, 'name = "top_p"\ntop_k = 3\n'), skyrl_host)
    choice = spec.plugins["sampler"]
    assert choice.name == "top_p"
    assert choice.config == TopPConfig(temperature=1.0, top_k=3, top_p=0.95, min_p=0.0)
    sampler = choice.create()
    # probabilities 0.4, 0.3, 0.2, 0.1: top-k 3 renormalises to 4/9, 3/9, 2/9 (sum 1), which top-p 0.95 keeps whole
    # (mass before the third is 7/9); top-p alone would keep all four (mass before the fourth is 0.9).
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert sampler.support(logits).tolist() == [[True, True, True, False]]
    spec = load_job(job_file(tmp_path, 'name = "top_p"\ntop_p = 0.7\ntop_k = 3\n'), skyrl_host)
    assert spec.plugins["sampler"].create().support(logits).tolist() == [[True, True, False, False]]


def test_greedy_validates_with_an_empty_table(sampler_job: Any, skyrl_host: Any, tmp_path: pathlib.Path) -> None:
    spec = load_job(job_file(tmp_path, 'name = "greedy"\n'), skyrl_host)
    sampler = spec.plugins["sampler"].create()
    assert sampler.temperature == 1.0
    assert sampler.sample(torch.tensor([[0.0, 3.0, 1.0]]), None).token_ids.tolist() == [1]
    assert sampler.return_support is False


@pytest.mark.parametrize("name", ["greedy", "temperature", "top_k", "top_p", "min_p"])
def test_return_support_job_key(sampler_job: Any, skyrl_host: Any, tmp_path: pathlib.Path, name: str) -> None:
    spec = load_job(job_file(tmp_path, f'name = "{name}"\nreturn_support = true\n'), skyrl_host)
    assert spec.plugins["sampler"].create().return_support is True


@pytest.mark.parametrize(
    ("name", "defaults"),
    [
        ("temperature", {"temperature": "1.0", "top_k": "0", "top_p": "1.0", "min_p": "0.0"}),
        ("top_k", {"temperature": "1.0", "top_k": "50", "top_p": "1.0", "min_p": "0.0"}),
        ("top_p", {"temperature": "1.0", "top_k": "0", "top_p": "0.95", "min_p": "0.0"}),
        ("min_p", {"temperature": "1.0", "top_k": "0", "top_p": "1.0", "min_p": "0.05"}),
    ],
)
def test_explain_lists_each_names_defaults(
    sampler_job: Any, skyrl_cli: Any, tmp_path: pathlib.Path, name: str, defaults: dict
) -> None:
    result = skyrl_cli("validate", str(job_file(tmp_path, f'name = "{name}"\n')), "--explain")
    assert result.exit_code == 0, result.stderr
    for key, default in defaults.items():
        kind = "an integer" if key == "top_k" else "a number"
        assert f"  sampler.{key}: {kind}; default {default}; value {default}\n" in result.stdout, result.stdout

"""Packaging: the host and the plugin distributions, and the README's commands."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLUGIN_DISTS = ["models", "algorithms", "replay", "precisions", "weightsync", "samplers", "datasets", "engines", "backends"]
HEAVY = {"torch", "transformers", "ray", "vllm", "nixl-cu12", "nixl", "megatron-core", "torchao"}


def requirement_names(dist: str) -> set[str]:
    reqs = importlib.metadata.requires(dist) or []
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs if "extra ==" not in r}


def test_host_distribution() -> None:
    meta = importlib.metadata.metadata("skyrl-host")
    assert meta["Name"] == "skyrl-host"
    scripts = {ep.name: ep.value for ep in importlib.metadata.distribution("skyrl-host").entry_points if ep.group == "console_scripts"}
    assert scripts == {"skyrl": "skyrl_host.cli:entry"}
    assert requirement_names("skyrl-host") == {"pluggy", "attrs", "cattrs", "click", "rich", "numpy", "matplotlib"}


@pytest.mark.parametrize("kind", PLUGIN_DISTS)
def test_plugin_distribution_is_its_own_package(kind: str) -> None:
    project = tomllib.loads((ROOT / "plugins" / kind / "pyproject.toml").read_text())["project"]
    assert project["name"] == f"skyrl-{kind}"
    dist = importlib.metadata.distribution(f"skyrl-{kind}")
    assert "skyrl-host" in requirement_names(f"skyrl-{kind}")
    assert (ROOT / "plugins" / kind / f"skyrl_{kind}" / "__init__.py").exists()
    # Each feature module gets one entry point, named like the module.
    for ep in (e for e in dist.entry_points if e.group == "skyrl"):
        assert ep.value == f"skyrl_{kind}.{ep.name}", ep


def test_heavy_dependencies_stay_out_of_the_host() -> None:
    assert not requirement_names("skyrl-host") & HEAVY


def readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {marker} -->\n```bash\n(.+?)\n```\n<!-- /{marker} -->", text, re.S)
    assert m, f"README.md has no {marker} block"
    return m.group(1).strip()


def test_readme_commands_and_ci_agree() -> None:
    main, tests = readme_block("main-command"), readme_block("test-command")
    assert main.startswith("python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && ")
    job = main.rsplit(" ", 1)[1]
    assert (ROOT / job).exists(), job
    assert tests.endswith(".venv/bin/python -m pytest -n 2 --dist loadfile")
    extracted = subprocess.run(
        ["bash", "-c", "sed -n '/<!-- test-command -->/,/<!-- \\/test-command -->/p' README.md | grep -v -e '^<!--' -e '^```'"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert extracted == tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in ci and '"$rc" -eq 5' in ci


def test_requirements_install_every_distribution() -> None:
    reqs = (ROOT / "requirements.txt").read_text()
    for kind in PLUGIN_DISTS:
        # an extra may follow the folder (the models plugin brings gguf for the real model)
        assert re.search(rf"^-e \./plugins/{kind}(\[[a-z,]+\])?$", reqs, re.M), kind
    assert "-e ./examples/skyrl-letter-count" in reqs

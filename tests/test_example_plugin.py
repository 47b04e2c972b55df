"""The example third-party plugin is found through installed entry-point metadata,
like any package; it can be blocked; a broken copy breaks nothing else."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "skyrl-letter-count"
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def skyrl(*args, env=None):
    return subprocess.run([SKYRL, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_found_through_installed_metadata() -> None:
    dist = importlib.metadata.distribution("skyrl-letter-count")
    eps = [ep for ep in dist.entry_points if ep.group == "skyrl"]
    assert [(ep.name, ep.value) for ep in eps] == [("letter_count", "skyrl_letter_count")]
    # Nothing in the host names it: it is found only through that metadata.
    for path in (ROOT / "skyrl_host").rglob("*.py"):
        assert "letter_count" not in path.read_text(), path


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> pathlib.Path:
    """A copy of the example, renamed and broken at import, installed with pip
    into its own folder (a real wheel install: dist-info, RECORD, entry points)."""
    src = tmp_path_factory.mktemp("src") / "broken"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("tests", "*.egg-info", "build", "__pycache__"))
    pyproject = (src / "pyproject.toml").read_text()
    pyproject = pyproject.replace('name = "skyrl-letter-count"', 'name = "skyrl-letter-count-broken"')
    pyproject = pyproject.replace(
        'letter_count = "skyrl_letter_count"', 'letter_count_broken = "skyrl_letter_count_broken"'
    ).replace('py-modules = ["skyrl_letter_count"]', 'py-modules = ["skyrl_letter_count_broken"]')
    (src / "pyproject.toml").write_text(pyproject)
    module = (src / "skyrl_letter_count.py").read_text()
    module = module.replace('"letter_count",', '"letter_count_broken",')
    module = module.replace("import attrs\n", "import attrs\nfrom skyrl_host.config import no_such_helper\n")
    (src / "skyrl_letter_count_broken.py").write_text(module)
    (src / "skyrl_letter_count.py").unlink()
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert list(site.glob("skyrl_letter_count_broken-0.1.0.dist-info/entry_points.txt"))
    return site


def with_site(site: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_broken_copy_is_listed_and_breaks_nothing(broken_site, tmp_path) -> None:
    env = with_site(broken_site)
    listed = skyrl("plugins", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rec = next(p for p in json.loads(listed.stdout)["plugins"] if p["name"] == "letter_count_broken")
    assert rec["status"] == "failed"
    assert rec["distribution"] == "skyrl-letter-count-broken" and rec["version"] == "0.1.0"
    assert rec["error"] == "ImportError: cannot import name 'no_such_helper' from 'skyrl_host.config' (" + rec["error"].split("(", 1)[1]
    text = skyrl("plugins", env=env).stdout
    assert "letter_count_broken  [failed]  skyrl-letter-count-broken 0.1.0" in text
    assert "letter_count  [loaded]  skyrl-letter-count 0.1.0" in text

    # The intact example and other jobs still run.
    ok = skyrl("run", "examples/reward_check.toml", "--set", f"job.output_dir='{tmp_path / 'ok'}'", "--set", "job.steps=2", env=env)
    assert ok.returncode == 0, ok.stderr

    # A job that needs what the broken plugin provides names it.
    job = tmp_path / "job.toml"
    job.write_text('[job]\nkind = "reward_check"\n[dataset]\nname = "letter_count_broken"\n')
    bad = skyrl("validate", str(job), env=env)
    assert bad.returncode == 2
    assert bad.stderr.startswith(
        f"error: {job}:4: dataset.name: dataset 'letter_count_broken' would come from plugin 'letter_count_broken' "
        "(skyrl-letter-count-broken 0.1.0), which failed to load: ImportError: cannot import name 'no_such_helper'"
    )
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_broken_copy_can_be_blocked(broken_site) -> None:
    env = with_site(broken_site)
    env["SKYRL_DISABLE_PLUGINS"] = "skyrl-letter-count-broken"  # by distribution name
    data = json.loads(skyrl("plugins", "--json", "--all", env=env).stdout)
    rec = next(p for p in data["plugins"] if p["name"] == "letter_count_broken")
    assert (rec["status"], rec["error"]) == ("blocked", "blocked by SKYRL_DISABLE_PLUGINS")

"""Discovery, `skyrl plugins` and `skyrl validate` import no heavy module, and
`skyrl plugins` answers well under a second."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "ray", "vllm", "nixl", "megatron", "tensorflow", "jax", "wandb", "mlflow")

PROBE = """
import json, sys
sys.path.append({fake!r})  # stand-ins, found only where the real package is not installed
from skyrl_host.cli import main
rc = main({args!r})
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
with open({out!r}, "w") as f:
    json.dump({{"rc": rc, "heavy": heavy}}, f)
"""


def heavy_modules_after(tmp_path, args, extra_path=None):
    fake = tmp_path / "fake_heavy"
    for name in HEAVY:
        (fake / name).mkdir(parents=True, exist_ok=True)
        (fake / name / "__init__.py").write_text("")
    out = tmp_path / "probe.json"
    code = PROBE.format(fake=str(fake), args=list(args), heavy=HEAVY, out=str(out))
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "args",
    [["plugins"], ["plugins", "--json", "--all"], ["validate", "examples/reward_check.toml"], ["--version"], ["--help"]],
    ids=lambda a: " ".join(a),
)
def test_no_heavy_imports(tmp_path, args) -> None:
    got = heavy_modules_after(tmp_path, args)
    assert got == {"rc": 0, "heavy": []}


def test_the_check_catches_a_plugin_that_imports_torch_eagerly(tmp_path, make_dist) -> None:
    s = make_dist.suffix
    make_dist("acme-eager", {f"eager{s}": f"eager{s}"}, {f"eager{s}": "import torch\n"})
    got = heavy_modules_after(tmp_path, ["plugins"], extra_path=make_dist.site)
    assert "torch" in got["heavy"]


def test_skyrl_plugins_answers_well_under_a_second() -> None:
    skyrl = pathlib.Path(sys.executable).parent / "skyrl"
    assert skyrl.exists(), "the console script is installed beside the interpreter"
    times = []
    for _ in range(3):
        start = time.perf_counter()
        proc = subprocess.run([str(skyrl), "plugins"], capture_output=True, text=True, timeout=60)
        times.append(time.perf_counter() - start)
        assert proc.returncode == 0, proc.stderr
    assert min(times) < 1.0, f"skyrl plugins took {min(times):.2f} s at best"

"""A job that quantizes nothing (bf16) imports no torchao: no "Failed to load ... .so"
notices, no torch pytree deprecation warnings before its first step; the quantized
formats still import it when they are used."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from skyrl_host.testing import tiny_rl_job

RUN = """
import json, sys
from skyrl_host.cli import main
rc = main(["run", {job!r}])
print("PROBE " + json.dumps({{"rc": rc, "torchao": "torchao" in sys.modules, "transformers": "transformers" in sys.modules}}))
"""


def python(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_a_bf16_job_prints_nothing_of_torchao_and_never_imports_it(tmp_path) -> None:
    job = tiny_rl_job(tmp_path, job={"steps": 2, "batch_size": 4, "n_samples": 2, "max_new_tokens": 4},
                      algorithm={"name": "grpo"}, precision={"name": "bf16"}, backend={"micro_batch_tokens": 128}).path
    proc = python(RUN.format(job=str(job)), tmp_path)
    probe = json.loads(proc.stdout.split("PROBE ", 1)[1]) if "PROBE " in proc.stdout else None
    assert probe == {"rc": 0, "torchao": False, "transformers": True}, proc.stderr
    output = proc.stdout.split("PROBE ", 1)[0] + proc.stderr  # the job's own output, not the probe's line
    assert "completed 2 step(s)" in proc.stderr
    for noise in ("Failed to load", "torchao", "DeprecationWarning", "FutureWarning", "_pytree", "deprecated"):
        assert noise not in output, f"{noise!r} in the job's output:\n{output}"


def test_building_the_bf16_precision_imports_no_torchao(tmp_path) -> None:
    code = """
import sys
from skyrl_host.plugins import build_host
from skyrl_precisions.bf16 import Bf16Config
precision = build_host().get("precisions", "bf16").create(Bf16Config())
assert precision.quantizes is False
assert "torch" in sys.modules and "torchao" not in sys.modules, sorted(m for m in sys.modules if "torchao" in m)
print("ok")
"""
    proc = python(code, tmp_path)
    assert proc.stdout == "ok\n", proc.stderr


def test_after_hiding_torchao_from_transformers_the_quantized_formats_still_import_it(tmp_path) -> None:
    code = """
import sys
from skyrl_precisions._torchao import hide_from_transformers
assert hide_from_transformers() is True
assert "torch" not in sys.modules and "torchao" not in sys.modules  # nothing heavy to decide it
import transformers.modeling_utils
from transformers.utils import is_torchao_available
assert not is_torchao_available() and "torchao" not in sys.modules
import torch
from skyrl_precisions._formats import FORMATS
w = torch.randn(4, 64)
payload, scales = FORMATS["mxfp8"].pack(w)
assert "torchao" in sys.modules
assert hide_from_transformers() is False  # torchao is in: too late, nothing to do
print("ok")
"""
    proc = python(code, tmp_path)
    assert proc.stdout == "ok\n", proc.stderr

"""The device kit (benchmarks/device/: prepare.sh, run.sh, kit.py) proven without a GPU:
what the lent machine lacks is carried, the carried wheels resolve for its Python 3.12, the
project's metadata is found without an install, and ``run.sh --cpu`` runs every check
through the same entry points the GPU run takes, each summarised, one hang never eating
the rest."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import pathlib
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / "benchmarks" / "device"
sys.path.insert(0, str(KIT_DIR))
import kit  # noqa: E402

pytestmark = pytest.mark.slow

# pip's answers when the registry cannot be reached (not when it answers "no such wheel").
UNREACHABLE = ("Failed to establish a new connection", "Temporary failure in name resolution", "Max retries exceeded",
               "Network is unreachable", "Connection refused")


def test_every_distribution_the_kit_needs_is_on_the_lent_machine_or_carried() -> None:
    assert kit.missing_on_lent_machine() == {}
    # The check bites: without zstandard carried, or with the machine's own transformers
    # (5.17) where tinker needs none newer but our pin is 5.24, it names the gap.
    carried = kit.carried_wheels()
    del carried["zstandard"]
    problems = kit.missing_on_lent_machine(carried=carried)
    assert list(problems) == ["zstandard"], problems
    assert "neither on the lent machine nor in wheels.txt" in problems["zstandard"]
    lent = dict(kit.lent_packages(), **{"huggingface-hub": "0.30.0"})  # older than transformers 5.24 takes
    problems = kit.missing_on_lent_machine(lent=lent)
    assert list(problems) == ["huggingface-hub"] and "refuses it: carry it" in problems["huggingface-hub"], problems


def test_the_carried_wheels_download_for_python_312_within_60_mib_and_install_together(tmp_path) -> None:
    dest = tmp_path / "whl"
    proc = subprocess.run(["bash", str(KIT_DIR / "prepare.sh"), "--dest", str(dest)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHON=sys.executable))
    if proc.returncode != 0 and any(s in proc.stderr for s in UNREACHABLE):
        pytest.skip(f"the package registry does not answer: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    wheels = sorted(dest.glob("*.whl"))
    assert report["ok"] and report["wheels"] == len(wheels) == len(kit.carried_wheels())
    assert sum(w.stat().st_size for w in wheels) <= 60 * 2**20
    got = {kit.canonical(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
    assert got == kit.carried_wheels()  # exactly the pinned versions, nothing else
    # Their own requirements (METADATA), with the lent machine's packages, leave nothing unmet.
    assert kit.missing_on_lent_machine(kit.wheel_requires(dest)) == {}
    # run.sh's install, for the lent machine's interpreter: one version of each, every tag accepted.
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(target), "--python-version", "3.12", "--implementation", "cp",
                           "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--platform",
                           "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform",
                           "manylinux2014_x86_64", *map(str, wheels)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (target / "transformers" / "__init__.py").exists() and (target / "torchao").is_dir()


def test_the_metadata_run_sh_writes_declares_what_the_installed_distributions_declare(tmp_path) -> None:
    sources = kit.write_metadata(tmp_path)
    assert sources[0] == str(ROOT) and all(pathlib.Path(s, "pyproject.toml").exists() for s in sources)
    written = {d.metadata["Name"]: d for d in md.distributions(path=[str(tmp_path)])}
    assert sorted(written) == sorted(kit.DISTRIBUTIONS)
    for name, dist in written.items():
        installed = md.distribution(name)  # this environment's editable install of the same folder
        assert dist.version == installed.version
        # Every entry point (the `skyrl` plugins, pytest's), but the console script: no install, no
        # script; the kit runs `python -m skyrl_host`.
        assert {(e.group, e.name, e.value) for e in dist.entry_points} == \
            {(e.group, e.name, e.value) for e in installed.entry_points if e.group != "console_scripts"}, name
        from packaging.requirements import Requirement

        assert sorted(map(str, map(Requirement, dist.requires or []))) == \
            sorted(str(Requirement(r)) for r in installed.requires or [] if "extra ==" not in r)
    # Written again (a second run on the same machine): replaced, never doubled.
    kit.write_metadata(tmp_path)
    assert len(list(tmp_path.glob("*.dist-info"))) == len(kit.DISTRIBUTIONS)


def test_a_check_that_hangs_is_stopped_with_its_children_and_the_next_one_runs(tmp_path) -> None:
    marker = tmp_path / "child-alive"
    # The check's process starts a child that would touch the marker in 3 s, then hangs.
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).touch()"
    hang = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    checks = [kit.Check("hangs", "sleeps", (1.5, 1.5), lambda ctx: [[sys.executable, "-c", hang]]),
              kit.Check("works", "prints", (20, 20), lambda ctx: [[sys.executable, "-c", "print('{\"x\": 1}')"]],
                        kit.benchmark_json)]
    results = {}
    t0 = time.monotonic()
    for check in checks:
        ctx = kit.Context(cpu=True, work=tmp_path)
        results[check.name] = kit.run_one(check, ctx, check.timeout[1], tmp_path / f"{check.name}.log", dict(os.environ))
    assert time.monotonic() - t0 < 15
    assert results["hangs"]["ok"] is False and results["hangs"]["error"] == "timed out after 2 s"
    assert results["works"] == {"what": "prints", "wall_s": results["works"]["wall_s"], "x": 1, "ok": True}
    time.sleep(3.5)
    assert not marker.exists(), "the hung check's child outlived its timeout"


def test_run_sh_refuses_an_unknown_check_naming_the_known_ones() -> None:
    proc = subprocess.run(["bash", str(KIT_DIR / "run.sh"), "--cpu", "--only", "quickstart,warp_drive"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 2
    assert "unknown check(s) warp_drive" in proc.stderr and "quickstart, moe_r3_support" in proc.stderr


def test_run_sh_cpu_runs_every_check_and_summarises_each(tmp_path) -> None:
    out, imports = tmp_path / "out", tmp_path / "imports"
    imports.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), SKYRL_KIT_RECORD_IMPORTS=str(imports),
               SKYRL_DEVICE_SITE=str(tmp_path / "site"))
    proc = subprocess.run(["bash", str(KIT_DIR / "run.sh"), "--cpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1600, env=env)
    summary = json.loads((out / "summary.json").read_text())
    failed = {k: v.get("error") for k, v in summary["checks"].items() if not v.get("ok")}
    assert proc.returncode == 0 and not failed, failed or proc.stderr[-3000:]
    checks = summary["checks"]
    assert list(checks) == [c.name for c in kit.CHECKS]
    # run.sh prints the summary too, without the package table (a remote runner shows ~12k characters).
    printed = json.loads(proc.stdout)
    assert printed == kit.compact(summary) and len(proc.stdout) < 12_000
    assert printed["checks"]["preflight"]["packages"].endswith("packages: see summary.json")
    # preflight: the project was found through the metadata run.sh wrote, nothing missing.
    pre = checks["preflight"]
    assert pre["problems"] == [] and set(kit.DISTRIBUTIONS) - kit.LIBRARIES <= set(pre["distributions_found"])
    assert pre["cuda"] is False and pre["packages"]["transformers"]["installed"] == kit.carried_wheels()["transformers"]
    # The RL jobs ran their steps on the CPU, the engine serving the trainer's numbers.
    for name, steps in (("quickstart", 5), ("moe_r3_support", 3), ("delta_sync", 3), ("async_delta", 4),
                        ("megatron_quickstart", 3), ("shared_prompts", 5)):
        assert checks[name]["steps"] == steps, name
        assert checks[name]["median_step_time"] > 0 and checks[name]["median_gen_tokens_per_s"] > 0, name
    for name in ("quickstart", "delta_sync", "megatron_quickstart", "shared_prompts"):  # fp32 engine and trainer
        assert checks[name]["logprob_diff_max"] < 1e-5, (name, checks[name]["logprob_diff_max"])
    assert checks["moe_r3_support"]["logprob_diff_max"] < 0.05  # bf16 engine, fp32 trainer, experts replayed
    fsdp2 = checks["fsdp2"]
    assert fsdp2["group"] == "gloo" and fsdp2["loss_diff_max"] <= 1e-5 and fsdp2["resume_loss_diff"] <= 1e-5
    mega = checks["megatron_step"]["models"]["tiny"]
    assert mega["warmup_loss_diff"] <= 1e-5 and mega["megatron_over_torch"] > 0
    prec = checks["precisions"]
    assert prec["bf16"]["step_time_vs_bf16"] > 0 and prec["fp8"]["logprob_diff_max"] > 0
    assert set(prec) >= {"bf16", "fp8", "fp8_rowwise", "mxfp8", "bf16_again", "bf16_spread"}
    # Which kernels each ran, as the precision said: on a CPU "auto" emulates (torchao's there only on request).
    assert [(prec[r]["kernels"], prec[r]["format"]) for r in ("fp8", "fp8_rowwise", "mxfp8")] == \
        [("emulated", "fp8"), ("emulated", "fp8_rowwise"), ("emulated", "mxfp8")]
    opd = checks["opd_teacher"]  # the teacher's top-4 KL term beside opd's own
    assert opd["steps"] == 3 and math.isfinite(opd["teacher_kl_loss_last"]) and math.isfinite(opd["teacher_kl_last"])
    rm = checks["reward_model"]  # a sequence classifier scored every step's responses
    assert rm["steps"] == 3 and all(math.isfinite(rm[k]) for k in ("reward_model_mean_first", "reward_model_mean_last"))
    tinker = checks["tinker_load"]
    assert tinker["completed"] == tinker["requests"] == 192 and tinker["failed"] == 0
    assert tinker["ratio_http_vs_engine_median"] > 0
    # One log per check comes back beside the summary.
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(f"logs/{c.name}.log" for c in kit.CHECKS)
    # Every module a check imported is on the lent machine or carried (or optional there).
    modules = kit.recorded_imports(imports)
    assert {"torch", "transformers", "torchao", "megatron", "tinker", "zstandard"} <= set(modules)
    assert kit.unexplained_imports(modules) == {}
    carried = kit.carried_wheels()
    del carried["zstandard"]
    assert "zstandard" in kit.unexplained_imports(modules, carried=carried)  # the check bites

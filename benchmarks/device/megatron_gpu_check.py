"""Megatron backend check on one GPU (issue 18): the CPU suite's parity tests on CUDA, the
step-time benchmark on CUDA, the quickstart with the megatron backend on CUDA. Prints one
JSON object; exits 2 at once without a CUDA device.

    bash benchmarks/device/megatron_gpu_check.sh     # one H200: < 8 minutes

1. ``pytest plugins/backends/tests/test_megatron.py``: with ``device = "auto"`` both backends
   and the engine run on the GPU there (torch vs megatron, fp32: 10 steps within 1e-5, MoE,
   recompute, r3 through megatron-core's RouterReplay, support, resume, the distributed
   checkpoint);
2. ``benchmarks/megatron_step.py --models tiny-moe,qwen3-2l``: step time megatron / torch;
3. ``skyrl run examples/quickstart.toml`` with ``backend.name = "megatron"`` and both
   devices ``cuda``, 200 steps: reward, engine/trainer gap, step time, a distributed
   checkpoint every 100 steps.

TransformerEngine: reported (``transformer_engine`` importable or not). The backend builds
megatron-core's local (TransformerEngine-free) layers either way; TE layer specs are not
wired yet, so its fused kernels are not what this measures.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(cmd: list[str], timeout: float) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    return proc.returncode, proc.stdout, proc.stderr, round(time.perf_counter() - t0, 2)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device: run this check on a machine with a GPU"}))
        return 2
    import importlib.util

    te = importlib.util.find_spec("transformer_engine") is not None
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformer_engine": te,
                    "checks": {}}
    py = sys.executable
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", "450"))
    start = time.perf_counter()

    def left() -> float:
        return budget - (time.perf_counter() - start)

    rc, out, err, wall = run([py, "-m", "pytest", "-q", "-p", "no:warnings", "plugins/backends/tests/test_megatron.py"],
                             min(240.0, left()))
    report["checks"]["parity_tests"] = {"ok": rc == 0, "wall_s": wall, "tail": (out + err)[-1500:]}

    rc, out, err, wall = run([py, "benchmarks/megatron_step.py", "--models", "tiny-moe,qwen3-2l", "--repeats", "5"],
                             min(150.0, left()))
    entry: dict = {"ok": rc == 0, "wall_s": wall}
    try:
        entry["result"] = json.loads(out)
    except ValueError:
        entry["error"] = err[-1500:]
        entry["ok"] = False
    report["checks"]["step_time"] = entry

    with tempfile.TemporaryDirectory(prefix="megatron_gpu_") as tmp:
        out_dir = pathlib.Path(tmp) / "quickstart"
        skyrl = str(pathlib.Path(py).with_name("skyrl"))
        cmd = [skyrl, "run", "examples/quickstart.toml", "--set", "backend.name=\"megatron\"", "--set", "job.steps=200",
               "--set", "backend.device=\"cuda\"", "--set", "engine.device=\"cuda\"", "--set", "job.checkpoint_every=100",
               "--set", f"job.output_dir=\"{out_dir}\""]
        rc, out, err, wall = run(cmd, max(20.0, left()))
        entry = {"ok": rc == 0, "wall_s": wall}
        if rc == 0:
            rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "step" in r and "event" not in r]
            entry.update(steps=len(rows), reward_first5=statistics.mean(r["reward_mean"] for r in rows[:5]),
                         reward_last10=statistics.mean(r["reward_mean"] for r in rows[-10:]),
                         logprob_diff_max=max(r["logprob_diff_max"] for r in rows),
                         median_step_s=statistics.median(r["step_time"] for r in rows))
            # the megatron-core distributed checkpoints written on CUDA (steps 100 and 200)
            shards = sorted((out_dir / "checkpoints").glob("step_*/backend/*.distcp"))
            entry["checkpoint_files"] = len(shards)
            entry["ok"] = bool(shards)
        else:
            entry["error"] = err[-1500:]
        report["checks"]["quickstart_megatron_cuda"] = entry
    report["ok"] = all(c.get("ok") for c in report["checks"].values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU placement check (issue 13): the quickstart with the engine and the backend on CUDA,
a tiny MoE job with routing replay + support replay on CUDA, FSDP2 over one GPU, a
delta sync, async RL with the delta written in the background. Prints one JSON object; exits 2 at once when there is no CUDA device.

    bash benchmarks/device/gpu_check.sh          # on a machine with one GPU (an H200: < 8 minutes)

Each check is a ``skyrl run`` with ``--set`` overrides; its summary is the last step's
metrics whose names mention reward, time, tokens, gap or sync, plus the median step time.
A failing check is reported (its stderr's tail) and the others still run.
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
CUDA = ["engine.device=\"cuda\"", "backend.device=\"cuda\""]
DELTA = ["weight_sync.transport=\"delta\"", "weight_sync.uri=\"file://{out}_weights\"", "weight_sync.dtype=\"float32\""]  # {out}: the check's folder
CHECKS = {
    "quickstart_cuda": ("examples/quickstart.toml", ["job.steps=200", *CUDA]),
    "moe_r3_support_cuda": ("examples/replay_ablation.toml", ["job.steps=20", *CUDA]),
    "fsdp2_one_gpu": ("examples/quickstart.toml",
                      ["job.steps=20", *CUDA, "backend.data_parallel=\"fsdp2\"", "cluster.launcher=\"ray\"",
                       "weight_sync.transport=\"broadcast\""]),
    "delta_sync_cuda": ("examples/quickstart.toml", ["job.steps=20", *CUDA, *DELTA]),
    # Async RL on CUDA: delta's background = "auto" writes each version in the sender's thread
    # (sync_snapshot_s in the summary) while the trainer trains on; the rollout thread commits.
    "async_delta_background_cuda": ("examples/quickstart.toml",
                                    ["job.steps=40", *CUDA, *DELTA, "job.mode=\"async\"",
                                     "job.max_staleness=1", "engine.share_weights=false"]),
}
KEYS = ("reward", "time", "_s", "tokens", "gap", "sync")


def summary(rows: list[dict]) -> dict:
    last = rows[-1] if rows else {}
    out = {k: v for k, v in last.items() if isinstance(v, (int, float)) and any(w in k for w in KEYS)}
    times = [r[k] for r in rows for k in ("step_time_s", "time/step_s", "step_s") if isinstance(r.get(k), (int, float))]
    if times:
        out["median_step_s"] = statistics.median(times)
    out["steps"] = len(rows)
    return out


def run_check(name: str, job: str, sets: list[str], work: pathlib.Path, timeout: float) -> dict:
    out_dir = work / name
    skyrl = pathlib.Path(sys.executable).with_name("skyrl")
    cmd = [str(skyrl), "run", str(ROOT / job), "--overwrite",
           "--set", f"job.output_dir=\"{out_dir}\""]
    for s in sets:
        cmd += ["--set", s.replace("{out}", str(out_dir))]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    result: dict = {"ok": proc.returncode == 0, "wall_s": round(time.perf_counter() - t0, 2)}
    if proc.returncode != 0:
        result["error"] = proc.stderr[-2000:]
        return result
    metrics = out_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    result.update(summary([r for r in rows if "step" in r]))
    return result


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device: torch.cuda.is_available() is False; "
                          "run this check on a machine with a GPU"}))
        return 2
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", "450"))
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": {}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name, (job, sets) in CHECKS.items():
            left = budget - (time.perf_counter() - start)
            if left < 20:
                report["checks"][name] = {"ok": False, "error": "skipped: out of time"}
                continue
            report["checks"][name] = run_check(name, job, sets, pathlib.Path(tmp), left)
    report["ok"] = all(c.get("ok") for c in report["checks"].values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

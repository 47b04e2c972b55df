"""Async RL (issue 17): ``stale_samples = "wait"`` vs ``"drop"``; JSON out.

The same async job (``mode = "async"``, ``max_staleness = --k``, the local launcher,
the embedded engine with a copy of its own) runs with each ``[job] stale_samples``. The
shape is the quickstart's (tiny Qwen3 on reverse_digits, 32 prompts x 16 samples, 7 new
tokens), where a train step costs about three generations: the engine is the faster
side, the case where "drop" generates ahead and drops. Runs alternate (wait, drop,
wait, ...) with seed ``--seed + r`` in repeat r; per setting the medians over the repeats
of: steps/s over the run's steps (after its first), the fraction of generated rollouts
that were dropped, the largest staleness trained, and the mean reward.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/async_drop.py [--steps 20] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from skyrl_host.testing import step_rows, tiny_rl_job

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")
SETTINGS = ("wait", "drop")


def run(folder: pathlib.Path, setting: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    made = tiny_rl_job(
        folder, f"{setting}_{seed}",
        job={"seed": seed, "steps": args.steps, "batch_size": 32, "n_samples": 16, "max_new_tokens": 7,
             "threads": args.threads, "mode": "async", "max_staleness": args.k, "stale_samples": setting,
             "checkpoint_every": 0, "save_final": False},
        engine={"name": "embedded", "dtype": "auto", "share_weights": False},
        backend={"lr": 5e-4},
    )
    proc = subprocess.run([SKYRL, "run", str(made.path)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting} (seed {seed}) failed:\n{proc.stderr[-3000:]}")
    return step_rows(made.out)


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    later = rows[1:]  # the first step waits for the first rollout alone
    dropped = sum(r.get("dropped_samples", 0.0) for r in rows) / (32 * 16)  # rollouts of 32 x 16 samples
    return {
        "steps_per_s": len(later) / (later[-1]["time"] - rows[0]["time"]),
        "dropped_fraction": dropped / (dropped + len(rows)),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "reward_mean": statistics.fmean(r["reward_mean"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for setting in SETTINGS:
                runs[setting].append(summarize(run(pathlib.Path(tmp), setting, args.seed + r, args)))
    out: dict[str, Any] = {"args": vars(args), "runs": runs}
    for setting in SETTINGS:
        out[setting] = {k: statistics.median(x[k] for x in runs[setting]) for k in runs[setting][0]}
    out["drop_vs_wait_steps_per_s"] = statistics.median(
        d["steps_per_s"] / w["steps_per_s"] for d, w in zip(runs["drop"], runs["wait"]))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

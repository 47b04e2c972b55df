"""Weight updates in async RL (issue 17): "idle" vs "in_flight" vs "abort"; JSON out.

The same async job (``[job] mode = "async"``, ``max_staleness = 1``, the local launcher:
engine and trainer are threads of one process, the embedded engine with a copy of its
own and ``return_token_versions``) runs with each ``[job] weight_updates``:

- ``idle``: a version reaches the engine only between generations;
- ``in_flight``: at once; the generation in progress goes on on the old weights' KV;
- ``abort``: at once; the live requests are resubmitted with what they generated,
  prefilled again with the new weights (the cost: one prefill of prompt + tokens so far
  per resubmitted request).

Long responses against a short train step (the tiny Qwen3 preset, reverse_digits,
2 prompts x 4 samples, ``--max-new-tokens`` 48, no stop strings) so that updates land
inside generations. Runs alternate (idle, in_flight, abort, idle, ...) with seed
``--seed + r`` in repeat r; per mode the medians over the repeats of: steps/s over the
run's steps (after its first), generated tokens/s inside the engine, the fraction of
samples that span two versions, tokens per resubmitted request, requests resubmitted per
step, the trainer-vs-engine logprob gap and the mean reward.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/async_updates.py [--steps 40] [--repeats 3]
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
MODES = ("idle", "in_flight", "abort")


def run(folder: pathlib.Path, mode: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    made = tiny_rl_job(
        folder, f"{mode}_{seed}",
        job={"seed": seed, "steps": args.steps, "batch_size": args.batch_size, "n_samples": args.n_samples,
             "max_new_tokens": args.max_new_tokens, "threads": args.threads, "mode": "async", "max_staleness": 1,
             "weight_updates": mode, "checkpoint_every": 0, "save_final": False},
        engine={"name": "embedded", "dtype": "auto", "share_weights": False, "return_token_versions": True},
        backend={"lr": 1e-3, "micro_batch_tokens": 512},
    )
    proc = subprocess.run([SKYRL, "run", str(made.path)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} (seed {seed}) failed:\n{proc.stderr[-3000:]}")
    return step_rows(made.out)


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    later = rows[1:]  # the first step waits for the first rollout alone
    wall = later[-1]["time"] - rows[0]["time"]
    seqs = [r for r in rows if "resubmitted_requests" in r]
    out = {
        "steps_per_s": len(later) / wall,
        "gen_tokens_per_s": statistics.median(r["gen_tokens_per_s"] for r in rows),
        "mixed_version_fraction": statistics.mean(r["mixed_version_fraction"] for r in rows),
        "token_staleness_mean": statistics.mean(r["token_staleness_mean"] for r in rows),
        "logprob_diff_mean": statistics.mean(r["logprob_diff_mean"] for r in rows),
        "reward_mean": statistics.mean(r["reward_mean"] for r in rows),
        "response_length_mean": statistics.mean(r["response_length_mean"] for r in rows),
    }
    if seqs:
        out["resubmitted_per_step"] = statistics.mean(r["resubmitted_requests"] for r in seqs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="[job] threads (torch threads of each thread)")
    ap.add_argument("--seed", type=int, default=1, help="repeat r runs every mode with seed + r")
    args = ap.parse_args()
    per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in MODES:
                per_mode[mode].append(summarize(run(pathlib.Path(tmp), mode, args.seed + r, args)))
    result: dict[str, Any] = {"args": vars(args), "modes": {}}
    for mode, reps in per_mode.items():
        result["modes"][mode] = {k: statistics.median(rep[k] for rep in reps) for k in reps[0]}
        result["modes"][mode]["per_repeat_steps_per_s"] = [rep["steps_per_s"] for rep in reps]
    idle = result["modes"]["idle"]["steps_per_s"]
    result["steps_per_s_vs_idle"] = {m: result["modes"][m]["steps_per_s"] / idle for m in MODES}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Asynchronous RL (issue 17) against the synchronous loop, Ray launcher, CPU; JSON out.

The same job runs synchronously (``[job] mode = "sync"``: generate, then train, each
step) and asynchronously (``mode = "async"``, ``max_staleness = k`` for k = 1 and 2: the
driver's rollout thread has the engine actor generate the coming steps while the backend
actor trains), each for the same wall-clock budget, with ``[cluster] launcher = "ray"``:
one engine actor and one backend actor, one CPU each (``cpus_per_actor = 1``,
``[job] threads = 1``), weights through ``delta`` on a local folder (float32; ``--transport``
``nixl`` or ``broadcast`` instead). Runs are
alternated (sync, k=1, k=2, sync, ...) and each figure is the median over the repeats.

The job is the quickstart's task (examples/quickstart.toml: the tiny Qwen3 preset
learning reverse_digits of 3-5 digits with GRPO, lr 5e-4) at 8 prompts x 8
samples and max_new_tokens = 16, chosen because there, on one core each, the engine's
generation and the backend's training step cost about the same (``balance``: seconds per
step of each, measured in the sync runs: 0.078 s and 0.082 s on the 2-core machine of
2026-12-02, 0.040 s and 0.050 s on that of 2026-12-05, 0.038 s and 0.037 s there at 12ebb79). That is where overlapping them can
pay most: ``ideal_ratio`` = sync step time / max(gen, train) (2.0-2.4x, the sync step
also scoring, publishing and moving batches); the issue's goal is >= 1.6x at k = 1. With
both cores busy the driver process (tokenizing, scoring, Ray's transfers) and Ray's own
daemons compete with the actors, and each async step still holds the trainer for the
delta publish (the engine's fetch + apply run in the driver's rollout thread, between
two generate calls, while the trainer trains on).
As the policy learns to stop, responses shorten (about 11 -> 5 tokens) and generation
gets cheaper, so the balance drifts toward training over a run. The quickstart's own
batch (``--batch-size 32 --n-samples 16 --max-new-tokens 7``) is training-bound (about
0.16 s of generation to 0.49 s of training), which caps what overlap can gain at about
1.4x. Nothing in the job is tuned toward the async side beyond that balance; the off-policy
correction is off (``[algorithm] off_policy = "none"``, the default; ``--off-policy tis``
adds async runs with one).

Per run, over the steps that ended within ``--budget`` seconds of the first step's start
(the actors' start-up is not counted): steps/s, generated tokens/s, the engine's idle
fraction (1 - seconds inside the engine's ``generate`` / wall-clock, alike for both modes)
and each step's reward_mean against wall-clock and against the step. ``reward`` compares
the learning curves over the steps both modes reached: the mean reward of each mode over
the last quarter of them, per seed. ``steps_per_s_ratio_per_seed``: each seed's async run
against the same seed's sync run (run next to each other). ``--keep DIR`` keeps the runs'
folders (metrics.jsonl per run) for a closer look.
Repeat r runs every mode with seed ``--seed + r``, so the spread across repeats is the
seed noise a curve has. The plot (``--plot``): reward (25-step moving mean) vs wall-clock
and vs step, one line per mode and seed, in docs/images/async_rl.png.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/async_rl.py [--budget 90] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from skyrl_host.testing import step_rows, tiny_rl_job

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def write_job(folder: pathlib.Path, name: str, args: argparse.Namespace, mode: str, k: int, seed: int,
              off_policy: str | None = None) -> pathlib.Path:
    job: dict[str, Any] = {
        "seed": seed, "steps": 100_000, "batch_size": args.batch_size, "n_samples": args.n_samples,
        "max_new_tokens": args.max_new_tokens, "threads": 1, "mode": mode,
    }
    if mode == "async":
        job["max_staleness"] = k
    made = tiny_rl_job(
        folder, name, job=job, cluster={"launcher": "ray", "num_cpus": args.cpus, "cpus_per_actor": 1.0},
        dataset={"min_len": 3, "max_len": 5}, engine={"dtype": "float32"}, backend={"lr": 5e-4},
        algorithm={"off_policy": off_policy, "off_policy_cap": 2.0 if off_policy in ("tis", "mis") else None}
        if off_policy else None,
        weight_sync=weight_sync(args.transport, folder / f"{name}_weights"),
    )
    return made.path


def weight_sync(transport: str, folder: pathlib.Path) -> dict[str, Any]:
    """``[weight_sync]`` of the runs: float32 on the wire (the engine scores as the trainer)."""
    if transport == "delta":
        return {"transport": "delta", "uri": folder.as_uri(), "dtype": "float32"}
    return {"transport": transport, "dtype": "float32"}


def run_for(path: pathlib.Path, out: pathlib.Path, budget: float, startup_limit: float = 300.0) -> list[dict]:
    """Run the job until ``budget`` seconds after its first step started, then interrupt it
    (SIGINT: the run closes its actors and Ray); the step rows that ended within it."""
    # SIGINT as the default in the run, even when this script runs in the background
    # (where a shell starts it with SIGINT ignored, which children inherit).
    proc = subprocess.Popen([SKYRL, "run", str(path)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline, start = time.time() + startup_limit, None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{path.name} ended early:\n{proc.stderr.read().decode()[-3000:]}")
            rows = step_rows(out) if (out / "metrics.jsonl").is_file() else []
            if start is None and rows:
                start = rows[0]["time"] - rows[0]["step_time"]
            now = time.time()
            if start is not None and now >= start + budget:
                break
            if start is None and now > deadline:
                raise RuntimeError(f"{path.name}: no step within {startup_limit} s")
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the driver alone: it stops its actors, then the Ray it started
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    rows = step_rows(out)
    t0 = rows[0]["time"] - rows[0]["step_time"]
    return [dict(r, wall=r["time"] - t0) for r in rows if r["time"] - t0 <= budget]


def summarize(rows: list[dict], budget: float, args: argparse.Namespace) -> dict[str, float]:
    seqs = args.batch_size * args.n_samples
    gen_tokens = [r["response_length_mean"] * seqs for r in rows]  # no refills: every step generates seqs samples
    gen_s = sum(t / r["gen_tokens_per_s"] for t, r in zip(gen_tokens, rows))
    train_s = sum(r["tokens"] / r["train_tokens_per_s"] for r in rows)
    out = {
        "steps": float(len(rows)),
        "steps_per_s": len(rows) / budget,
        "gen_tokens_per_s": sum(gen_tokens) / budget,
        "engine_idle_fraction": 1.0 - gen_s / budget,
        "gen_s_per_step": gen_s / len(rows),
        "train_s_per_step": train_s / len(rows),
        "step_time_s": statistics.median(r["step_time"] for r in rows),
    }
    if "staleness_mean" in rows[0]:
        out["staleness_mean"] = statistics.mean(r["staleness_mean"] for r in rows)
        out["rollout_wait_s_per_step"] = statistics.mean(r["rollout_wait_time_s"] for r in rows)
        out["publish_wait_s_per_step"] = statistics.mean(r["publish_wait_time_s"] for r in rows)
        out["sync_pause_s_per_step"] = statistics.mean(r.get("sync_pause_s", 0.0) for r in rows)
    return out


def reward_window(runs: dict[str, list[list[dict]]]) -> dict[str, Any]:
    """The learning curves compared over the steps every run reached: per mode, the mean
    reward over the last quarter of those steps for each repeat (seed), their mean and
    their standard deviation across seeds (the noise a mode's curve has)."""
    common = min(len(rows) for reps in runs.values() for rows in reps)
    lo = common - max(1, common // 4)
    out: dict[str, Any] = {"steps": [lo + 1, common]}
    for mode, reps in runs.items():
        per_seed = [statistics.mean(r["reward_mean"] for r in rows[lo:common]) for rows in reps]
        out[mode] = {"per_seed": per_seed, "mean": statistics.mean(per_seed),
                     "std_across_seeds": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0}
    return out


def plot(runs: dict[str, list[list[dict]]], path: pathlib.Path, title: str) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {mode: f"C{i}" for i, mode in enumerate(runs)}
    for mode, reps in runs.items():
        for i, rows in enumerate(reps):  # one line per seed, smoothed over 25 steps
            reward = np.convolve([r["reward_mean"] for r in rows], np.ones(25) / 25, mode="valid")
            label = mode if i == 0 else None
            by_time.plot([r["wall"] for r in rows][24:], reward, color=colors[mode], lw=1.0, alpha=0.8, label=label)
            by_step.plot([r["step"] for r in rows][24:], reward, color=colors[mode], lw=1.0, alpha=0.8, label=label)
    by_time.set_xlabel("wall-clock (s)")
    by_step.set_xlabel("step")
    for ax in (by_time, by_step):
        ax.set_ylabel("reward_mean (25-step mean)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=90.0, help="wall-clock seconds per run (after start-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2], help="the async runs' max_staleness")
    ap.add_argument("--off-policy", nargs="*", default=[],
                    help="also async runs (the first staleness) with [algorithm] off_policy = each of these, e.g. tis "
                    "(tis and mis with off_policy_cap = 2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1, help="repeat r runs every mode with seed + r")
    ap.add_argument("--cpus", type=int, default=2, help="[cluster] num_cpus (one per actor)")
    ap.add_argument("--transport", choices=("delta", "nixl", "broadcast"), default="delta",
                    help="the weight transport of every run (delta: a file:// folder)")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "images" / "async_rl.png"), help="'' for no plot")
    ap.add_argument("--keep", default="", help="a folder to keep the runs' output folders in (metrics.jsonl)")
    args = ap.parse_args()

    modes = [("sync", "sync", 0, None)] + [(f"async_k{k}", "async", k, None) for k in args.staleness]
    modes += [(f"async_k{args.staleness[0]}_{name}", "async", args.staleness[0], name) for name in args.off_policy]
    runs: dict[str, list[list[dict]]] = {name: [] for name, _, _, _ in modes}
    with tempfile.TemporaryDirectory(prefix="async_rl_") as tmp:
        folder = pathlib.Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for rep in range(args.repeats):
            for name, mode, k, off_policy in modes:  # alternated: sync, k=1, k=2, sync, ...
                path = write_job(folder, f"{name}_{rep}", args, mode, k, args.seed + rep, off_policy)
                rows = run_for(path, folder / f"{name}_{rep}", args.budget)
                runs[name].append(rows)
                print(f"{name} seed {args.seed + rep}: {len(rows)} steps in {args.budget:.0f} s", file=sys.stderr)
    per_mode = {}
    for name, reps in runs.items():
        sums = [summarize(rows, args.budget, args) for rows in reps]
        per_mode[name] = {key: statistics.median(s[key] for s in sums) for key in sums[0]}
        per_mode[name]["per_seed"] = {str(args.seed + rep): {key: round(v, 5) for key, v in s.items()}
                                      for rep, s in enumerate(sums)}
    sync = per_mode["sync"]
    result = {
        "job": {"preset": "tiny", "dataset": "reverse_digits (3-5 digits)", "batch_size": args.batch_size,
                "n_samples": args.n_samples, "max_new_tokens": args.max_new_tokens, "launcher": "ray",
                "actors": "1 engine + 1 backend, 1 CPU each, torch threads 1", "transport": f"{args.transport} (float32{', file' if args.transport == 'delta' else ''})",
                "budget_s": args.budget, "repeats": args.repeats, "cpus": os.cpu_count()},
        "balance": {"gen_s_per_step": sync["gen_s_per_step"], "train_s_per_step": sync["train_s_per_step"],
                    "sync_step_time_s": sync["step_time_s"],
                    # What perfect overlap would give: a step as long as its longer half.
                    "ideal_ratio": sync["step_time_s"] / max(sync["gen_s_per_step"], sync["train_s_per_step"])},
        "modes": per_mode,
        "steps_per_s_ratio": {name: per_mode[name]["steps_per_s"] / sync["steps_per_s"]
                              for name in per_mode if name != "sync"},
        # Each seed's async run against the same seed's sync run (alternated: run next to each other).
        "steps_per_s_ratio_per_seed": {
            name: [round(a["steps_per_s"] / b["steps_per_s"], 3) for a, b in
                   zip(per_mode[name]["per_seed"].values(), sync["per_seed"].values())]
            for name in per_mode if name != "sync"},
        "gen_tokens_per_s_ratio": {name: per_mode[name]["gen_tokens_per_s"] / sync["gen_tokens_per_s"]
                                   for name in per_mode if name != "sync"},
        "reward_last_quarter": reward_window(runs),
    }
    if args.plot:
        ratio = result["steps_per_s_ratio"]
        title = (f"reverse_digits, tiny Qwen3, Ray: 1 engine + 1 trainer actor, 1 CPU each; {args.budget:.0f} s each; "
                 + ", ".join(f"{n}: {v:.2f}x steps/s" for n, v in ratio.items()))
        plot(runs, pathlib.Path(args.plot), title)
        result["plot"] = args.plot
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The replay ablation: one job, four ways, and how far the trainer's logprobs are
from the engine's at every step.

    python examples/replay_ablation.py [--steps N] [--out DIR]

Runs ``examples/replay_ablation.toml`` (engine in bfloat16, trainer in float32, top-p
0.9, a tiny MoE) with ``[replay] strategies`` = [] ("none"), ["r3"], ["support"] and
["r3", "support"] ("both"), then "both" once more with the engine in float32 (the same
precision as the trainer). The gap is the backend's ``logprob_diff_mean`` / ``_max``:
|trainer logprob - engine logprob| over the generated tokens, measured before the
step's update. Writes ``ablation.json``, ``ablation.md`` (the table in docs/replay.md)
and ``ablation.png`` (mean and max gap per step) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).resolve().parent
JOB = HERE / "replay_ablation.toml"
RUNS = [
    ("none", "[]", "bfloat16"),
    ("r3", '["r3"]', "bfloat16"),
    ("support", '["support"]', "bfloat16"),
    ("both", '["r3", "support"]', "bfloat16"),
    ("both, same precision", '["r3", "support"]', "float32"),
]


def run_one(strategies: str, engine_dtype: str, steps: int, out: pathlib.Path) -> list[dict]:
    from skyrl_host.cli import main

    code = main([
        "run", str(JOB), "--overwrite",
        "--set", f"replay.strategies={strategies}",
        "--set", f'engine.dtype="{engine_dtype}"',
        "--set", f"job.steps={steps}",
        "--set", f'job.output_dir="{out}"',
    ])
    if code != 0:
        raise SystemExit(f"the run with strategies {strategies} failed (exit {code})")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "logprob_diff_mean" in r]


def summarise(rows: list[dict]) -> dict:
    return {
        "gap_mean": statistics.fmean(r["logprob_diff_mean"] for r in rows),
        "gap_max": max(r["logprob_diff_max"] for r in rows),
        "reward_first": rows[0]["reward_mean"],
        "reward_last5": statistics.fmean(r["reward_mean"] for r in rows[-5:]),
    }


def table(results: dict) -> str:
    base = results["none"]["gap_mean"]
    lines = [
        "| strategies | engine | mean gap | max gap | none / this (mean) | reward (first -> last 5) |",
        "|---|---|---|---|---|---|",
    ]
    for name, _, dtype in RUNS:
        s = results[name]
        lines.append(
            f"| {name} | {dtype} | {s['gap_mean']:.2e} | {s['gap_max']:.2e} | {base / max(s['gap_mean'], 1e-30):.1f}x "
            f"| {s['reward_first']:.3f} -> {s['reward_last5']:.3f} |"
        )
    return "\n".join(lines)


def plot(per_step: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for name, rows in per_step.items():
        steps = [r["step"] for r in rows]
        for ax, key in zip(axes, ("logprob_diff_mean", "logprob_diff_max")):
            ax.plot(steps, [max(r[key], 1e-12) for r in rows], label=name)
    for ax, title in zip(axes, ("mean |logprob gap| per step", "max |logprob gap| per step")):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/replay_ablation"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    per_step, results = {}, {}
    for name, strategies, dtype in RUNS:
        rows = run_one(strategies, dtype, args.steps, args.out / name.replace(", ", "_").replace(" ", "_"))
        per_step[name] = rows
        results[name] = summarise(rows)
    results["both_vs_none_mean_ratio"] = results["none"]["gap_mean"] / max(results["both"]["gap_mean"], 1e-30)
    (args.out / "ablation.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "ablation.md").write_text(table(results) + "\n")
    plot(per_step, args.out / "ablation.png")
    print(table(results))
    print(json.dumps({"both_vs_none_mean_ratio": results["both_vs_none_mean_ratio"],
                      "same_precision_gap_max": results["both, same precision"]["gap_max"]}))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""Claim: on-policy distillation from a stronger teacher reaches the teacher's reward in
fewer steps and less time than GRPO from the same start.

The quickstart's task (reverse digit strings; the tiny Qwen3 preset; examples/quickstart.toml
unchanged but for what is named here). First a teacher: the quickstart's GRPO run for
``--teacher-steps`` steps, saved as a folder. Then, for each seed, two students from the
same fresh start (the preset at that seed): ``opd`` with ``[teacher]`` naming the folder,
and ``grpo`` (the quickstart itself), each up to ``--student-steps`` (opd) or ``--grpo-steps`` (GRPO) steps, one after
the other, alone on the machine. For each run: the first step at which the trailing
``--window``-step mean reward reaches ``--target`` times the teacher's final mean, the
wall-clock seconds to that step (from the metrics' timestamps, after the first step), and
the final mean. Prints JSON; ``--plot PATH`` draws the curves (PNG).

    .venv/bin/python benchmarks/distillation.py --seeds 1 2 3 --plot docs/images/distillation.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def run(job: pathlib.Path, out: pathlib.Path, *sets: str) -> list[dict]:
    cmd = [SKYRL, "run", str(job), "--set", f'job.output_dir="{out}"', "--set", "job.checkpoint_every=0"]
    for value in sets:
        cmd += ["--set", value]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step" in r and "event" not in r and r["step"] > 0]


def reached(rows: list[dict], level: float, window: int) -> tuple[int | None, float | None]:
    rewards = [r["reward_mean"] for r in rows]
    for i in range(window - 1, len(rows)):
        if statistics.fmean(rewards[i - window + 1 : i + 1]) >= level:
            return rows[i]["step"], rows[i]["time"] - rows[0]["time"]
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--teacher-steps", type=int, default=1000)
    ap.add_argument("--student-steps", type=int, default=600, help="steps of each opd student")
    ap.add_argument("--grpo-steps", type=int, default=1500,
                    help="steps of each GRPO student (longer: GRPO needs more to reach the level, and its time to "
                    "reach it is what opd's is compared with)")
    ap.add_argument("--target", type=float, default=0.9, help="share of the teacher's final reward to reach")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--teacher", default=None, help="a finished quickstart run's output folder to teach with "
                    "(its final/ and metrics.jsonl) instead of training one")
    args = ap.parse_args()
    quickstart = ROOT / "examples" / "quickstart.toml"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        teacher = pathlib.Path(args.teacher) if args.teacher else tmp / "teacher"
        if args.teacher:
            rows = [json.loads(line) for line in (teacher / "metrics.jsonl").read_text().splitlines()]
            teacher_rows = [r for r in rows if "step" in r and "event" not in r and r["step"] > 0]
        else:
            teacher_rows = run(quickstart, teacher, f"job.steps={args.teacher_steps}", "job.seed=0")
        teacher_final = statistics.fmean(r["reward_mean"] for r in teacher_rows[-20:])
        level = args.target * teacher_final
        opd_job = tmp / "opd.toml"
        opd_job.write_text(quickstart.read_text().replace('name = "grpo"', 'name = "opd"')
                           + f'\n[teacher]\nfamily = "qwen"\npath = "{teacher / "final"}"\n')
        runs: dict[str, dict[int, list[dict]]] = {"opd": {}, "grpo": {}}
        for seed in args.seeds:
            sets = (f"job.seed={seed}", "job.save_final=false")
            runs["opd"][seed] = run(opd_job, tmp / f"opd-{seed}", f"job.steps={args.student_steps}", *sets)
            runs["grpo"][seed] = run(quickstart, tmp / f"grpo-{seed}", f"job.steps={args.grpo_steps}", *sets)
        table = {}
        for name, by_seed in runs.items():
            table[name] = {}
            for seed, rows in by_seed.items():
                step, seconds = reached(rows, level, args.window)
                table[name][seed] = {"step": step, "seconds": None if seconds is None else round(seconds, 1),
                                     "final_mean": round(statistics.fmean(r["reward_mean"] for r in rows[-20:]), 3)}
        ratios = [table["grpo"][s]["step"] / table["opd"][s]["step"] for s in args.seeds
                  if table["grpo"][s]["step"] and table["opd"][s]["step"]]
        time_ratios = [table["grpo"][s]["seconds"] / table["opd"][s]["seconds"] for s in args.seeds
                       if table["grpo"][s]["seconds"] and table["opd"][s]["seconds"]]
        print(json.dumps({
            "claim": "opd reaches the teacher's reward in fewer steps and less time than grpo from the same start",
            "teacher": {"steps": len(teacher_rows), "final_mean": round(teacher_final, 3)},
            "level": round(level, 3), "window": args.window, "student_steps": {"opd": args.student_steps, "grpo": args.grpo_steps},
            "runs": table,
            "steps_ratio_grpo_over_opd": {"median": statistics.median(ratios) if ratios else None, "per_seed": ratios},
            "time_ratio_grpo_over_opd": {"median": statistics.median(time_ratios) if time_ratios else None,
                                         "per_seed": time_ratios},
            "not_reached": [f"{n} seed {s}" for n in table for s in table[n] if table[n][s]["step"] is None],
        }, indent=2))
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4))
            colors = {"opd": "tab:orange", "grpo": "tab:blue"}
            for name, by_seed in runs.items():
                for i, (seed, rows) in enumerate(by_seed.items()):
                    ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], color=colors[name], lw=1,
                            alpha=0.8, label=name if i == 0 else None)
            ax.axhline(teacher_final, color="gray", ls="--", lw=1, label=f"teacher ({teacher_final:.2f})")
            ax.axhline(level, color="gray", ls=":", lw=1, label=f"target ({level:.2f})")
            ax.set_xlabel("step")
            ax.set_ylabel("reward_mean")
            ax.set_title(f"on-policy distillation vs GRPO from the same start, seeds {args.seeds}")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()

"""At the end of a job, ``<output_dir>/plot.png``: the headline metrics and the
other key curves against the step, one panel each, and (with ``[eval]``) one panel of
the evaluation's pass@k curves, a marker per evaluation."""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from skyrl_host import hookimpl
from skyrl_host.observers.metrics_jsonl import FILENAME, read_metrics

PLOT = "plot.png"
MAX_PANELS = 9
# Shown after the job's headline metrics, when present.
KEY_CURVES = (
    "reward_mean",
    "accuracy",
    "loss",
    "entropy",
    "kl",
    "clip_fraction",
    "response_length_mean",
    "logprob_diff_mean",
    "grad_norm",
)


_EVAL_PASS = re.compile(r"^eval/pass_at_(\d+)$")  # the evaluation's overall pass@k


def plot_metrics(rows: list[dict[str, Any]], names: Sequence[str | tuple[str, list[str]]], path: Any,
                 title: str) -> None:
    """One panel per entry of ``names``: a metric, or ``(title, [metrics])`` drawn together
    (with markers: an evaluation's few points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(names))
    nrows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        if isinstance(name, tuple):
            panel, curves = name
            for curve in curves:
                pts = [(r["step"], r[curve]) for r in rows if isinstance(r.get(curve), (int, float))]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1.2,
                        label=curve.removeprefix("eval/").replace("_at_", "@"))
            ax.legend(fontsize=7)
            ax.set_title(panel, fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
            continue
        pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        if len(pts) >= 10:  # a moving average makes noisy RL curves readable
            k = max(2, len(pts) // 20)
            ys = [p[1] for p in pts]
            avg = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
            ax.plot([p[0] for p in pts], avg, lw=2.0, alpha=0.8)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


@hookimpl
def skyrl_job_finished(run: Any, status: str, error: BaseException | None) -> None:
    path = run.output_dir / FILENAME
    if not path.exists():
        return
    rows = read_metrics(path)
    if not rows:
        return
    present = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
    evals = sorted((n for n in present if _EVAL_PASS.match(n)), key=lambda n: int(_EVAL_PASS.match(n).group(1)))
    room = MAX_PANELS - (1 if evals else 0)
    names: list[Any] = [n for n in list(dict.fromkeys([*run.headline, *KEY_CURVES])) if n in present][:room]
    if not names and not evals:
        names = sorted(present)[:MAX_PANELS]
    if evals:
        names.append(("evaluation (held out)", evals))
    if names:
        plot_metrics(rows, names, run.output_dir / PLOT, f"{run.spec.name} ({status}, {rows[-1]['step']} steps)")

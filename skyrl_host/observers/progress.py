"""A rich progress bar on stderr: steps, rate, ETA and the headline metrics."""

from __future__ import annotations

from typing import Any, Mapping

from skyrl_host import hookimpl

KEY = "progress"
SHOWN = 3


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@hookimpl
def skyrl_job_started(run: Any) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(compact=True),
        TextColumn("{task.fields[metrics]}"),
        console=Console(stderr=True),
        transient=False,
    )
    progress.start()
    task = progress.add_task(run.spec.name, total=run.total_steps, completed=run.resume_step, rate="", metrics="")
    run.scratch[KEY] = (progress, task)


@hookimpl
def skyrl_step_finished(run: Any, step: int, metrics: Mapping[str, Any]) -> None:
    progress, task = run.scratch[KEY]
    names = [n for n in run.headline if n in metrics] or list(metrics)
    shown = "  ".join(f"{n}={_fmt(metrics[n])}" for n in names[:SHOWN])
    progress.update(task, completed=step, metrics=shown)
    speed = progress.tasks[0].speed
    progress.update(task, rate=f"{speed:.2f} step/s" if speed else "")


@hookimpl
def skyrl_job_finished(run: Any, status: str, error: BaseException | None) -> None:
    got = run.scratch.pop(KEY, None)
    if got is not None:
        got[0].stop()

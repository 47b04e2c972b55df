"""Logs the run to Weights & Biases when the job says ``[job] wandb = true`` (needs
``pip install 'skyrl-host[wandb]'``).

The resolved job (``job.json``) is the run's config, every step's metrics are logged at
their step, and the final status goes to the run's summary (``skyrl_status``); the run is
finished on ``skyrl_job_finished`` (exit code 1 unless the job completed). The W&B run id
is kept in ``<output_dir>/wandb_run_id`` so ``skyrl run --resume`` continues the same run.
W&B's local files go to ``<output_dir>/wandb`` (``[job] wandb_mode = "offline"`` keeps the
run there for ``wandb sync``). wandb is imported only here, when a job asks for it.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any, Mapping

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError

KEY = "wandb"
FOLDER = "wandb"
RUN_ID_FILE = "wandb_run_id"


def _job_record(run: Any) -> dict[str, Any]:
    path = run.output_dir / "job.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _run_id(run: Any) -> str:
    path = run.output_dir / RUN_ID_FILE
    if run.resuming and path.exists():
        kept = path.read_text(encoding="utf-8").strip()
        if kept:
            return kept
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id style
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


@hookimpl
def skyrl_job_started(run: Any) -> None:
    job = run.spec.job
    if not job.wandb:
        return
    try:
        import wandb
    except ImportError:
        raise UserError(
            Problem(
                "wandb = true needs wandb: pip install \"skyrl-host[wandb]\"",
                file=str(run.spec.path),
                key="job.wandb",
            )
        ) from None
    folder = run.output_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    wb = wandb.init(
        project=job.wandb_project,
        name=run.spec.name,
        id=_run_id(run),
        resume="allow",
        dir=str(run.output_dir),
        mode=job.wandb_mode,
        settings=wandb.Settings(console="off", silent=True),
        reinit="create_new",
    )
    wb.config.update(_job_record(run), allow_val_change=True)
    run.scratch[KEY] = wb


@hookimpl
def skyrl_step_finished(run: Any, step: int, metrics: Mapping[str, Any]) -> None:
    wb = run.scratch.get(KEY)
    # W&B's steps only increase: a resumed online run starts after the steps it holds.
    if wb is not None and step >= wb.step:
        wb.log(dict(metrics), step=step)


@hookimpl
def skyrl_job_finished(run: Any, status: str, error: BaseException | None) -> None:
    wb = run.scratch.pop(KEY, None)
    if wb is None:
        return
    wb.summary["skyrl_status"] = status
    wb.summary["skyrl_last_step"] = run.last_step
    if error is not None:
        wb.summary["skyrl_error"] = f"{type(error).__name__}: {error}"
    wb.finish(exit_code=0 if status == "completed" else 1)

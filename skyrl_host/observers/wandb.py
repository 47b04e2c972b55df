"""Logs the run to Weights & Biases when the job lists the observer (``[observers] use =
["wandb"]``; its keys in ``[observers.wandb]``; needs ``pip install 'skyrl-host[wandb]'``).

The resolved job (``job.json``) is the run's config, every step's metrics are logged at
their step, and the final status goes to the run's summary (``skyrl_status``); the run is
finished on ``skyrl_job_finished`` (exit code 1 unless the job completed). The W&B run id
is kept in ``<output_dir>/wandb_run_id`` so ``skyrl run --resume`` continues the same run.
W&B's local files go to ``<output_dir>/wandb`` (``mode = "offline"`` keeps the run there
for ``wandb sync``). wandb is imported only here, when a job asks for it.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any, Literal, Mapping

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError
from skyrl_host.options import option

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


@attrs.frozen
class WandbOptions:
    project: str = option("skyrl", help="the W&B project of the run")
    mode: Literal["online", "offline"] = option(
        "online", help="online, or offline (the run stays in <output_dir>/wandb; `wandb sync` uploads it)"
    )


class Wandb:
    def __init__(self, config: WandbOptions) -> None:
        self.config = config
        self.wb: Any = None

    def started(self, run: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError(
                Problem(
                    "the wandb observer needs wandb: pip install \"skyrl-host[wandb]\"",
                    file=str(run.spec.path),
                    key="observers.use",
                )
            ) from None
        (run.output_dir / FOLDER).mkdir(parents=True, exist_ok=True)
        self.wb = wandb.init(
            project=self.config.project,
            name=run.spec.name,
            id=_run_id(run),
            resume="allow",
            dir=str(run.output_dir),
            mode=self.config.mode,
            settings=wandb.Settings(console="off", silent=True),
            reinit="create_new",
        )
        self.wb.config.update(_job_record(run), allow_val_change=True)

    def step_finished(self, run: Any, step: int, metrics: Mapping[str, Any]) -> None:
        # W&B's steps only increase: a resumed online run starts after the steps it holds.
        if step >= self.wb.step:
            self.wb.log(dict(metrics), step=step)

    def finished(self, run: Any, status: str, error: BaseException | None) -> None:
        self.wb.summary["skyrl_status"] = status
        self.wb.summary["skyrl_last_step"] = run.last_step
        if error is not None:
            self.wb.summary["skyrl_error"] = f"{type(error).__name__}: {error}"
        self.wb.finish(exit_code=0 if status == "completed" else 1)


@hookimpl
def skyrl_register_observers(register: Any) -> None:
    register("wandb", Wandb, config=WandbOptions, description="a Weights & Biases run (pip install \"skyrl-host[wandb]\")")

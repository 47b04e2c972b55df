"""TensorBoard event files in ``<output_dir>/tensorboard`` when the job says
``[job] tensorboard = true`` (needs ``pip install 'skyrl-host[tensorboard]'``)."""

from __future__ import annotations

from typing import Any, Mapping

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError

KEY = "tensorboard"
FOLDER = "tensorboard"


@hookimpl
def skyrl_job_started(run: Any) -> None:
    if not run.spec.job.tensorboard:
        return
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise UserError(
            Problem(
                "tensorboard = true needs tensorboardX: pip install 'skyrl-host[tensorboard]'",
                file=str(run.spec.path),
                key="job.tensorboard",
            )
        ) from None
    run.scratch[KEY] = SummaryWriter(logdir=str(run.output_dir / FOLDER), purge_step=run.resume_step + 1 if run.resuming else None)


@hookimpl
def skyrl_step_finished(run: Any, step: int, metrics: Mapping[str, Any]) -> None:
    writer = run.scratch.get(KEY)
    if writer is None:
        return
    for name, value in metrics.items():
        writer.add_scalar(name, value, global_step=step)
    writer.flush()


@hookimpl
def skyrl_job_finished(run: Any, status: str, error: BaseException | None) -> None:
    writer = run.scratch.pop(KEY, None)
    if writer is not None:
        writer.close()

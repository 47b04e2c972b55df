"""TensorBoard event files in ``<output_dir>/tensorboard`` when the job lists the
observer: ``[observers] use = ["tensorboard"]`` (needs ``pip install
'skyrl-host[tensorboard]'``). On ``--resume`` the events after the resumed step are
purged, so a step is never shown twice."""

from __future__ import annotations

from typing import Any, Mapping

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError

FOLDER = "tensorboard"


class TensorBoard:
    def __init__(self, config: None = None) -> None:
        self.writer: Any = None

    def started(self, run: Any) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise UserError(
                Problem(
                    "the tensorboard observer needs tensorboardX: pip install 'skyrl-host[tensorboard]'",
                    file=str(run.spec.path),
                    key="observers.use",
                )
            ) from None
        self.writer = SummaryWriter(
            logdir=str(run.output_dir / FOLDER), purge_step=run.resume_step + 1 if run.resuming else None
        )

    def step_finished(self, run: Any, step: int, metrics: Mapping[str, Any]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def finished(self, run: Any, status: str, error: BaseException | None) -> None:
        self.writer.close()


@hookimpl
def skyrl_register_observers(register: Any) -> None:
    register("tensorboard", TensorBoard, description="TensorBoard event files in <output_dir>/tensorboard")

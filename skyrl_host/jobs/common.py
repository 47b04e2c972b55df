"""What the job drivers share: the step loop and the random state in a checkpoint."""

from __future__ import annotations

import pathlib
import random
from typing import Any, Mapping, Protocol


def save_rng(path: pathlib.Path) -> None:
    """torch's, Python's and numpy's global random state, to ``path`` (a state file:
    :mod:`skyrl_host.statefile`)."""
    import numpy as np
    import torch

    from skyrl_host.statefile import save_state

    save_state({"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "numpy_rng": np.random.get_state()}, path)


def restore_rng(state: Any, where: pathlib.Path) -> None:
    """Set the random states :func:`save_rng` saved; a state that does not fit is a user error."""
    import numpy as np
    import torch

    from skyrl_host.errors import UserError

    try:
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise UserError(f"--resume: the random states in {where} do not fit ({type(exc).__name__}: {exc})") from None


class StepDriver(Protocol):
    """What :func:`run_steps` calls: a driver of one job kind, step by step."""

    run_: Any  # the skyrl_host.runner.Run
    cfg: Any  # the kind's config: checkpoint_every, save_final
    start_step: int  # set by build(): 1, or the step after the checkpoint resumed from

    def build(self) -> None: ...

    def step(self, step: int) -> Mapping[str, float]: ...

    def save_checkpoint(self, step: int) -> None: ...

    def save_final(self) -> None: ...

    def close(self) -> None: ...


def run_steps(driver: StepDriver) -> None:
    """The loop every driver runs: ``build()``, then each step from ``start_step``
    (reported; a NaN ``loss*`` or ``grad*`` metric stops the job), a checkpoint every
    ``checkpoint_every`` steps and at the end, the final model when ``save_final``;
    ``close()`` whatever happens."""
    import math

    run, cfg = driver.run_, driver.cfg
    try:
        driver.build()
        for step in range(driver.start_step, run.total_steps + 1):
            metrics = driver.step(step)
            bad = [k for k, v in metrics.items() if isinstance(v, float) and math.isnan(v) and k.startswith(("loss", "grad"))]
            if bad:
                raise FloatingPointError(f"step {step}: {bad[0]} is NaN")
            run.report(step, metrics)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < run.total_steps:
                driver.save_checkpoint(step)
        driver.save_checkpoint(run.total_steps)
        if cfg.save_final:
            driver.save_final()
    finally:
        driver.close()

"""What the job drivers share: the precision handed to plugins, the random state in a
checkpoint, and the final model folder."""

from __future__ import annotations

import pathlib
import random
from typing import Any

from skyrl_host.errors import UserError


def precision_kwargs(start: Any, precision: Any, what: str) -> dict[str, Any]:
    """``{"precision": precision}`` for a ``start`` method that takes one; nothing for one
    that does not, unless the precision quantizes (then a user error: the job asks for
    something the plugin cannot do)."""
    import inspect

    if "precision" in inspect.signature(start).parameters:
        return {"precision": precision}
    if getattr(precision, "quantizes", False):
        raise UserError(f"[precision] name = {precision.name!r}: the {what} plugin takes no precision (it cannot "
                        "compute or serve quantized weights)")
    return {}


def save_rng(path: pathlib.Path) -> None:
    """torch's, Python's and numpy's global random state, to ``path``."""
    import numpy as np
    import torch

    torch.save({"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "numpy_rng": np.random.get_state()}, path)


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])


def save_trained_model(backend: Any, family: Any, loaded: Any, path: str, trained: dict[str, Any] | None = None) -> None:
    """The backend's trained weights as a Hugging Face folder at ``path`` (through the
    family, into ``loaded``'s model), with a LoRA backend's adapters beside it.
    ``trained``: the backend's ``named_weights()`` when the caller already gathered them."""
    import torch

    trained = dict(backend.named_weights()) if trained is None else trained
    with torch.no_grad():
        for name, param in loaded.model.state_dict().items():
            if name in trained and trained[name].data_ptr() != param.data_ptr():
                param.copy_(trained[name])
    family.save(loaded, path)
    adapter = getattr(backend, "adapter_config", None)
    if callable(adapter) and adapter() is not None:  # LoRA: the adapters beside the merged model
        backend.save_adapters(path)


def run_steps(driver: Any) -> None:
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
                driver._save_checkpoint(step)
        driver._save_checkpoint(run.total_steps)
        if cfg.save_final:
            driver._save_final()
    finally:
        driver.close()

"""``[precision] name = "bf16"`` (the default): no quantization. The backend computes as
its own options say (``compute_dtype``) and the transport ships the weights in its wire
dtype.

A job that uses it needs no torchao: when it starts, transformers is told torchao is
not there (``_torchao.hide_from_transformers``), so its import costs nothing and
prints nothing."""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_precisions._options import create


@attrs.frozen
class Bf16Config:
    """``bf16`` takes no options."""


@hookimpl
def skyrl_register_precisions(register: Any) -> None:
    register("bf16", create("bf16"), config=Bf16Config, description="No quantization: the backend's own dtype, bf16 on the wire")


@hookimpl
def skyrl_job_started(run: Any) -> None:
    """Before the driver imports transformers: keep it from importing torchao."""
    choice = getattr(run.spec, "plugins", {}).get("precision")
    if choice is not None and not isinstance(choice, tuple) and choice.name == "bf16":
        from skyrl_precisions._torchao import hide_from_transformers

        hide_from_transformers()

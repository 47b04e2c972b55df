"""``[precision] name = "bf16"`` (the default): no quantization. The backend computes as
its own options say (``compute_dtype``) and the transport ships the weights in its wire
dtype."""

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

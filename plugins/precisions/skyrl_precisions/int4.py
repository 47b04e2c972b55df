"""``[precision] name = "int4"``: group-wise symmetric INT4 weights (groups of 32 along
the input dimension, float32 scales), activations in the compute dtype: rollout on an
int4 base with a fake-quantized trainer (the recipe for 1T-parameter Kimi K2 models on
few nodes). With ``[backend] lora_rank > 0`` the adapters train on the frozen int4 base.
Layers whose input dimension is not a multiple of 32 stay in high precision."""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_precisions._options import check, create, keep_option


@attrs.frozen
class Int4Config:
    keep: list[str] = keep_option()


@hookimpl
def skyrl_register_precisions(register: Any) -> None:
    register("int4", create("int4"), config=Int4Config,
             description="Group-wise symmetric INT4 weights (groups of 32, float32 scales), weight-only", check=check)

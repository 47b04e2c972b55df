"""``[precision] name = "fp8"``: blockwise FP8 (e4m3) with float32 scales, 128x128
blocks for weights and 1x128 tiles for activations (DeepSeek-V3's recipe). The trainer
fake-quantizes the chosen layers (straight-through gradients, float32 master weights);
the sender ships the e4m3 payload and the block scales; the engine dequantizes them."""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import option
from skyrl_precisions._options import check, create, keep_option


@attrs.frozen
class Fp8Config:
    activations: bool = option(True, help="also fake-quantize the chosen layers' input activations (1x128 tiles)")
    keep: list[str] = keep_option()


@hookimpl
def skyrl_register_precisions(register: Any) -> None:
    register("fp8", create("fp8"), config=Fp8Config,
             description="Blockwise FP8 e4m3: 128x128 weight blocks, 1x128 activation tiles, float32 scales", check=check)

"""``[precision] name = "mxfp8"``: MXFP8 (OCP microscaling), e4m3 values in 32-element
blocks along the input dimension with e8m0 (power-of-two) scales, for weights and
activations (torchao's ``MXTensor``). Layers whose input dimension is not a multiple of
32 stay in high precision.

``kernels``: ``"emulated"`` fake-quantizes the chosen layers (any device);
``"torchao"`` runs their matmuls in MXFP8 through torchao, which needs a Blackwell GPU
(SM100); stacked MoE expert parameters stay emulated. ``"auto"`` takes torchao's
kernels only on such a GPU."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import option
from skyrl_precisions._options import check, check_kernels, create, keep_option, kernels_option


@attrs.frozen
class Mxfp8Config:
    activations: bool = option(True, help="also fake-quantize the chosen layers' input activations (32-element blocks)")
    keep: list[str] = keep_option()
    kernels: Literal["auto", "torchao", "emulated"] = kernels_option("a Blackwell GPU, SM100")

    def __attrs_post_init__(self) -> None:
        check_kernels(self)


@hookimpl
def skyrl_register_precisions(register: Any) -> None:
    register("mxfp8", create("mxfp8"), config=Mxfp8Config,
             description="MXFP8: e4m3 values in 32-element blocks with e8m0 power-of-two scales", check=check)

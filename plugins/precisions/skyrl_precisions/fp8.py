"""``[precision] name = "fp8"``: FP8 (e4m3) weights and activations with float32 scales.

``scaling`` picks the scales: ``"blockwise"`` (the default) 128x128 blocks for weights
and 1x128 tiles for activations (DeepSeek-V3's recipe); ``"rowwise"`` one power-of-two
scale per row, a weight's output row and an activation's token (torchao's rowwise
float8 training recipe). The scaling decides the numerics everywhere: the trainer's
forward, the payload and scales the sender ships, and the engine's activations.

``kernels`` picks how the trainer computes: fake quantization (``"emulated"``: float32
masters, the quantized values in the compute dtype, straight-through gradients) or
torchao's float8 training (``"torchao"``: real FP8 matmuls, forward and backward, on the
chosen ``nn.Linear`` layers: rowwise on a CUDA GPU of compute capability 8.9 or newer,
or, slowly (for tests), on the CPU; blockwise on Hopper (SM90) with triton). Stacked
MoE expert parameters stay emulated in every mode. ``"auto"`` takes torchao's kernels
where the trainer's model is on a GPU that has them."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import option
from skyrl_precisions._options import check, check_kernels, create, keep_option, kernels_option


@attrs.frozen
class Fp8Config:
    activations: bool = option(True, help="also quantize the chosen layers' input activations (1x128 tiles, or rows "
                               "with scaling = \"rowwise\")")
    keep: list[str] = keep_option()
    scaling: Literal["blockwise", "rowwise"] = option(
        "blockwise",
        help="'blockwise': a float32 scale per 128x128 weight block and per 1x128 activation tile (amax / 448); "
        "'rowwise': a power-of-two scale per row (a weight's output row, an activation's token), torchao's rowwise "
        "float8 recipe; the trainer, the wire format and the engine all follow it",
    )
    kernels: Literal["auto", "torchao", "emulated"] = kernels_option(
        "rowwise: a CUDA GPU of compute capability 8.9 or newer, or slowly the CPU; blockwise: Hopper SM90 with triton")

    def __attrs_post_init__(self) -> None:
        check_kernels(self)


@hookimpl
def skyrl_register_precisions(register: Any) -> None:
    register("fp8", create("fp8"), config=Fp8Config,
             description="FP8 e4m3 with float32 scales: 128x128 weight blocks and 1x128 activation tiles, or rowwise; "
             "fake-quantized or torchao's FP8 matmuls", check=check)

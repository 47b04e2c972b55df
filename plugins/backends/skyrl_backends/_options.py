"""The options both training backends take (optimizer, schedule, packing, device, dtype):
:class:`TrainerOptions`, the base of ``TorchBackendConfig`` and ``MegatronBackendConfig``.
Imports neither torch nor megatron."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_toolkit.devices import check_device
from skyrl_host.options import OptionError, ge, gt, in_interval, option


def _betas(_inst: Any, _attr: Any, value: tuple[float, float]) -> None:
    if not all(0.0 <= b < 1.0 for b in value):
        raise ValueError(f"expected two values in [0, 1), found {list(value)!r}")


_betas.__doc__ = "each in [0, 1)"


@attrs.frozen
class TrainerOptions:
    """AdamW, its schedule, sequence packing, the device and the compute dtype."""

    lr: float = option(1e-3, help="peak learning rate of AdamW", validator=gt(0))
    weight_decay: float = option(
        0.0, help="AdamW decoupled weight decay (matrices only; norms and biases never decay)", validator=ge(0)
    )
    betas: tuple[float, float] = option((0.9, 0.999), help="AdamW betas [beta1, beta2]", validator=_betas)
    eps: float = option(1e-8, help="AdamW epsilon", validator=gt(0))
    schedule: Literal["constant", "cosine"] = option(
        "constant", help="learning-rate schedule after the warmup: 'constant' or 'cosine' decay to min_lr_ratio * lr"
    )
    warmup_steps: int = option(
        0, help="optimizer updates of linear warmup: update k (1-based) of the first N uses lr * k / (N + 1)", validator=ge(0)
    )
    min_lr_ratio: float = option(0.0, help="the cosine schedule's final learning rate, as a fraction of lr", validator=in_interval(0, 1))
    max_grad_norm: float = option(1.0, help="clip the global gradient norm to this value (0 = no clipping)", validator=ge(0))
    micro_batch_tokens: int = option(
        4096,
        help="token budget of one packed micro-batch (whole sequences; a longer sequence goes alone)",
        validator=gt(0),
    )
    pack_length: int = option(
        256,
        help="row length a micro-batch is packed into (whole sequences per row; a longer sequence gets its own row): "
        "attention costs pack_length^2 per row, not micro_batch_tokens^2",
        validator=gt(0),
    )
    mini_batches: int = option(1, help="optimizer updates per step: the batch's sequences are split into this many", validator=gt(0))
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass to save memory")
    device: str = option(
        "auto",
        help="where the trainer computes: 'auto' (CUDA when present, else the CPU; a rank's own GPU under data "
        "parallel with NCCL), 'cpu', 'cuda' or 'cuda:N'",
        validator=check_device,
    )
    compute_dtype: Literal["float32", "bfloat16"] = option(
        "float32", help="'bfloat16': autocast the forward in bf16 with float32 master weights"
    )

    def __attrs_post_init__(self) -> None:
        if self.min_lr_ratio != 0.0 and self.schedule != "cosine":
            raise OptionError("min_lr_ratio", f"only applies to schedule = \"cosine\" (schedule is {self.schedule!r})")


def context_parallel_problem(cfg: Any, mla: bool | None) -> str | None:
    """Why ``context_parallel > 1`` cannot run with these options (None: it can): it is built
    with tensor parallelism and data-parallel replicas; not with pipeline or expert
    parallelism, nor with multi-latent attention (``mla``; None: not known yet), which
    megatron-core rotates by the row's own slot numbers."""
    cp = cfg.context_parallel
    for key in ("pipeline_parallel", "expert_parallel"):
        if getattr(cfg, key) > 1:
            return f"context_parallel = {cp} with {key} = {getattr(cfg, key)} is not built (context parallelism runs " \
                   "with tensor_parallel and data-parallel replicas)"
    if mla:
        return f"context_parallel = {cp} is not built for multi-latent attention (DeepSeek-V3, Kimi K2): megatron-core's " \
               "MLA rotates by each slot's number in the row, which context parallelism splits"
    return None

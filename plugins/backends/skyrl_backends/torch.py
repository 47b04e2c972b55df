"""torch: the PyTorch training backend (``[backend] name = "torch"``).

One process, or data parallel across processes (DDP or FSDP2) when the launcher
has initialised ``torch.distributed`` (gloo on CPU, NCCL on GPU). Sequences are
packed into micro-batches of at most ``micro_batch_tokens`` tokens, laid out in
rows of at most ``pack_length`` tokens, with positions restarting at 0 for every
sequence, so attention never crosses a sequence boundary. See docs/backends.md.

This module only declares the options and registers the backend: it imports
neither torch nor transformers (the implementation lives in
``skyrl_backends._trainer`` and the modules beside it, and is imported by the
factory; other distributions reach it through ``skyrl_backends.torch_backend``).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.devices import check_device, cuda_problem
from skyrl_host.options import OptionError, ge, gt, in_interval, option


def _betas(_inst: Any, _attr: Any, value: tuple[float, float]) -> None:
    if not all(0.0 <= b < 1.0 for b in value):
        raise ValueError(f"expected two values in [0, 1), found {list(value)!r}")


_betas.__doc__ = "each in [0, 1)"


@attrs.frozen
class TorchBackendConfig:
    """Options of ``[backend]`` when ``name = "torch"``."""

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
    data_parallel: Literal["none", "ddp", "fsdp2"] = option(
        "none", help="'ddp' or 'fsdp2' across the processes of an initialised torch.distributed group"
    )
    lora_rank: int = option(
        0, help="LoRA rank: > 0 freezes the base weights and trains low-rank adapters on lora_targets; 0 = full fine-tuning",
        validator=ge(0),
    )
    lora_alpha: float = option(16.0, help="LoRA alpha: the adapters' output is scaled by lora_alpha / lora_rank", validator=gt(0))
    lora_dropout: float = option(
        0.0, help="dropout on the adapters' input while training (the engine never drops)", validator=in_interval(0, 1, high_open=True)
    )
    lora_targets: list[str] | None = option(
        None,
        help="names of the nn.Linear modules LoRA adapts (the last component of the module path, e.g. \"q_proj\"); "
        "default: the model family's lora_targets",
    )

    def __attrs_post_init__(self) -> None:
        if self.min_lr_ratio != 0.0 and self.schedule != "cosine":
            raise OptionError("min_lr_ratio", f"only applies to schedule = \"cosine\" (schedule is {self.schedule!r})")
        if self.lora_rank == 0:
            for key, value, default in (("lora_targets", self.lora_targets, None), ("lora_dropout", self.lora_dropout, 0.0)):
                if value != default:
                    raise OptionError(key, "only applies with lora_rank > 0 (lora_rank = 0 trains every weight)")
        if self.lora_targets is not None:
            bad = [t for t in self.lora_targets if not isinstance(t, str) or not t or "." in t]
            if bad or not self.lora_targets:
                raise OptionError(
                    "lora_targets", f"expected a non-empty list of module names without dots (e.g. [\"q_proj\", \"v_proj\"]), "
                    f"found {self.lora_targets!r}"
                )


def create(config: TorchBackendConfig) -> Any:
    """The factory: a :class:`skyrl_host.interfaces.Backend` (imports torch)."""
    from skyrl_backends._trainer import TorchBackend

    return TorchBackend(config)


def check(spec: Any) -> list[tuple[str, str]]:
    """Several backend ranks train data parallel: ``data_parallel`` must say how; a
    CUDA ``device`` needs CUDA on this machine."""
    choice = spec.plugins.get("backend")
    ranks = spec.cluster.trainer_ranks
    if choice is not None and getattr(spec.cluster, "launcher", "local") != "ray":  # ray: each actor checks its own
        problem = cuda_problem(choice.config.device)
        if problem is not None:
            return [("backend.device", problem)]
    if ranks > 1 and choice is not None and choice.config.data_parallel == "none":
        return [("backend.data_parallel", f"[cluster] trainer_ranks = {ranks} trains data parallel: "
                 "set data_parallel = \"ddp\" or \"fsdp2\"")]
    return []


@hookimpl
def skyrl_register_backends(register: Any) -> None:
    register(
        "torch",
        create,
        config=TorchBackendConfig,
        description="PyTorch trainer: packed micro-batches, AdamW, bf16 autocast, DDP or FSDP2 data parallel",
        check=check,
    )

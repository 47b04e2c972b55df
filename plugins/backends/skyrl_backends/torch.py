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

from skyrl_backends._options import TrainerOptions
from skyrl_host import hookimpl
from skyrl_toolkit.devices import cuda_problem
from skyrl_host.interfaces import BackendTraits
from skyrl_host.options import OptionError, ge, gt, in_interval, option


@attrs.frozen
class TorchBackendConfig(TrainerOptions):
    """Options of ``[backend]`` when ``name = "torch"``."""

    data_parallel: Literal["none", "ddp", "fsdp2"] = option(
        "none", help="'ddp' or 'fsdp2' across the processes of an initialised torch.distributed group"
    )
    flat_rows: Literal["auto", "long", "always", "never"] = option(
        "auto",
        help="when a micro-batch is laid out as one flat row with attention per sequence (no padding, no mask; "
        "only on models the start-up probe accepts, else padded rows): 'long' when it holds a sequence longer "
        "than pack_length, 'always', 'never', or 'auto' (= 'always' when the trainer computes on the CPU, "
        "'long' on an accelerator)",
    )
    share_prompts: bool = option(
        True,
        help="in a flat row, the consecutive samples of one prompt share its tokens: the prompt is computed once "
        "and each sample attends to it (the same loss and gradients, less compute: 8 samples of a 44-token prompt "
        "and ~28-token answers train on 268 tokens instead of 576); off with replay strategies",
    )
    compute_weights: Literal["copy", "autocast"] = option(
        "copy",
        help="with compute_dtype = 'bfloat16': 'copy' casts the float32 master weights to a bf16 copy once per "
        "optimizer update and runs the forward in bf16 (gradients accumulate in float32; one process without a "
        "precision plugin, else 'autocast'), 'autocast' casts them again in every forward under torch.autocast",
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
        super().__attrs_post_init__()
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


def traits(config: TorchBackendConfig) -> BackendTraits:
    """What other plugins may know of it: the adapters it trains, its device, whether its
    ranks split batches."""
    return BackendTraits(
        adapter_rank=config.lora_rank, device=config.device, data_parallel=config.data_parallel != "none",
        adapter_targets=tuple(config.lora_targets) if config.lora_targets is not None else None,
        switches={"adapter_rank": "lora_rank", "adapter_targets": "lora_targets", "data_parallel": "data_parallel"},
    )


def check(spec: Any) -> list[tuple[str, str]]:
    """Several backend ranks train data parallel: ``data_parallel`` must say how; a
    CUDA ``device`` needs CUDA on this machine."""
    backend = spec.plugins.get("backend")
    ranks = spec.cluster.trainer_ranks
    if backend is not None and spec.cluster.launcher != "ray":  # ray: each actor checks its own
        problem = cuda_problem(backend.config.device)
        if problem is not None:
            return [("backend.device", problem)]
    if ranks > 1 and backend is not None and backend.config.data_parallel == "none":
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
        traits=traits,
    )

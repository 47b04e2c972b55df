"""The torch backend: :class:`TorchBackend` (imported by the factory in ``skyrl_backends.torch``;
other distributions use the public :mod:`skyrl_backends.torch_backend`).

This module holds its state and its set-up (``start``: master weights, LoRA,
precision, reference policy, data-parallel wrapping, optimizer). The rest lives
beside it, one responsibility a module:

- ``_packing``: a RolloutBatch laid out as mini-batches of packed micro-batches;
- ``_packed_lm``: the policy's forward on packed rows, logits at the loss positions only;
- ``_parallel``: the rank's device, DDP / FSDP2 wrapping, all-reduce;
- ``_optimizer``: AdamW and the learning-rate schedule;
- ``_train_step``: ``train_step`` and ``reference_logprobs`` (the :class:`TrainStep` base);
- ``_weights``: weights for the engine, LoRA adapters, ``state_dict`` / ``load_state_dict``
  (the :class:`WeightsAndCheckpoints` base);
- ``_lora``: the LoRA adapters themselves;
- ``_compute_copy``: bf16 copies of the weights for each update (``compute_weights = "copy"``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from skyrl_backends import _parallel
from skyrl_backends._compute_copy import ComputeCopy
from skyrl_backends._optimizer import make_optimizer
from skyrl_backends._packed_lm import PackedLM, WithoutAdapters, head_is_plain
from skyrl_backends._packing import (
    MicroBatch, empty_micro_batch, has_recurrent_layers, plan_mini_batches, segment_attention_supported,
    shared_prompts_supported,
)
from skyrl_backends._train_step import LOW_PRECISION, TrainStep
from skyrl_backends._weights import WeightsAndCheckpoints
from skyrl_host.contracts import has
from skyrl_host.interfaces import ScoringReplay


class TorchBackend(TrainStep, WeightsAndCheckpoints):
    """A :class:`skyrl_host.interfaces.Backend` on plain PyTorch (+ DDP / FSDP2)."""

    def __init__(self, config: Any):
        self.config = config
        self.steps = 0  # train_step calls done
        self.module: Any = None  # the model being trained (FSDP2: sharded in place)
        self.reference: Any = None
        self._lm: Any = None  # PackedLM around self.module (the FSDP2 root)
        self._ref_lm: Any = None  # PackedLM around self.reference
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._one_sequence_per_row = False  # set by start() for models with recurrent layers
        self._segment_attention = False  # set by start(): micro-batches in flat rows, attention per sequence (flat_rows)
        self._prompts_shareable = False  # set by start(): share_prompts, and the model passed its probe
        self.replay: list[Any] = []  # ReplayStrategy objects (start(replay=...))
        self._scorer_strategy: Any = None  # the one that scores tokens (support), if any
        self._ddp: Any = None
        self._mesh: Any = None
        self._dp = False
        self.rank, self.world = 0, 1
        self._dp_group: Any = None  # the data-parallel ranks' process group (None: every rank)
        self.device = torch.device("cpu")
        self.lora: Any = None  # LoraAdapters when lora_rank > 0
        self.precision: Any = None  # a Precision (start(precision=...)), fake-quantizing the forward
        self._compute_copy: Any = None  # a ComputeCopy: bf16 weights for each update (compute_weights = "copy")

    # -- set-up ----------------------------------------------------------------

    def start(self, loaded: Any, *, seed: int, total_steps: int, reference: bool, replay: Any = (),
              precision: Any = None) -> None:
        """Take the model to train. ``replay``: :class:`skyrl_host.interfaces.ReplayStrategy`
        objects, bound to the policy model here and active in every policy forward.
        ``precision``: a :class:`skyrl_host.interfaces.Precision` that fake-quantizes the
        model's chosen layers in every forward (the reference policy's too)."""
        cfg = self.config
        model = loaded.model
        self._one_sequence_per_row = has_recurrent_layers(getattr(model, "config", None))
        self._dp = cfg.data_parallel != "none"
        if self._dp:
            self.rank, self.world = _parallel.require_process_group(cfg.data_parallel)
        self.device = _parallel.pick_device(self._dp, cfg.device)
        self.seed = seed

        # float32 master weights (float64 stays float64, e.g. for exactness tests).
        if any(p.dtype in LOW_PRECISION for p in model.parameters()):
            model = model.float()
        model = model.to(self.device)
        if cfg.lora_rank > 0:
            model = self._attach_lora(model, loaded, seed)
        self.precision = precision
        if precision is not None:
            precision.prepare_model(model, keep=tuple(loaded.precision_keep), train=True)
        if self._dp and cfg.data_parallel == "fsdp2":
            # FSDP2 shards each rank's own copy: make them equal first (DDP does this itself).
            _parallel.broadcast_from_rank0(model)
        # Logits only at the loss positions, unless the model's forward transforms the head's output.
        plain = head_is_plain(model, self.device)
        if self._dp and self.world > 1:
            flag = self._all_reduce(torch.tensor([int(plain)], dtype=torch.int64), dist.ReduceOp.MIN)
            plain = bool(flag[0])
        segments = segment_attention_supported(model, self.device)
        if self._dp and self.world > 1:  # every rank the same mode (0: none, 1: built, 2: prepared)
            code = {False: 0, "built": 1, "prepared": 2}[segments]
            flag = self._all_reduce(torch.tensor([code], dtype=torch.int64), dist.ReduceOp.MIN)
            segments = {0: False, 1: "built", 2: "prepared"}[int(flag[0])]
        if getattr(cfg, "flat_rows", "long") == "never":
            segments = False
        self._segment_attention = segments
        # Shared prompts in flat rows, where a probe gives the unshared logits (every rank the same).
        sharing = bool(segments) and bool(getattr(cfg, "share_prompts", False)) and shared_prompts_supported(
            model, self.device, segments)
        if self._dp and self.world > 1:
            flag = self._all_reduce(torch.tensor([int(sharing)], dtype=torch.int64), dist.ReduceOp.MIN)
            sharing = bool(flag[0])
        self._prompts_shareable = sharing
        if reference and self.lora is None:
            ref = copy.deepcopy(model)
            ref.eval()
            ref.requires_grad_(False)
            self._ref_lm = PackedLM(ref, full_logits=not plain)
            if self._dp and cfg.data_parallel == "fsdp2":
                self._fully_shard(self._ref_lm, ref)
            self.reference = ref

        if cfg.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.replay = list(replay)
        for strategy in self.replay:
            strategy.bind(model, loaded)
        self._scorer_strategy = next((s for s in self.replay if has(s, ScoringReplay)), None)
        self._lm = PackedLM(model, full_logits=not plain)
        if self._dp and cfg.data_parallel == "fsdp2":
            self._fully_shard(self._lm, model)  # the wrapper is the root: its hooks run around every forward
        self.module = model
        if reference and self.lora is not None:
            # With LoRA the reference policy is the frozen base: the policy's own forward
            # with the adapters off (no second copy of the weights).
            self.reference = model
            self._ref_lm = WithoutAdapters(self._lm, self.lora)
        if self._dp and cfg.data_parallel == "ddp":
            self._ddp = _parallel.wrap_ddp(self._lm, self.device)
        self.optimizer, self.scheduler = make_optimizer(model, cfg, total_steps)
        if ComputeCopy.applies(self):
            self._compute_copy = ComputeCopy(model, torch.bfloat16)
            if self.reference is not None and self.reference is not model:
                self.reference.to(torch.bfloat16)  # frozen: one bf16 copy for good, as the policy's copies

    def _attach_lora(self, model: Any, loaded: Any, seed: int) -> Any:
        """The model to train with LoRA: a module tree of its own over the same (frozen)
        tensors, so the caller's model (which an engine may serve) never runs the
        trainer's adapters, with adapters on the target Linear modules."""
        from skyrl_backends._lora import LoraAdapters

        from skyrl_host.errors import UserError

        cfg = self.config
        targets = cfg.lora_targets if cfg.lora_targets is not None else list(loaded.lora_targets)
        if not targets:
            raise UserError(
                f"[backend] lora_rank = {cfg.lora_rank} needs lora_targets: the model family "
                f"{loaded.family or '?'!r} declares none; set [backend] lora_targets = [\"q_proj\", ...]"
            )
        memo: dict[int, Any] = {}
        for t in list(model.parameters()) + list(model.buffers()):
            memo[id(t)] = t
        own = copy.deepcopy(model, memo)
        own.requires_grad_(False)
        try:
            self.lora = LoraAdapters(
                own, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=targets, seed=seed,
                strict=cfg.lora_targets is not None,
            )
        except ValueError as exc:
            key = "lora_targets" if cfg.lora_targets is not None else "lora_targets (the model family's default)"
            raise UserError(f"[backend] {key}: {exc}") from None
        return own

    # -- data parallel ---------------------------------------------------------------

    def _fully_shard(self, root: Any, model: Any) -> None:
        """``fully_shard`` ``model``'s decoder layers, then ``root`` (the ``PackedLM``
        around it), on this backend's mesh (made on first use)."""
        if self._mesh is None:
            self._mesh = _parallel.device_mesh(self.device, self.world)
        _parallel.fully_shard_model(root, model, self._mesh)

    @property
    def _train_module(self) -> Any:
        return self._ddp if self._ddp is not None else self._lm

    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self._dp and self.world > 1:
            return _parallel.all_reduce(t, op, device=self.device, group=self._dp_group)
        return t

    # -- packing -------------------------------------------------------------------

    @property
    def _pack_length(self) -> int:
        # Recurrent layers see every earlier token of a row: one sequence per row for them.
        return 1 if self._one_sequence_per_row else self.config.pack_length

    def _plan(self, batch: Any, advantages: np.ndarray) -> list[list[MicroBatch]]:
        """The mini-batches of this rank, each a list of packed micro-batches."""
        cfg = self.config
        return plan_mini_batches(batch, advantages, mini_batches=cfg.mini_batches,
                                 micro_batch_tokens=cfg.micro_batch_tokens, pack_length=self._pack_length,
                                 device=self.device, segment_attention=self._segment_attention,
                                 flat_always=self._flat_always, share_prompts=self._share_prompts)

    @property
    def _share_prompts(self) -> bool:
        """A prompt's samples share its tokens in a flat row (``share_prompts``); not with
        replay strategies, which read per-token side channels slot by slot."""
        return self._prompts_shareable and not self.replay

    @property
    def _flat_always(self) -> bool:
        """Every micro-batch in one flat row (``flat_rows``), not only those with a sequence
        longer than ``pack_length``: on a CPU per-sequence attention beats shared rows at
        every length measured (docs/backends.md)."""
        mode = getattr(self.config, "flat_rows", "long")
        if mode == "auto":
            return self.device.type == "cpu"
        return mode == "always"

    def _dummy(self) -> MicroBatch:
        """An empty micro-batch (one token, no loss): keeps the ranks' collectives in step."""
        return empty_micro_batch(pack_length=self._pack_length, device=self.device)

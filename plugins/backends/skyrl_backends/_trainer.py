"""The torch backend's implementation (imported by the factory in ``skyrl_backends.torch``).

One step over a RolloutBatch:

1. split the sequences into ``mini_batches`` groups (one optimizer update each) and
   every group into packed micro-batches: whole sequences, in order, while their
   tokens fit ``micro_batch_tokens``; each micro-batch is laid out in rows of at
   most ``pack_length`` tokens (whole sequences, in order; a longer sequence gets
   its own row), ``[n_rows, R]`` with ``R`` the longest row, positions restarting
   at 0 for every sequence and for the pad tail of a shorter row (transformers then
   builds a block-diagonal causal mask from the positions when no attention mask
   and no cache is passed, so attention costs ``R^2`` per row, not ``n^2``);
2. all-reduce the normalisers (loss tokens, training sequences) of every
   mini-batch and the number of micro-batches (ranks with fewer run empty ones so
   every rank calls the same collectives);
3. before the first update, in a no-grad pass: the reference logprobs when the
   algorithm needs them, and the old logprobs when there is more than one update;
4. per micro-batch: the forward (through :class:`_PackedLM`: the base transformer,
   then the output head on the positions that predict a loss token only), logprobs
   of the temperature-scaled distribution, LossInputs, the algorithm's loss,
   backward (times the world size: DDP and FSDP2 average gradients over ranks, the
   algorithm's loss is already normalised by global counts); then clip, AdamW step,
   scheduler step.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from skyrl_host.interfaces import LossInputs

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_PAD_ID = 0  # the token in the pad tails of packed rows (never attended to by a real token, logits never used)


class LrSchedule:
    """The learning-rate factor of optimizer update ``u`` (0-based): a linear warmup
    over the first ``warmup`` updates (factor ``(u + 1) / (warmup + 1)``), then
    constant 1, or a cosine from 1 down to ``min_ratio`` at update ``total``.

    A class, not a closure, so LambdaLR's state dict records it."""

    def __init__(self, warmup: int, total: int, kind: str, min_ratio: float):
        self.warmup = warmup
        self.total = total
        self.kind = kind
        self.min_ratio = min_ratio

    def __call__(self, u: int) -> float:
        if u < self.warmup:
            return (u + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (u - self.warmup) / max(1, self.total - self.warmup)))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Micro:
    """One packed micro-batch: rows of whole sequences and its loss tokens.

    ``keep`` are the flat positions (into ``ids.reshape(-1)``) whose logits predict
    the loss tokens (``t - 1`` for a loss token at ``t``, always in the same row);
    every per-token tensor has one entry per loss token."""

    def __init__(self, *, ids, pos, keep, targets, adv, engine_lp, seq_ids, n_seqs: int, n_tokens: int, n_sequences: int):
        self.ids = ids  # long [n_rows, R]
        self.pos = pos  # long [n_rows, R]
        self.keep = keep  # long [K], flat indices into n_rows * R
        self.targets = targets  # long [K]
        self.adv = adv  # float32 [K]
        self.engine_lp = engine_lp  # float32 [K]
        self.seq_ids = seq_ids  # long [K], 0..n_seqs-1 over the sequences with loss tokens
        self.n_seqs = n_seqs
        self.n_tokens = n_tokens  # all real tokens of the micro-batch (pad tails not counted)
        self.n_sequences = n_sequences  # all sequences of the micro-batch
        self.old: Any = None  # pre-update logprobs [K], from the no-grad pass
        self.ref: Any = None  # reference logprobs [K]
        self.batch_idx: Any = None  # numpy int64 [K]: each loss token's index in the RolloutBatch
        self.slot_tokens: Any = None  # numpy int64 [n_rows * R]: the batch token at each slot (-1: padding)
        self.batch: Any = None  # the RolloutBatch it comes from

    @property
    def n_loss(self) -> int:
        return int(self.targets.numel())

    @property
    def dummy(self) -> bool:
        return self.n_sequences == 0


def pack_groups(seq_lens: np.ndarray, seqs: Iterable[int], budget: int) -> list[list[int]]:
    """Whole sequences, in order, grouped while their total length fits ``budget``;
    a sequence longer than the budget goes alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for s in seqs:
        n = int(seq_lens[s])
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(int(s))
        used += n
    if current:
        groups.append(current)
    return groups


_RECURRENT_LAYER_TYPES = ("mamba", "linear_attention", "linear", "ssm", "deltanet")


def has_recurrent_layers(config: Any) -> bool:
    """True for models with layers that carry state along the sequence (Mamba,
    linear attention): they ignore position ids, so sequences packed into one row
    would leak state into each other."""
    for attr in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
        kinds = getattr(config, attr, None)
        if kinds is None:
            continue
        text = " ".join(kinds) if not isinstance(kinds, str) else kinds
        text = text.lower()
        if any(k in text for k in _RECURRENT_LAYER_TYPES) or (attr == "hybrid_override_pattern" and "M" in kinds):
            return True
    return False


def layout_rows(seq_lens: np.ndarray, pack_length: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Lay out sequences (lengths ``seq_lens``, in order) in rows: whole sequences,
    greedily, while a row's length fits ``pack_length``; a longer sequence gets a row
    of its own. Every row is ``R`` long (the longest row); a shorter row ends in a pad
    tail whose positions restart at 0 (a segment of its own: no real token attends
    to it under the block-diagonal mask).

    Returns ``(where, positions, n_rows, R)``: ``where`` [n] is the flat index (into
    ``n_rows * R``) of each token, the sequences' tokens end to end; ``positions``
    [n_rows * R] is every slot's position id."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    rows = pack_groups(lens, range(len(lens)), pack_length)
    n_rows = len(rows)
    row_of = np.empty(len(lens), dtype=np.int64)
    for r, members in enumerate(rows):
        row_of[members] = r
    used = np.bincount(row_of, weights=lens, minlength=n_rows).astype(np.int64)
    R = int(used.max()) if n_rows else 0
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    row_start = np.zeros(n_rows, dtype=np.int64)  # offset in the batch of each row's first token
    row_start[1:] = np.cumsum(used)[:-1]
    seq_start = row_of * R + (cu[:-1] - row_start[row_of])  # flat index of each sequence's first token
    within = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)
    where = np.repeat(seq_start, lens) + within
    slot = np.arange(R, dtype=np.int64)[None, :]
    positions = np.maximum(slot - used[:, None], 0).reshape(-1)  # the pad tails: 0, 1, 2, ...
    positions[where] = within
    return where, positions, n_rows, R


class _PackedLM(torch.nn.Module):
    """A causal LM that computes logits only where they are needed.

    ``forward(ids [rows, R], pos [rows, R], keep [K])`` runs the model's base
    transformer (``get_decoder()``) on the packed rows (no attention mask, no cache:
    transformers builds the block-diagonal causal mask from the positions), flattens
    the hidden states to ``[rows * R, H]``, takes the ``keep`` rows and applies the
    output head: logits ``[K, V]``. (``logits_to_keep`` cannot do this: it takes the
    same sequence indices in every row.)

    The data-parallel wrappers (DDP, the FSDP2 root) wrap this module, so their
    forward/backward hooks run around the call that uses the parameters. It owns the
    model as ``lm``, so its own parameter names carry an ``lm.`` prefix: names for the
    engine and checkpoints always come from the model itself.

    ``full_logits``: for a model whose forward changes the head's output (logit
    scaling or soft-capping), call the whole model and index its logits instead."""

    def __init__(self, model: torch.nn.Module, full_logits: bool = False):
        super().__init__()
        self.lm = model
        self.full_logits = full_logits
        names = {id(m): n for n, m in model.named_modules()}
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if get_decoder is not None else None
        if decoder is None or decoder is model:
            decoder = getattr(model, getattr(model, "base_model_prefix", "") or "model", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if decoder is None or decoder is model or id(decoder) not in names or head is None or id(head) not in names:
            self.full_logits = True  # no separable base transformer / output head
            self._decoder_name = self._head_name = ""
        else:
            # Names, not modules: registering them again would duplicate the parameters.
            self._decoder_name, self._head_name = names[id(decoder)], names[id(head)]

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, scorer: Any = None) -> Any:
        """Logits ``[K, V]`` at ``keep``; with ``scorer`` (a replay strategy's scoring,
        called here so FSDP2 has the head's parameters gathered), its result from
        ``hidden=[K, H], head=module`` (or ``logits=`` for a transformed head)."""
        if self.full_logits:
            logits = self.lm(input_ids=ids, position_ids=pos, use_cache=False).logits
            logits = logits.reshape(-1, logits.shape[-1])[keep]
            return logits if scorer is None else scorer(logits=logits)
        out = self.lm.get_submodule(self._decoder_name)(input_ids=ids, position_ids=pos, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[keep]
        head = self.lm.get_submodule(self._head_name)
        return head(hidden) if scorer is None else scorer(hidden=hidden, head=head)


class _WithoutAdapters:
    """Calls a ``_PackedLM`` with its LoRA adapters off: the frozen base, used as the
    reference policy (no second copy of the weights)."""

    def __init__(self, lm: Any, lora: Any):
        self.lm = lm
        self.lora = lora

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lora.disabled():
            return self.lm(*args, **kwargs)


def _head_is_plain(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``_PackedLM``'s decoder + head path gives the model's own logits
    (checked on two short packed rows; a model that scales or soft-caps its logits
    after the head does not)."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "get_text_config", lambda: None)()):
        if cfg is not None and (getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_scaling", None)):
            return False
    if hasattr(model, "logit_scale"):
        return False
    probe = _PackedLM(model)
    if probe.full_logits:
        return False
    vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 8))
    ids = (torch.arange(12, device=device).reshape(2, 6) * 7 + 3) % vocab
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], device=device)
    keep = torch.arange(12, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=pos, use_cache=False).logits.reshape(12, -1)
            got = probe(ids, pos, keep)
    finally:
        model.train(was_training)
    scale = float(want.abs().max()) + 1.0
    return got.shape == want.shape and bool(((got.float() - want.float()).abs().max() <= 1e-4 * scale))


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def _copy_containers(obj: Any) -> Any:
    """dicts and lists copied, tensors and other leaves shared."""
    if isinstance(obj, dict):
        return {k: _copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_containers(v) for v in obj]
    return obj


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").numpy()
    return np.asarray(x)


def _to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean())
    return float(v)


class TorchBackend:
    """A :class:`skyrl_host.interfaces.Backend` on plain PyTorch (+ DDP / FSDP2)."""

    def __init__(self, config: Any):
        self.config = config
        self.steps = 0  # train_step calls done
        self.module: Any = None  # the model being trained (FSDP2: sharded in place)
        self.reference: Any = None
        self._lm: Any = None  # _PackedLM around self.module (the FSDP2 root)
        self._ref_lm: Any = None  # _PackedLM around self.reference
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._one_sequence_per_row = False  # set by start() for models with recurrent layers
        self.replay: list[Any] = []  # ReplayStrategy objects (start(replay=...))
        self._scorer_strategy: Any = None  # the one that scores tokens (support), if any
        self._ddp: Any = None
        self._mesh: Any = None
        self._dp = False
        self.rank, self.world = 0, 1
        self.device = torch.device("cpu")
        self.lora: Any = None  # LoraAdapters when lora_rank > 0
        self.precision: Any = None  # a Precision (start(precision=...)), fake-quantizing the forward

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
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"data_parallel = {cfg.data_parallel!r} needs torch.distributed initialised by the launcher "
                    "(init_process_group with gloo on CPU or nccl on GPU) before the backend starts"
                )
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = self._pick_device()
        self.seed = seed

        # float32 master weights (float64 stays float64, e.g. for exactness tests).
        if any(p.dtype in _LOW_PRECISION for p in model.parameters()):
            model = model.float()
        model = model.to(self.device)
        if cfg.lora_rank > 0:
            model = self._attach_lora(model, loaded, seed)
        self.precision = precision
        if precision is not None:
            precision.prepare_model(model, keep=tuple(getattr(loaded, "precision_keep", ()) or ()), train=True)
        if self._dp and cfg.data_parallel == "fsdp2":
            # FSDP2 shards each rank's own copy: make them equal first (DDP does this itself).
            with torch.no_grad():
                for t in model.state_dict().values():
                    dist.broadcast(t, src=0)
        # Logits only at the loss positions, unless the model's forward transforms the head's output.
        plain = _head_is_plain(model, self.device)
        if self._dp and self.world > 1:
            flag = self._all_reduce(torch.tensor([int(plain)], dtype=torch.int64), dist.ReduceOp.MIN)
            plain = bool(flag[0])
        if reference and self.lora is None:
            ref = copy.deepcopy(model)
            ref.eval()
            ref.requires_grad_(False)
            self._ref_lm = _PackedLM(ref, full_logits=not plain)
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
        self._scorer_strategy = next((s for s in self.replay if callable(getattr(s, "score", None))), None)
        self._lm = _PackedLM(model, full_logits=not plain)
        if self._dp and cfg.data_parallel == "fsdp2":
            self._fully_shard(self._lm, model)  # the wrapper is the root: its hooks run around every forward
        self.module = model
        if reference and self.lora is not None:
            # With LoRA the reference policy is the frozen base: the policy's own forward
            # with the adapters off (no second copy of the weights).
            self.reference = model
            self._ref_lm = _WithoutAdapters(self._lm, self.lora)
        if self._dp and cfg.data_parallel == "ddp":
            import inspect

            from torch.nn.parallel import DistributedDataParallel

            # Buffers (rotary tables) are equal on every rank: no broadcast before each forward.
            params = inspect.signature(DistributedDataParallel.__init__).parameters
            no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
            self._ddp = DistributedDataParallel(
                self._lm, device_ids=[self.device.index] if self.device.type == "cuda" else None, **no_buffer_sync
            )

        decay, no_decay = [], []
        for p in model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
        )
        total_updates = max(1, total_steps) * cfg.mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, LrSchedule(cfg.warmup_steps, total_updates, cfg.schedule, cfg.min_lr_ratio)
        )

    def _attach_lora(self, model: Any, loaded: Any, seed: int) -> Any:
        """The model to train with LoRA: a module tree of its own over the same (frozen)
        tensors, so the caller's model (which an engine may serve) never runs the
        trainer's adapters, with adapters on the target Linear modules."""
        from skyrl_backends._lora import LoraAdapters

        from skyrl_host.errors import UserError

        cfg = self.config
        targets = cfg.lora_targets if cfg.lora_targets is not None else list(getattr(loaded, "lora_targets", ()) or ())
        if not targets:
            raise UserError(
                f"[backend] lora_rank = {cfg.lora_rank} needs lora_targets: the model family "
                f"{getattr(loaded, 'family', '') or '?'!r} declares none; set [backend] lora_targets = [\"q_proj\", ...]"
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

    def _pick_device(self) -> torch.device:
        if torch.cuda.is_available() and (not self._dp or dist.get_backend() != "gloo"):
            import os

            index = int(os.environ.get("LOCAL_RANK", "0")) if self._dp else torch.cuda.current_device()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _fully_shard(self, root: Any, model: Any) -> None:
        """``fully_shard`` every decoder layer of ``model`` (its ``_no_split_modules``),
        then ``root`` (the ``_PackedLM`` around it: the rest of the parameters)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world,))
        mesh = self._mesh
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        for sub in model.modules():
            if sub is not model and type(sub).__name__ in layer_classes:
                fully_shard(sub, mesh=mesh)
        fully_shard(root, mesh=mesh)

    @property
    def _train_module(self) -> Any:
        return self._ddp if self._ddp is not None else self._lm

    # -- one step ----------------------------------------------------------------

    def _plan(self, batch: Any, advantages: np.ndarray) -> list[list[_Micro]]:
        """The mini-batches of this rank, each a list of packed micro-batches."""
        cfg = self.config
        lens = batch.seq_lens
        positions = batch.positions()
        trains = (np.asarray(batch.loss_mask) != 0) & (positions > 0)  # a sequence's first token has no context
        cu = batch.cu_seqlens
        tokens = np.asarray(batch.tokens)
        minis = np.array_split(np.arange(batch.n_sequences), cfg.mini_batches)
        plan = []
        for seqs in minis:
            micros = []
            for group in pack_groups(lens, seqs, cfg.micro_batch_tokens):
                idx = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in group])
                local = np.flatnonzero(trains[idx])
                owner = np.repeat(np.arange(len(group)), lens[group])[local]
                _, seq_ids = np.unique(owner, return_inverse=True)
                micro = self._micro(tokens[idx], lens[group], local, advantages[idx[local]],
                                    np.asarray(batch.logprobs)[idx[local]], seq_ids,
                                    int(len(np.unique(owner))), len(group), token_index=idx)
                micro.batch_idx = idx[local]
                micro.batch = batch
                micros.append(micro)
            plan.append(micros)
        return plan

    def _micro(self, ids, seq_lens, local, adv, engine_lp, seq_ids, n_seqs, n_sequences, token_index=None) -> _Micro:
        """``ids``: the group's tokens end to end; ``seq_lens``: its sequences'
        lengths; ``local``: the indices (into ``ids``) of its loss tokens."""
        d = self.device
        # Recurrent layers see every earlier token of a row: one sequence per row for them.
        pack_length = 1 if self._one_sequence_per_row else self.config.pack_length
        where, positions, n_rows, R = layout_rows(seq_lens, pack_length)
        flat = np.full(n_rows * R, _PAD_ID, dtype=np.int64)
        flat[where] = ids

        def long(x: Any) -> torch.Tensor:
            return torch.as_tensor(np.asarray(x, dtype=np.int64), device=d)

        def f32(x: Any) -> torch.Tensor:
            return torch.as_tensor(np.asarray(x, dtype=np.float32), device=d)

        micro = _Micro(
            ids=long(flat).reshape(n_rows, R), pos=long(positions).reshape(n_rows, R), keep=long(where[local] - 1),
            targets=long(ids[local]),
            adv=f32(adv), engine_lp=f32(engine_lp), seq_ids=long(seq_ids).reshape(-1),
            n_seqs=n_seqs, n_tokens=len(ids), n_sequences=n_sequences,
        )
        if token_index is not None:
            slots = np.full(n_rows * R, -1, dtype=np.int64)
            slots[where] = token_index
            micro.slot_tokens = slots
        return micro

    def _dummy(self) -> _Micro:
        """An empty micro-batch (one token, no loss): keeps the ranks' collectives in step."""
        empty = np.zeros(0, dtype=np.int64)
        return self._micro(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), empty,
                           np.zeros(0), np.zeros(0), empty, 0, 0)

    def _autocast(self) -> Any:
        if self.config.compute_dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _view(self, mb: _Micro) -> Any:
        from skyrl_host.interfaces import ReplayView

        return ReplayView(batch=mb.batch, slot_tokens=mb.slot_tokens, scored_tokens=mb.batch_idx, device=self.device)

    def _replaying(self, mb: _Micro) -> Any:
        """The replay strategies' contexts for one policy forward (and its backward)."""
        if not self.replay or mb.dummy or mb.batch is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        view = self._view(mb)
        for strategy in self.replay:
            stack.enter_context(strategy.replaying(view))
        return stack

    def _logprobs(self, module: Any, mb: _Micro, temperature: float, entropy: bool = False) -> tuple[Any, Any, Any]:
        """(logprobs [K], entropy [K] or None, logits): logprobs of the loss tokens under
        ``log_softmax(logits / temperature)``, from logits computed at ``keep`` only; or,
        with a scoring replay strategy (``support``), as that strategy normalises them
        (then the third item is the logprobs, not logits)."""
        keep = mb.keep if mb.n_loss else torch.zeros(1, dtype=torch.long, device=self.device)
        strategy = self._scorer_strategy
        if strategy is not None and mb.n_loss and mb.batch is not None:
            view = self._view(mb)

            def scorer(**kw: Any) -> Any:
                return strategy.score(view, mb.targets, temperature, **kw)

            with self._autocast():
                lp, ent = module(mb.ids, mb.pos, keep, scorer)
            return lp, (ent.detach() if entropy else None), lp
        with self._autocast():
            logits = module(mb.ids, mb.pos, keep)
        if logits.dtype in _LOW_PRECISION:
            logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        if not mb.n_loss:
            return None, None, logits
        lse = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, mb.targets[:, None]).squeeze(-1) - lse
        ent = None
        if entropy:
            with torch.no_grad():
                z = logits.detach()
                ent = lse.detach() - (torch.softmax(z, dim=-1) * z).sum(-1)
        return lp, ent, logits

    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self._dp and self.world > 1:
            comm = t.to(self.device) if dist.get_backend() == "nccl" else t.cpu()
            dist.all_reduce(comm, op=op or dist.ReduceOp.SUM)
            return comm.to(t.device)
        return t

    def train_step(
        self, batch: Any, advantages: Any, algorithm: Any, *, temperature: float, max_new_tokens: int
    ) -> Mapping[str, float]:
        if self.module is None:
            raise RuntimeError("train_step before start()")
        cfg = self.config
        t0 = time.perf_counter()
        needs_ref = bool(getattr(algorithm, "needs_reference", False))
        if needs_ref and self.reference is None:
            raise RuntimeError("the algorithm needs a reference model, but the backend was started with reference=False")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the sampler's), found {temperature!r}")
        adv = _as_numpy(advantages).astype(np.float32, copy=False)
        if adv.shape != (batch.n_tokens,):
            raise ValueError(f"advantages must have one entry per token ({batch.n_tokens}), found shape {adv.shape}")

        plan = self._plan(batch, adv)
        n_mini = len(plan)
        # Normalisers of each mini-batch over all ranks, and the micro-batch counts to match.
        local = torch.tensor(
            [[sum(m.n_loss for m in micros), sum(m.n_seqs for m in micros), sum(m.n_tokens for m in micros),
              sum(m.n_sequences for m in micros)] for micros in plan],
            dtype=torch.float64,
        )
        totals = self._all_reduce(local)
        counts = self._all_reduce(torch.tensor([len(m) for m in plan], dtype=torch.int64), dist.ReduceOp.MAX if self._dp else None)
        for j, micros in enumerate(plan):
            micros.extend(self._dummy() for _ in range(int(counts[j]) - len(micros)))
        active = [j for j in range(n_mini) if totals[j, 0] > 0]  # a mini-batch without loss tokens does no update

        # The no-grad pass before the first update.
        if needs_ref or cfg.mini_batches > 1:
            with torch.no_grad():
                for j in active:
                    for mb in plan[j]:
                        if cfg.mini_batches > 1:
                            with self._replaying(mb):
                                mb.old = self._logprobs(self._lm, mb, temperature)[0]
                        if needs_ref:
                            mb.ref = self._logprobs(self._ref_lm, mb, temperature)[0]

        sums: dict[str, torch.Tensor] = {}  # token-weighted sums, reduced over ranks at the end
        algo_sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        zero = torch.zeros((), dtype=torch.float64, device=self.device)

        def add(d: dict, key: str, value: torch.Tensor) -> None:
            d[key] = d.get(key, zero) + value.detach().to(torch.float64)

        grad_norms, lr = [], self.optimizer.param_groups[0]["lr"]
        scale = float(self.world) if self._dp else 1.0
        module = self._train_module
        for j in active:
            micros = plan[j]
            global_tokens, global_seqs = float(totals[j, 0]), float(totals[j, 1])
            self.optimizer.zero_grad(set_to_none=True)
            for i, mb in enumerate(micros):
                sync = i == len(micros) - 1
                ctx = self._ddp.no_sync() if (self._ddp is not None and not sync) else contextlib.nullcontext()
                with ctx, self._replaying(mb):
                    lp, ent, logits = self._logprobs(module, mb, temperature, entropy=True)
                    if lp is None:
                        loss = logits.sum() * 0.0  # no loss token: a zero gradient that still reaches every parameter
                    else:
                        old = lp.detach() if mb.old is None else mb.old
                        inputs = LossInputs(
                            logprobs=lp, old_logprobs=old, engine_logprobs=mb.engine_lp, advantages=mb.adv,
                            mask=torch.ones_like(mb.adv), seq_ids=mb.seq_ids, n_seqs=mb.n_seqs,
                            global_tokens=global_tokens, global_seqs=global_seqs, ref_logprobs=mb.ref,
                            max_response_len=max_new_tokens,
                        )
                        loss, metrics = algorithm.loss(inputs)
                        w = float(mb.n_loss)
                        for k, v in (metrics or {}).items():
                            add(algo_sums, k, torch.as_tensor(_to_float(v) * w, device=self.device))
                        add(sums, "entropy", ent.sum())
                        # The trainer's pre-update logprob against the engine's.
                        diff = (old.detach() - mb.engine_lp).abs()
                        add(sums, "logprob_diff", diff.sum())
                        maxes["logprob_diff_max"] = torch.maximum(maxes.get("logprob_diff_max", zero), diff.max().double())
                        if mb.ref is not None:
                            delta = mb.ref - old.detach()
                            add(sums, "kl", (torch.exp(delta) - delta - 1).sum())
                    add(sums, "loss", loss)
                    (loss * scale if scale != 1.0 else loss).backward()
            norm = torch.nn.utils.clip_grad_norm_(
                self.module.parameters(), cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            )
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            grad_norms.append(norm.detach().double())
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            if self.precision is not None:
                self.precision.invalidate()  # the next forward quantizes the new weights
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # free the gradients until the next step
        self.steps += 1

        # Reduce the metrics over ranks (the key sets may differ: gather them).
        local_metrics = {
            "sums": {k: float(v) for k, v in sums.items()},
            "algo": {k: float(v) for k, v in algo_sums.items()},
            "max": {k: float(v) for k, v in maxes.items()},
        }
        gathered = [local_metrics]
        if self._dp and self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, local_metrics)
        tot: dict[str, float] = {}
        algo: dict[str, float] = {}
        mx: dict[str, float] = {}
        for g in gathered:
            for k, v in g["sums"].items():
                tot[k] = tot.get(k, 0.0) + v
            for k, v in g["algo"].items():
                algo[k] = algo.get(k, 0.0) + v
            for k, v in g["max"].items():
                mx[k] = max(mx.get(k, 0.0), v)
        n_loss = float(totals[active, 0].sum()) if active else 0.0
        per_tok = max(n_loss, 1.0)
        elapsed = time.perf_counter() - t0
        all_tokens = float(totals[:, 2].sum())
        out: dict[str, float] = {}
        for k, v in algo.items():
            out[k] = v / per_tok
        own = {
            "loss": tot.get("loss", 0.0) / max(1, len(active)),
            "entropy": tot.get("entropy", 0.0) / per_tok,
            "logprob_diff_mean": tot.get("logprob_diff", 0.0) / per_tok,
            "logprob_diff_max": mx.get("logprob_diff_max", 0.0),
            "grad_norm": float(torch.stack(grad_norms).mean()) if grad_norms else 0.0,
            "lr": float(lr),
            "updates": float(len(active)),
            "tokens": all_tokens,
            "loss_tokens": n_loss,
            "sequences": float(totals[:, 3].sum()),
            "tokens_per_s": all_tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
        }
        if needs_ref:
            own["kl"] = tot.get("kl", 0.0) / per_tok
        for k, v in own.items():
            if k in out:
                out[f"algorithm_{k}"] = out.pop(k)
            out[k] = v
        return out

    # -- weights and checkpoints ---------------------------------------------------

    def _fsdp(self) -> bool:
        return self._dp and self.config.data_parallel == "fsdp2"

    def reference_logprobs(self, batch: Any, *, temperature: float) -> np.ndarray:
        """float32 [T]: the frozen reference policy's logprobs of the batch's loss
        tokens (0 elsewhere), for KL penalties applied to rewards."""
        if self._ref_lm is None:
            raise RuntimeError("reference_logprobs needs start(..., reference=True)")
        out = np.zeros(batch.n_tokens, dtype=np.float32)
        plan = self._plan(batch, np.zeros(batch.n_tokens, dtype=np.float32))
        with torch.no_grad():
            for micros in plan:
                for mb in micros:
                    if mb.n_loss:
                        lp = self._logprobs(self._ref_lm, mb, temperature)[0]
                        out[mb.batch_idx] = lp.float().cpu().numpy()
        return out

    def serving_weights(self, local: bool = False) -> Iterator[tuple[str, Any]]:
        """What the engine must serve: :meth:`named_weights` (``local``: this rank's
        :meth:`local_weights`), with every weight the precision quantizes as its payload
        plus its scales (``precision.pack``; a rank's shard quantized by itself, as a
        shard of the whole payload), so the engine computes with exactly the numbers the
        trainer's forward used. Without a precision, the weights as they are."""
        weights = self.local_weights() if local else self.named_weights()
        return weights if self.precision is None else self.precision.pack(weights)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The model's state as (name, tensor) pairs, with Hugging Face names.
        Under FSDP2 this is a collective (every rank calls it) and only rank 0
        gets the full tensors (on CPU); the other ranks get none."""
        if self.module is None:
            raise RuntimeError("named_weights before start()")
        if self._fsdp():
            sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = {k: v.detach() for k, v in self.module.state_dict().items()}
        if self.lora is not None:
            sd = self.lora.merge(sd)  # what a model without adapters holds: plain names, merged weights
        return iter(list(sd.items()))

    def local_weights(self) -> Iterator[tuple[str, Any]]:
        """This rank's part of the model's state, with Hugging Face names, gathering
        nothing (never a collective): under FSDP2 each value is the parameter's
        ``DTensor`` (``.to_local()`` is this rank's shard, ``.placements`` and
        ``.shape`` say where it sits in the full tensor); otherwise the full tensors.
        For sharded transports (``nixl``), where each rank serves its own shards."""
        if self.module is None:
            raise RuntimeError("local_weights before start()")
        if self.lora is not None:
            if self._fsdp():
                raise RuntimeError(
                    "local_weights: a LoRA model under FSDP2 has no per-rank shards of its merged weights; "
                    "publish the adapters (transport = \"lora\") or the gathered weights (named_weights) instead"
                )
            return self.named_weights()
        return iter([(k, v.detach()) for k, v in self.module.state_dict().items()])

    # -- LoRA adapters --------------------------------------------------------------

    def adapter_config(self) -> dict[str, Any] | None:
        """``{"rank", "alpha", "targets"}`` of the trained adapters (None without LoRA):
        what a receiver needs to apply :meth:`named_adapters`. The adapters' output is
        scaled by ``alpha / rank``; ``targets`` are the adapted Linear modules' last name
        components."""
        return None if self.lora is None else self.lora.config()

    def named_adapters(self) -> Iterator[tuple[str, Any]]:
        """Only the adapter tensors, ``(<module path>.lora_A [rank, in], <module
        path>.lora_B [out, rank])`` for every adapted module in module order, e.g.
        ``model.layers.0.self_attn.q_proj.lora_A``. Under FSDP2 a collective (every
        rank calls it; every rank gets the full tensors). Views of the live parameters:
        copy them to keep a version."""
        if self.module is None:
            raise RuntimeError("named_adapters before start()")
        if self.lora is None:
            raise RuntimeError("named_adapters: this backend trains every weight ([backend] lora_rank = 0), it has no adapters")
        params = dict(self.module.named_parameters())
        out = []
        for name in self.lora.parameter_names():
            p = params[name].detach()
            if hasattr(p, "full_tensor"):
                p = p.full_tensor()
            out.append((name, p))
        return iter(out)

    def save_adapters(self, path: str) -> None:
        """Write the adapters as ``<path>/lora_adapters.safetensors`` (the tensors of
        :meth:`named_adapters`, float32) and ``<path>/lora_config.json`` (rank, alpha,
        targets, the adapted modules), e.g. beside the merged final model. (Not PEFT's
        ``adapter_config.json``/``adapter_model.safetensors``: transformers would take a
        folder holding those for a PEFT adapter, and the names differ from PEFT's.)"""
        import json
        import pathlib

        from safetensors.torch import save_file

        if self.lora is None:
            raise RuntimeError("save_adapters: this backend has no adapters ([backend] lora_rank = 0)")
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.named_adapters()}
        if self._dp and self.rank != 0:
            return
        folder = pathlib.Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "lora_adapters.safetensors"))
        config = dict(self.lora.config(), modules=list(self.lora.modules), dropout=self.lora.dropout)
        (folder / "lora_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def state_dict(self) -> Mapping[str, Any]:
        """Model, optimizer (keyed by parameter name), scheduler and step counts, on CPU.
        Under DDP/FSDP2 every rank calls it; rank 0 gets the full state."""
        if self.module is None:
            raise RuntimeError("state_dict before start()")
        # With LoRA only the adapters: the frozen base is rebuilt from the model family.
        model_sd, optim_sd = get_state_dict(
            self.module, self.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None),
        )
        if self.lora is not None:  # (ignore_frozen_params still lists a tied alias of a frozen weight)
            model_sd = {k: v for k, v in model_sd.items() if self.lora.is_adapter(k)}
        state = {
            "format": 1,
            "model": _clone_tree(model_sd),
            "optimizer": _clone_tree(optim_sd),
            "scheduler": _clone_tree(self.scheduler.state_dict()),
            "steps": self.steps,
        }
        if self.lora is not None:
            state["lora"] = self.adapter_config()  # load_state_dict checks it against its own
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a started backend. Under DDP/FSDP2 every
        rank calls it and rank 0's state is broadcast (the others may pass ``{}``)."""
        if self.module is None:
            raise RuntimeError("load_state_dict before start(): start the backend, then load")
        distributed = self._dp and self.world > 1
        meta = [{"scheduler": state.get("scheduler"), "steps": state.get("steps"), "lora": state.get("lora")}]
        if distributed:
            dist.broadcast_object_list(meta, src=0)
        if meta[0]["steps"] is None:
            raise ValueError("not a torch backend state: no 'steps'")
        if meta[0]["lora"] != self.adapter_config():
            def what(c: Any) -> str:
                return "full fine-tuning (lora_rank = 0)" if c is None else f"LoRA {c}"

            raise ValueError(
                f"the checkpoint was written by {what(meta[0]['lora'])}, but this backend runs {what(self.adapter_config())}: "
                "[backend] lora_rank, lora_alpha and lora_targets must match the run being resumed"
            )
        # Two calls: set_state_dict skips the model on ranks given an empty model state.
        # With LoRA the state holds the adapters only (strict=False: the frozen base stays).
        options = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=distributed, strict=self.lora is None
        )
        # (Copies of the containers: torch writes into the dicts it is given.)
        set_model_state_dict(self.module, _copy_containers(state.get("model", {})), options=options)
        set_optimizer_state_dict(self.module, self.optimizer, _copy_containers(state.get("optimizer", {})), options=options)
        self.scheduler.load_state_dict(meta[0]["scheduler"])
        self.steps = int(meta[0]["steps"])
        if self.precision is not None:
            self.precision.invalidate()

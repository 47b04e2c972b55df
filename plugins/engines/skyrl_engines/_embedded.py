"""The embedded engine's implementation (imports torch and transformers).

Generation, per chunk of at most ``max_batch_size`` sequences (sequences are
taken in output order, so prompt i's ``n`` samples stay together):

1. Prefill: every distinct prompt of the chunk once, left-padded to the longest,
   with a 2-D attention mask (padding never attended to) and explicit position
   ids (each prompt counts from 0 at its first real token). Only the last
   position's logits are computed (``logits_to_keep=1``): with left padding it is
   every prompt's last real token, so the first generated token's logprob comes
   from there.
2. The KV cache rows are replicated to the chunk's sequences (``n`` per prompt),
   so a prompt is never prefilled ``n`` times.
3. Decode: all live sequences advance together, one token per forward. The KV
   cache is a transformers ``DynamicCache`` whose attention layers write into
   buffers preallocated for the chunk's longest prompt + ``max_new_tokens`` (no
   concatenation per step) and hand attention a view of the filled prefix; other
   layer kinds (linear attention / Mamba states) keep transformers' own layers.
   Finished sequences are not recorded any more and are dropped from the batch
   (cache, mask, positions) once a quarter of its rows are finished, so they stop
   costing compute.

When the sampler has ``return_support`` true (and ``sample_with_support``), each
step also gathers the kept candidate ids of the live rows (``torch.nonzero`` of
the bool support mask, on the device); after generation they become the CSR side
channel ``sample_support``, one row per generated token, in batch order.

Randomness comes only from one ``torch.Generator`` seeded with ``seed`` and
handed to the sampler, so the same seed and weights give the same batch.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from skyrl_engines._adapters import EngineAdapters
from skyrl_host.interfaces import LoadedModel, Sampler
from skyrl_host.rollout import CSR, RolloutBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Compact the batch once at least this fraction of its rows are finished.
COMPACT_FRACTION = 0.25


def _engine_model(model: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.nn.Module, bool]:
    """A module to serve ``model`` in ``dtype``: the module tree is copied (so the
    engine has its own eval/train flags and never changes the caller's), the
    parameters and buffers are the caller's own tensors when their dtype already
    is ``dtype``, converted copies otherwise. Returns (module, shares_all_params)."""
    memo: dict[int, Any] = {}
    shared = True
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            shared = False
        else:
            memo[id(p)] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) in memo:
            continue
        # Rotary frequencies stay in float32 (the rotary embedding computes in float32 anyway).
        convert = b.is_floating_point() and b.dtype != dtype and not name.endswith("inv_freq")
        memo[id(b)] = b.detach().to(dtype) if convert else b
    try:
        engine_model = copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - an exotic module that cannot be deep-copied
        if not shared:
            raise
        engine_model = model  # serve the caller's module itself; generate() toggles eval mode around its forwards
    return engine_model, shared


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


class EmbeddedEngine:
    """The ``embedded`` engine (see the module docstring)."""

    def __init__(self, config: Any):
        self.config = config
        self.adapters = EngineAdapters()  # LoRA adapters (update_adapter) and the served version
        self.precision: Any = None  # start(precision=...): weights arrive quantized
        self.model: torch.nn.Module | None = None
        self.shares_weights = False
        self.stop_token_ids: list[int] = []
        self.last_update: dict[str, int] = {}
        self._hooks: Any = None  # RouterHooks when return_routed_experts
        self.routers: list[Any] = []

    # -- lifecycle -----------------------------------------------------------

    def start(self, loaded: LoadedModel, precision: Any = None) -> None:
        """Build the engine's model from ``loaded``. ``precision`` (a
        :class:`skyrl_host.interfaces.Precision`): serve its quantized weights, which
        arrive as payload + scales (``update_weights`` dequantizes them), and compute the
        activations as the trainer does."""
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        source = loaded.model
        first = next(source.parameters())
        dtype = first.dtype if self.config.dtype == "auto" else _DTYPES[self.config.dtype]
        self.model, self.shares_weights = _engine_model(source, dtype)
        self._own_module = self.model is not source
        if self._own_module:
            self.model.eval()
        self.dtype = dtype
        self.device = first.device
        self.precision = precision
        if precision is not None:  # (an engine serving the trainer's own tensors shares its fake-quantized forward)
            precision.prepare_model(self.model, keep=tuple(getattr(loaded, "precision_keep", ()) or ()), train=False,
                                    source=source)
        self.adapters.bind(self.model, dtype, self.device)
        self.stop_token_ids = [int(t) for t in loaded.stop_token_ids]
        self._stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=self.device)
        pad = getattr(loaded.tokenizer, "pad_token_id", None) if loaded.tokenizer is not None else None
        vocab = self.model.get_input_embeddings().num_embeddings
        # Padding is never attended to, so any id the embedding has will do.
        self.pad_token_id = int(pad) if pad is not None and 0 <= int(pad) < vocab else 0
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._buffers = dict(self.model.named_buffers(remove_duplicate=False))
        # transformers 5.x renames `past_key_values` to `cache`; accept either.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.routers = list(getattr(loaded, "routers", ()) or ())
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self.config.return_routed_experts:
            if not self.routers:
                raise ValueError(
                    "engine.return_routed_experts is set, but the model has no MoE routers "
                    f"(model family {loaded.family or '?'!r} lists none): routing capture needs a mixture-of-experts model"
                )
            from skyrl_replay.routing import RouterHooks, expert_dtype

            self._hooks = RouterHooks(self.model, self.routers)
            self.route_dtype = expert_dtype(self._hooks.n_experts)

    @property
    def weight_version(self) -> int:
        """The version the next generate call serves (base weights and adapter together)."""
        return self.adapters.serving.version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.adapters.set_version(version)

    def _require_started(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("the embedded engine has not been started (call start(loaded) first)")
        return self.model

    # -- weights -------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Apply a complete set of weights, all or nothing; then report ``version``.

        Names are the model's parameter names (a tied weight may be given under
        any of its names); persistent buffers may be given too. Every parameter
        must be covered. A tensor that already is the engine's parameter (shared
        storage) is not copied."""
        self._require_started()
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        covered: set[int] = set()
        if self.precision is not None:  # quantized payloads + scales -> the weights the trainer computed with
            named_tensors = self.precision.unpack(named_tensors, self.dtype)
        for name, tensor in named_tensors:
            target = self._params.get(name)
            if target is None:
                target = self._buffers.get(name)
            if target is None:
                raise ValueError(f"update_weights: unknown weight name {name!r}; nothing was changed")
            if not isinstance(tensor, torch.Tensor):
                tensor = torch.as_tensor(tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}; "
                    "nothing was changed"
                )
            covered.add(id(target))
            plan.append((target, tensor))
        for name, p in self._params.items():
            if id(p) not in covered:
                raise ValueError(f"update_weights: missing weight {name!r} (a complete set is required); nothing was changed")
        copied = shared = nbytes = 0
        done: set[int] = set()
        with torch.no_grad():
            for target, tensor in plan:
                if id(target) in done:
                    continue
                done.add(id(target))
                if _same_storage(target, tensor):
                    shared += 1
                    continue
                target.copy_(tensor)
                copied += 1
                nbytes += tensor.numel() * tensor.element_size()
        self.last_update = {"copied": copied, "shared": shared, "bytes": nbytes}
        self.weight_version = int(version)

    def adapter_slots(self, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """``{adapter tensor name: shape}`` that a complete LoRA adapter with ``config``
        (``rank``, ``alpha``, ``targets``) has in this engine's model: ``<module>.lora_A``
        ``[rank, in]`` and ``<module>.lora_B`` ``[out, rank]`` for every ``nn.Linear``
        whose last path component is in ``targets``."""
        self._require_started()
        return self.adapters.slots(config)

    def update_adapter(self, named_tensors: Iterable[tuple[str, Any]], config: Mapping[str, Any], version: int) -> None:
        """Serve a new LoRA adapter (torch tensors or numpy arrays named as in
        :meth:`adapter_slots`; scale ``alpha / rank``) on the engine's own base weights,
        and report ``version``. The whole set is validated and copied into buffers no
        generate call uses, then the served adapter switches in one step: a generate call
        in flight finishes with the adapter it started with, the next one uses the new
        one. On any mismatch it raises (naming the version and the tensor) and the engine
        keeps serving its last adapter and version."""
        self._require_started()
        bank = self.adapters.stage(named_tensors, config, version)
        self.adapters.activate(bank, version)
        self.last_update = {"copied": 2 * len(bank.tensors), "shared": 0, "bytes": self.adapters.staged_bytes}

    # -- generation ----------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        sampler: Sampler,
        max_new_tokens: int,
        seed: int,
        group_offset: int = 0,
    ) -> RolloutBatch:
        prompts = [list(map(int, p)) for p in prompts]
        return self._run(prompts, n, sampler, max_new_tokens, seed, group_offset, None)

    def continue_turn(
        self,
        history: RolloutBatch,
        turns: Sequence[Sequence[int]],
        *,
        sampler: Sampler,
        max_new_tokens: int,
        seed: int,
    ) -> RolloutBatch:
        """Continue every conversation of ``history`` with the tokens of ``turns[i]``
        (e.g. a tool result or a user message) and one sampled response.

        Returns the *segment* batch of the new turn only: sequence ``i`` is the history's
        last token, then ``turns[i]``, then the response (``prompt_lens = 1 + len(turns[i])``;
        the one-token overlap lets :meth:`RolloutBatch.append_turn` check the segment
        continues the right conversation). Its side channels cover the segment's tokens
        only, so a conversation's data costs O(its tokens), not O(turns x tokens).

        With ``return_routed_experts``, the history is prefilled with its recorded routes
        forced (every token but its last, which the engine never fed), so the context the
        new tokens attend to is the one the trainer rebuilds when it replays the
        assembled rows; only the segment's routes are recorded and returned."""
        if len(turns) != history.n_sequences:
            raise ValueError(f"continue_turn: {len(turns)} turns for {history.n_sequences} conversations")
        force = None
        if self._hooks is not None:
            routes = history.side_channels.get("routed_experts")
            if routes is None:
                raise ValueError(
                    "continue_turn: the engine returns routed experts, but the history has no 'routed_experts' "
                    "side channel to keep its earlier turns' routes"
                )
            force = [routes[history.cu_seqlens[i] : history.cu_seqlens[i + 1] - 1] for i in range(history.n_sequences)]
        prompts = [list(map(int, history.sequence(i))) + list(map(int, t)) for i, t in enumerate(turns)]
        full = self._run(prompts, 1, sampler, max_new_tokens, seed, 0, force)
        full.group_ids = np.asarray(history.group_ids, dtype=np.int64).copy()
        # Drop each conversation's history but its last token: the segment.
        start = history.seq_lens - 1
        keep = np.concatenate(
            [np.arange(full.cu_seqlens[i] + start[i], full.cu_seqlens[i + 1]) for i in range(full.n_sequences)]
        ) if full.n_sequences else np.zeros(0, np.int64)
        seg_lens = full.seq_lens - start
        cu = np.zeros(full.n_sequences + 1, dtype=np.int64)
        np.cumsum(seg_lens, out=cu[1:])
        side = {k: (v if isinstance(v, CSR) else v[keep]) for k, v in full.side_channels.items()}
        segment = RolloutBatch(
            tokens=full.tokens[keep],
            cu_seqlens=cu,
            prompt_lens=(full.prompt_lens - start).astype(np.int32),
            logprobs=full.logprobs[keep],
            loss_mask=full.loss_mask[keep],
            group_ids=full.group_ids,
            versions=full.versions,
            truncated=full.truncated,
            rewards=full.rewards,
            side_channels=side,
        )
        segment.validate()
        return segment

    def _run(
        self,
        prompts: list[list[int]],
        n: int,
        sampler: Sampler,
        max_new_tokens: int,
        seed: int,
        group_offset: int,
        force: list[np.ndarray] | None,
    ) -> RolloutBatch:
        model = self._require_started()
        if n < 1:
            raise ValueError(f"n must be at least 1, found {n}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, found {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        # One served (adapter, version) for the whole call, whatever update_adapter does meanwhile.
        with self.adapters.pinned() as serving:
            return self._run_pinned(model, prompts, n, sampler, max_new_tokens, seed, group_offset, force, serving.version)

    def _run_pinned(
        self, model: torch.nn.Module, prompts: list[list[int]], n: int, sampler: Sampler, max_new_tokens: int,
        seed: int, group_offset: int, force: list[np.ndarray] | None, version: int,
    ) -> RolloutBatch:
        total = len(prompts) * n
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed))

        resp = np.zeros((total, max_new_tokens), dtype=np.int32)
        resp_lp = np.zeros((total, max_new_tokens), dtype=np.float32)
        resp_len = np.zeros(total, dtype=np.int64)
        stopped = np.zeros(total, dtype=bool)
        want_support = bool(getattr(sampler, "return_support", False))
        if want_support and not callable(getattr(sampler, "sample_with_support", None)):
            raise ValueError("the sampler has return_support set but no sample_with_support(logits, generator)")
        support_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (row key, row length, values)
        hooks = self._hooks
        if hooks is not None:
            shape = (hooks.n_layers, hooks.k)
            prompt_routes = [np.zeros((len(p), *shape), dtype=self.route_dtype) for p in prompts]
            resp_routes = np.zeros((total, max_new_tokens, *shape), dtype=self.route_dtype)
        step = self.config.max_batch_size
        training = model.training
        if not self._own_module:
            model.eval()
        try:
            # no_grad rather than inference_mode: the parameters and buffers may be the
            # trainer's own, and nothing made here must be an inference tensor.
            with torch.no_grad(), (hooks.recording() if hooks is not None else contextlib.nullcontext()):
                for s0 in range(0, total, step):
                    s1 = min(total, s0 + step)
                    p0, p1 = s0 // n, (s1 - 1) // n + 1
                    rep = torch.arange(s0, s1, device=self.device) // n - p0
                    out = self._generate_chunk(
                        model, prompts[p0:p1], rep, sampler, max_new_tokens, generator, want_support,
                        None if force is None else force[p0:p1],
                    )
                    resp[s0:s1], resp_lp[s0:s1], resp_len[s0:s1], stopped[s0:s1] = out[:4]
                    if want_support:
                        keys, lens, values = out[4]
                        support_parts.append((keys + s0 * max_new_tokens, lens, values))
                    if hooks is not None:
                        pre, dec = out[5]
                        for i, r in enumerate(pre):
                            prompt_routes[p0 + i] = r
                        resp_routes[s0:s1] = dec
        finally:
            if not self._own_module:
                model.train(training)
        batch = self._pack(prompts, n, resp, resp_lp, resp_len, stopped, group_offset, version)
        if want_support:
            batch.side_channels["sample_support"] = _support_csr(support_parts)
        if hooks is not None:
            batch.side_channels["routed_experts"] = _pack_routes(batch, prompt_routes, resp_routes, n)
        batch.validate()
        return batch

    def _forward(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any):
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self._cache_kw: cache}, **self._extra
        )
        return out.logits[:, -1, :].float()

    def _generate_chunk(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        rep: torch.Tensor,
        sampler: Sampler,
        max_new: int,
        generator: torch.Generator,
        want_support: bool = False,
        force: list[np.ndarray] | None = None,
    ) -> tuple[Any, ...]:
        dev = self.device
        hooks = self._hooks
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        width = int(lens.max())
        cap = width + max_new - 1  # the last sampled token is never fed back
        n_prompts = len(prompts)

        ids = torch.full((n_prompts, width), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev)
        cols = torch.arange(width, device=dev)
        first = (width - lens)[:, None]
        pos = (cols[None, :] - first).clamp_min(0)
        attn = torch.zeros((n_prompts, max(cap, width)), dtype=torch.bool, device=dev)
        attn[:, :width] = cols[None, :] >= first

        cache = _make_cache(model.config, cap)

        def mask_upto(length: int) -> torch.Tensor:
            return attn[:, :length]

        forcing: Any = contextlib.nullcontext()
        if force is not None and hooks is not None:
            # The earlier turns' routes, at the left-padded slots of their tokens.
            f_ids = np.zeros((n_prompts, width, hooks.n_layers, hooks.k), dtype=np.int64)
            f_mask = np.zeros((n_prompts, width), dtype=bool)
            for i, (p, r) in enumerate(zip(prompts, force)):
                if len(r) > len(p):
                    raise ValueError(f"conversation {i}: {len(r)} rows of routes for a context of {len(p)} tokens")
                s = width - len(p)
                f_ids[i, s : s + len(r)] = r
                f_mask[i, s : s + len(r)] = True
            forcing = hooks.forcing(
                torch.as_tensor(f_ids.reshape(n_prompts * width, hooks.n_layers, hooks.k), device=dev),
                torch.as_tensor(f_mask.reshape(-1), device=dev),
            )
        with forcing:
            logits = self._forward(model, ids, mask_upto(width), pos, cache)
        if hooks is not None:
            pre_all = hooks.take().reshape(n_prompts, width, hooks.n_layers, hooks.k).cpu().numpy()
            pre_routes = [pre_all[i, width - len(p) :].astype(self.route_dtype) for i, p in enumerate(prompts)]

        rows = rep.numel()
        if rows != n_prompts or not torch.equal(rep, torch.arange(rows, device=dev)):
            _select_rows(cache, rep)
            attn = attn.index_select(0, rep)
            logits = logits.index_select(0, rep)
        next_pos = lens.index_select(0, rep)

        out_tok = torch.zeros((rows, max_new), dtype=torch.int32, device=dev)
        out_lp = torch.zeros((rows, max_new), dtype=torch.float32, device=dev)
        out_len = torch.zeros(rows, dtype=torch.long, device=dev)
        out_stop = torch.zeros(rows, dtype=torch.bool, device=dev)
        if hooks is not None:
            # Routes of each response token fed back (the last one never is: it stays 0).
            out_routes = torch.zeros((rows, max_new, hooks.n_layers, hooks.k), dtype=torch.int32, device=dev)
        seq_of_row = torch.arange(rows, device=dev)  # chunk sequence held by each batch row
        alive = None  # row indices still generating; None = every row
        sup_keys: list[torch.Tensor] = []  # per step: chunk sequence * max_new + t of each live row
        sup_lens: list[torch.Tensor] = []  # per step: kept candidates of each live row
        sup_vals: list[torch.Tensor] = []  # per step: the kept ids, row-major (nonzero's order)
        for t in range(max_new):
            live_logits = logits if alive is None else logits.index_select(0, alive)
            live_seq = seq_of_row if alive is None else seq_of_row.index_select(0, alive)
            if want_support:
                sample, keep = sampler.sample_with_support(live_logits, generator)
                keep = keep.to(device=dev)
                sup_keys.append(live_seq * max_new + t)
                sup_lens.append(keep.sum(-1))
                sup_vals.append(torch.nonzero(keep)[:, 1].to(torch.int32))
            else:
                sample = sampler.sample(live_logits, generator)
            tok = sample.token_ids.to(device=dev, dtype=torch.long).reshape(-1)
            out_tok[live_seq, t] = tok.to(torch.int32)
            out_lp[live_seq, t] = sample.logprobs.to(device=dev, dtype=torch.float32).reshape(-1)
            out_len[live_seq] = t + 1
            hit = torch.isin(tok, self._stops)
            any_hit = bool(hit.any())
            if any_hit:
                out_stop[live_seq[hit]] = True
            if t == max_new - 1:
                break
            if any_hit:
                keep = ~hit
                alive = (torch.arange(rows, device=dev) if alive is None else alive)[keep]
                tok = tok[keep]
                if alive.numel() == 0:
                    break
            if alive is None:
                feed = tok
            else:
                feed = torch.full((rows,), self.pad_token_id, dtype=torch.long, device=dev)
                feed[alive] = tok
                if rows - alive.numel() >= max(1, math.ceil(COMPACT_FRACTION * rows)):
                    _select_rows(cache, alive)
                    attn = attn.index_select(0, alive)
                    next_pos = next_pos.index_select(0, alive)
                    seq_of_row = seq_of_row.index_select(0, alive)
                    feed = tok
                    rows = alive.numel()
                    alive = None
            slot = width + t
            attn[:, slot] = True
            logits = self._forward(model, feed[:, None], mask_upto(slot + 1), next_pos[:, None], cache)
            if hooks is not None:
                step_routes = hooks.take()  # [rows, L, k]: the routes of response token t of each row
                if alive is None:
                    out_routes[seq_of_row, t] = step_routes.to(torch.int32)
                else:
                    out_routes[seq_of_row.index_select(0, alive), t] = step_routes.index_select(0, alive).to(torch.int32)
            next_pos = next_pos + 1
        out = (out_tok.cpu().numpy(), out_lp.cpu().numpy(), out_len.cpu().numpy(), out_stop.cpu().numpy())
        support = None
        if want_support:
            support = (
                torch.cat(sup_keys).cpu().numpy().astype(np.int64),
                torch.cat(sup_lens).cpu().numpy().astype(np.int64),
                torch.cat(sup_vals).cpu().numpy(),
            )
        routes = None
        if hooks is not None:
            routes = (pre_routes, out_routes.cpu().numpy().astype(self.route_dtype))
        return out + (support, routes)

    def _pack(
        self,
        prompts: list[list[int]],
        n: int,
        resp: np.ndarray,
        resp_lp: np.ndarray,
        resp_len: np.ndarray,
        stopped: np.ndarray,
        group_offset: int,
        version: int,
    ) -> RolloutBatch:
        total, max_new = resp.shape
        plen = np.repeat(np.asarray([len(p) for p in prompts], dtype=np.int64), n)
        width = int(plen.max()) if total else 0
        grid = np.zeros((total, width + max_new), dtype=np.int32)
        lp_grid = np.zeros((total, width + max_new), dtype=np.float32)
        prompt_grid = np.zeros((len(prompts), width), dtype=np.int32)
        for i, p in enumerate(prompts):
            prompt_grid[i, : len(p)] = p
        grid[:, :width] = np.repeat(prompt_grid, n, axis=0)
        rows = np.arange(total)[:, None]
        resp_cols = plen[:, None] + np.arange(max_new)[None, :]
        grid[rows, resp_cols] = resp
        lp_grid[rows, resp_cols] = resp_lp
        cols = np.arange(width + max_new)[None, :]
        seq_len = plen + resp_len
        valid = cols < seq_len[:, None]
        is_resp = valid & (cols >= plen[:, None])
        cu = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(seq_len, out=cu[1:])
        batch = RolloutBatch(
            tokens=grid[valid],
            cu_seqlens=cu,
            prompt_lens=plen.astype(np.int32),
            logprobs=np.where(is_resp, lp_grid, 0.0).astype(np.float32)[valid],
            loss_mask=is_resp[valid].astype(np.uint8),
            group_ids=group_offset + np.repeat(np.arange(len(prompts), dtype=np.int64), n),
            versions=np.full(total, version, dtype=np.int64),
            truncated=~stopped,
            rewards=np.full(total, np.nan, dtype=np.float32),
        )
        batch.validate()
        return batch


def _pack_routes(batch: RolloutBatch, prompt_routes: list[np.ndarray], resp_routes: np.ndarray, n: int) -> np.ndarray:
    """The ``routed_experts`` side channel [T, L, k]: each sequence's prompt routes, then
    its response tokens' routes (the last response token's row is 0: never fed back)."""
    parts = []
    for s in range(batch.n_sequences):
        parts.append(prompt_routes[s // n])
        parts.append(resp_routes[s, : int(batch.response_lens[s])])
    if not parts:
        return np.zeros((0, *resp_routes.shape[2:]), dtype=resp_routes.dtype)
    return np.concatenate(parts)


def _support_csr(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> CSR:
    """One CSR from the recorded steps (rows step-major, keyed ``sequence * max_new + t``):
    rows reordered sequence by sequence, token by token, i.e. the batch's generated tokens."""
    keys = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    lens = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    values = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.int32)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return CSR(offsets, values.astype(np.int32, copy=False)).take(np.argsort(keys, kind="stable"))


def _make_cache(config: Any, capacity: int) -> Any:
    """A transformers DynamicCache whose attention layers write into buffers
    preallocated for ``capacity`` tokens (no concatenation per step) and return
    views of the filled part, so attention only covers the tokens written so far.
    Sliding-window layers keep every token too (the mask limits the window).
    Layer kinds it does not know (linear attention, ...) keep transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [
        _PreallocatedLayer(capacity) if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
        for layer in cache.layers
    ]
    return cache


class _PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer over ``[batch, heads, capacity, dim]`` buffers,
    filled in place; ``keys``/``values`` are views of the filled prefix."""

    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, dk = key_states.shape
        self.key_buffer = key_states.new_empty((b, h, self.capacity, dk))
        self.value_buffer = value_states.new_empty((b, value_states.shape[1], self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens for a capacity of {self.capacity}")
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.length = end
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, indices)
            self.value_buffer = self.value_buffer.index_select(0, indices)
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the embedded engine's cache is never cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(
            torch.arange(self.key_buffer.shape[0], device=self.device).repeat_interleave(repeats)
        )

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None
        self.is_initialized = False


def _select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep (or repeat) the given batch rows of every cache layer, in that order."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(index)
        elif hasattr(layer, "reorder_cache"):  # linear-attention states: an index_select of each state
            layer.reorder_cache(index)
        else:  # pragma: no cover - a layer kind this engine does not know
            raise NotImplementedError(f"cannot select batch rows of cache layer {type(layer).__name__}")

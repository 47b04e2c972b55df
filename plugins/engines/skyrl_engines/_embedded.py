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
   layer kinds (linear attention / Mamba states) keep transformers' own layers
   (``skyrl_engines._kv_cache``). On a CPU a decode step's attention is two float32
   matmuls per layer instead of the flash kernel (``skyrl_engines._decode_attention``).
   Finished sequences are not recorded any more and are dropped from the batch
   (cache, mask, positions) once a quarter of its rows are finished, so they stop
   costing compute.

When the sampler has ``return_support`` true (and ``sample_with_support``), each
step also gathers the kept candidate ids of the live rows (``torch.nonzero`` of
the bool support mask, on the device); after generation they become the CSR side
channel ``sample_support``, one row per generated token, in batch order.

With ``return_routed_experts`` the router hooks record ``routed_experts``; on a model
with a sparse-attention key indexer (GLM-5, DeepSeek-V3.2) the indexer hooks of
``_indexer_capture`` also record ``indexer_topk`` (the keys each token attended to).

Randomness comes only from one ``torch.Generator`` seeded with ``seed`` and
handed to the sampler, so the same seed and weights give the same batch.

Beside this module: ``_kv_cache`` (the preallocated cache, row selection),
``_batch_assembly`` (the RolloutBatch and its side channels from the generated
arrays), ``_served_model`` (the engine's copy of the model, weight updates into it),
``_adapters`` (LoRA adapters served on the engine's base weights).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from skyrl_engines._adapters import EngineAdapters
from skyrl_engines._decode_attention import install_decode_attention, keep_kernel
from skyrl_engines._batch_assembly import assemble_batch, routes_channel, support_csr, turn_segment, wants_support
from skyrl_engines._indexer_capture import IndexerCapture
from skyrl_engines._kv_cache import TurnCache, cache_with_prefix, make_cache, reusable_layers, row_kv, select_rows
from skyrl_engines._served_model import copy_weights, engine_model, resolve_device
from skyrl_host.errors import UserError
from skyrl_host.interfaces import LoadedModel, Sampler
from skyrl_host.rollout import RolloutBatch
from skyrl_toolkit.routing import INDEXER_CHANNEL, indexer_paths

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Compact the batch once at least this fraction of its rows are finished.
COMPACT_FRACTION = 0.25


def cut_at_stop_strings(tokenizer: Any, stop_strings: Sequence[str], resp: np.ndarray, resp_len: np.ndarray,
                        stopped: np.ndarray) -> None:
    """Cut each response (``resp[i, :resp_len[i]]``) after the token whose decoded text
    completes the first occurrence of any of ``stop_strings``: ``resp_len`` shortened and
    ``stopped`` set in place. A response without a stop string is left as it is."""
    for i in range(len(resp_len)):
        ids = resp[i, : resp_len[i]].tolist()

        def hit(k: int) -> bool:
            text = tokenizer.decode(ids[:k], skip_special_tokens=False)
            return any(s in text for s in stop_strings)

        if not ids or not hit(len(ids)):
            continue
        lo, hi = 1, len(ids)  # the shortest prefix holding a stop string (a longer prefix holds it too)
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(mid):
                hi = mid
            else:
                lo = mid + 1
        resp_len[i] = lo
        stopped[i] = True


class StopStringScan:
    """Finds, during decoding, the sequences whose response text has just come to hold one
    of ``stop_strings``, so that they stop there instead of decoding to ``max_new_tokens``.

    Only the last ``window`` tokens of a response are decoded at each step: a stop string
    of L characters that the newest token completes lies within its last 4L + 4 tokens (a
    token decodes to at least one character, or to one of the at most four bytes of one).
    The cut after generation (``cut_at_stop_strings``, over the whole text) stays the
    authority on where a response ends; this scan only spares the decode steps after it."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.window = 4 * max(len(s) for s in self.stop_strings) + 4

    def hits(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """``tokens``: [rows, >= t + 1] response ids of the live rows; a bool per row."""
        tail = tokens[:, max(0, t + 1 - self.window) : t + 1].tolist()
        texts = self.tokenizer.batch_decode(tail, skip_special_tokens=False)
        return torch.tensor([any(s in text for s in self.stop_strings) for text in texts], dtype=torch.bool,
                            device=tokens.device)


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
        self._indexers: IndexerCapture | None = None  # also then, on a model with a sparse-attention indexer
        self._turns: TurnCache | None = None  # conversations' KV between continue_turn calls
        # In-flight weight updates: update_weights from another thread lands between two
        # forwards of a generation in progress (never inside one); each token records the
        # version of the forward that produced it (side channel token_versions).
        self._forward_lock = threading.RLock()
        self._base_version = 0  # bumped by every update_weights
        self._base_label = 0  # the version the last update_weights reported
        self._fwd_version = 0  # the version label of the last forward
        self._fwd_base = 0  # the _base_version of the last forward (whose weights made its KV)
        # Abort-and-resubmit (abort_on_update): at an update inside a generation, its live
        # requests are prefilled again, prompt + generated tokens, with the new weights.
        self._abort_on_update = False
        self.resubmitted = 0  # requests resubmitted so far (one per live row per abort)
        self.routers: list[Any] = []

    # -- lifecycle -----------------------------------------------------------

    def start(self, loaded: LoadedModel, *, precision: Any = None, sampler: Any = None) -> None:
        """Build the engine's model from ``loaded``. ``precision`` (a
        :class:`skyrl_host.interfaces.Precision`): serve its quantized weights, which
        arrive as payload + scales (``update_weights`` dequantizes them), and compute the
        activations as the trainer does. ``sampler``: unused (each ``generate`` call gets
        its sampler)."""
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        source = loaded.model
        first = next(source.parameters())
        dtype = first.dtype if self.config.dtype == "auto" else _DTYPES[self.config.dtype]
        device = resolve_device(getattr(self.config, "device", "auto"), first.device)
        self.model, self.shares_weights = engine_model(source, dtype, device,
                                                       share=getattr(self.config, "share_weights", True))
        self._own_module = self.model is not source
        if self._own_module:
            self.model.eval()
        self.dtype = dtype
        self.device = device
        if device.type == "cpu":  # decode steps' attention as two float32 matmuls (see _decode_attention)
            install_decode_attention()
        if precision is not None:  # quantized activations: attention exactly as the trainer computes it
            keep_kernel(self.model)
        self.precision = precision
        if precision is not None:  # (an engine serving the trainer's own tensors shares its fake-quantized forward)
            precision.prepare_model(self.model, keep=tuple(loaded.precision_keep), train=False,
                                    source=source)
        self.adapters.bind(self.model, dtype, self.device)
        self.stop_token_ids = [int(t) for t in loaded.stop_token_ids]
        vocab = self.model.get_input_embeddings().num_embeddings
        for t in self.config.stop_token_ids:  # the job's own stop ids, after the model's
            if t >= vocab:
                raise UserError(f"[engine] stop_token_ids: {t} is not a token of this model (its vocabulary has "
                                f"{vocab} ids, 0..{vocab - 1})")
            if t not in self.stop_token_ids:
                self.stop_token_ids.append(t)
        self.tokenizer = loaded.tokenizer  # stop_strings are found in its decoded text
        if self.config.stop_strings and self.tokenizer is None:
            raise ValueError("[engine] stop_strings needs the model's tokenizer, and this engine was started without one")
        self._stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=self.device)
        self._stop_scan = StopStringScan(self.tokenizer, self.config.stop_strings) if self.config.stop_strings else None
        pad = getattr(loaded.tokenizer, "pad_token_id", None) if loaded.tokenizer is not None else None
        # Padding is never attended to, so any id the embedding has will do.
        self.pad_token_id = int(pad) if pad is not None and 0 <= int(pad) < vocab else 0
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._buffers = dict(self.model.named_buffers(remove_duplicate=False))
        # transformers 5.x renames `past_key_values` to `cache`; accept either.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.routers = list(loaded.routers)
        for hooks in (self._hooks, self._indexers):
            if hooks is not None:
                hooks.remove()
        self._hooks = self._indexers = None
        if self.config.return_routed_experts:
            if not self.routers and loaded.router_problems:
                path, why = next(iter(loaded.router_problems.items()))
                raise UserError(f"engine.return_routed_experts: this model's routers cannot be recorded as experts "
                                f"and weights r3 replays ({path}: {why})")
            if not self.routers:
                raise ValueError(
                    "engine.return_routed_experts is set, but the model has no MoE routers "
                    f"(model family {loaded.family or '?'!r} lists none): routing capture needs a mixture-of-experts model"
                )
            from skyrl_toolkit.routing import RouterHooks, expert_dtype

            self._hooks = RouterHooks(self.model, self.routers)
            self.route_dtype = expert_dtype(self._hooks.n_experts)
            if indexer_paths(self.model):  # GLM-5, DeepSeek-V3.2: r3 replays the indexer's key picks too
                self._indexers = IndexerCapture(self.model)
        budget = int(getattr(self.config, "turn_cache_mb", 0)) << 20
        # Conversations keep their KV between turns where every layer is full attention
        # and no routes are recorded (those re-prefill the history with its routes forced).
        self._turns = (TurnCache(budget) if budget and self._hooks is None and reusable_layers(self.model.config)
                       else None)

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
        if self.precision is not None:  # quantized payloads + scales -> the weights the trainer computed with
            named_tensors = self.precision.unpack(named_tensors, self.dtype)
        with self._forward_lock:  # between two forwards of a generation in progress, never inside one
            self.last_update = copy_weights(self._params, self._buffers, named_tensors)
            self.weight_version = int(version)
            self._base_version += 1
            self._base_label = int(version)
            if self._turns is not None:
                self._turns.clear()  # KV of the old weights

    def abort_on_update(self, enabled: bool) -> None:
        """The AbortingUpdates capability: with ``enabled``, an update that lands between two
        decode steps aborts the generation's live requests and resubmits them, each with
        its prompt and the tokens it generated so far as the new prompt, prefilled with the
        new weights (the old weights' KV is dropped); their tokens and logprobs so far stay
        as sampled, and ``token_versions`` says which version sampled each."""
        if enabled and self.config.return_routed_experts:
            raise UserError(
                "[job] weight_updates = \"abort\" cannot be used with [engine] return_routed_experts = true: a "
                "resubmitted request's earlier tokens would have two sets of routes (the ones their logprobs came "
                "from and the new prefill's); use weight_updates = \"in_flight\" or \"idle\""
            )
        self._abort_on_update = bool(enabled)

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
        if self._turns is not None:
            self._turns.clear()  # KV of the old adapter
        self.last_update = {"copied": 2 * len(bank.tensors), "shared": 0, "bytes": self.adapters.staged_bytes}

    # -- generation ----------------------------------------------------------

    def side_channels(self, sampler: Sampler) -> set[str]:
        """The SideChannels capability: ``routed_experts`` with
        ``engine.return_routed_experts``, ``sample_support`` when the sampler asks for
        support sets."""
        return ({"routed_experts"} if self.config.return_routed_experts else set()) | (
            {"sample_support"} if wants_support(sampler) else set()) | (
            {INDEXER_CHANNEL} if self._indexers is not None else set()) | (
            {"token_versions"} if getattr(self.config, "return_token_versions", False) else set())

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
        if self._indexers is not None:
            picks = history.side_channels.get(INDEXER_CHANNEL)
            if picks is None:
                raise ValueError(
                    f"continue_turn: the engine returns the indexer's key picks, but the history has no "
                    f"{INDEXER_CHANNEL!r} side channel to keep its earlier turns' picks"
                )
            force = [(r, picks[history.cu_seqlens[i] : history.cu_seqlens[i + 1] - 1]) for i, r in enumerate(force)]
        prompts = [list(map(int, history.sequence(i))) + list(map(int, t)) for i, t in enumerate(turns)]
        kept = None
        if self._turns is not None:  # each history but its last token may be kept from the turn before
            kept = [int(n) - 1 for n in history.seq_lens]
        full = self._run(prompts, 1, sampler, max_new_tokens, seed, 0, force, kept)
        return turn_segment(full, history)

    def _run(
        self,
        prompts: list[list[int]],
        n: int,
        sampler: Sampler,
        max_new_tokens: int,
        seed: int,
        group_offset: int,
        force: list[np.ndarray] | None,
        kept: list[int] | None = None,
    ) -> RolloutBatch:
        """``kept``: per prompt, how many of its first tokens the turn cache may hold
        (continue_turn: the history but its last token); the KV of what each call feeds
        is kept for the next turn then."""
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
            return self._run_pinned(model, prompts, n, sampler, max_new_tokens, seed, group_offset, force,
                                    serving.version, kept if n == 1 else None)

    def _run_pinned(
        self, model: torch.nn.Module, prompts: list[list[int]], n: int, sampler: Sampler, max_new_tokens: int,
        seed: int, group_offset: int, force: list[np.ndarray] | None, version: int, kept: list[int] | None = None,
    ) -> RolloutBatch:
        total = len(prompts) * n
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed))
        self._call_base, self._call_label = self._base_version, version  # labels: `version` until an update lands
        resp_ver = np.full((total, max_new_tokens), version, dtype=np.int64)
        prompt_ver = np.full(len(prompts), version, dtype=np.int64)

        resp = np.zeros((total, max_new_tokens), dtype=np.int32)
        resp_lp = np.zeros((total, max_new_tokens), dtype=np.float32)
        resp_len = np.zeros(total, dtype=np.int64)
        stopped = np.zeros(total, dtype=bool)
        want_support = wants_support(sampler)
        support_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (row key, row length, values)
        hooks, indexers = self._hooks, self._indexers
        if hooks is not None:
            shape = (hooks.n_layers, hooks.k)
            prompt_routes = [np.zeros((len(p), *shape), dtype=self.route_dtype) for p in prompts]
            resp_routes = np.zeros((total, max_new_tokens, *shape), dtype=self.route_dtype)
        if indexers is not None:
            prompt_picks = [indexers.empty(len(p)) for p in prompts]
            resp_picks = indexers.empty(total, max_new_tokens)
        step = self.config.max_batch_size
        training = model.training
        if not self._own_module:
            model.eval()
        try:
            # no_grad rather than inference_mode: the parameters and buffers may be the
            # trainer's own, and nothing made here must be an inference tensor.
            with torch.no_grad(), (hooks.recording() if hooks is not None else contextlib.nullcontext()), (
                    indexers.recording() if indexers is not None else contextlib.nullcontext()):
                for s0 in range(0, total, step):
                    s1 = min(total, s0 + step)
                    p0, p1 = s0 // n, (s1 - 1) // n + 1
                    rep = torch.arange(s0, s1, device=self.device) // n - p0
                    reuse = None
                    if kept is not None and self._turns is not None:
                        reuse = [self._turns.take(prompts[i][: kept[i]]) if kept[i] > 0 else None for i in range(p0, p1)]
                    out = self._generate_chunk(
                        model, prompts[p0:p1], rep, sampler, max_new_tokens, generator, want_support,
                        None if force is None else force[p0:p1], reuse,
                    )
                    resp[s0:s1], resp_lp[s0:s1], resp_len[s0:s1], stopped[s0:s1] = out[:4]
                    prompt_ver[p0:p1], resp_ver[s0:s1] = out[7]
                    if want_support:
                        keys, lens, values = out[4]
                        support_parts.append((keys + s0 * max_new_tokens, lens, values))
                    if hooks is not None:
                        pre, dec = out[5]
                        for i, r in enumerate(pre):
                            prompt_routes[p0 + i] = r
                        resp_routes[s0:s1] = dec
                    if indexers is not None:
                        pre, dec = out[6]
                        prompt_picks[p0 : p0 + len(pre)] = pre
                        resp_picks[s0:s1] = dec
        finally:
            if not self._own_module:
                model.train(training)
        generated = resp_len.copy()
        if self.config.stop_strings:
            cut_at_stop_strings(self.tokenizer, self.config.stop_strings, resp, resp_len, stopped)
            if hooks is not None:  # a cut response's last token is never fed back: its routes row is 0, as at a stop token
                for i in np.flatnonzero(resp_len < generated):
                    resp_routes[i, resp_len[i] - 1 :] = 0
            if indexers is not None:
                for i in np.flatnonzero(resp_len < generated):
                    resp_picks[i, resp_len[i] - 1 :] = -1
        batch = assemble_batch(prompts, n, resp, resp_lp, resp_len, stopped, group_offset, version)
        if self._base_version != self._call_base or getattr(self.config, "return_token_versions", False):
            # Each sequence's version: its oldest token's (a generation an update landed in spans two).
            tv = np.empty(batch.n_tokens, dtype=np.int64)
            for i in range(batch.n_sequences):
                lo, p_len, L = int(batch.cu_seqlens[i]), int(batch.prompt_lens[i]), int(resp_len[i])
                tv[lo : lo + p_len] = prompt_ver[i // n]
                tv[lo + p_len : lo + p_len + L] = resp_ver[i, :L]
            batch.versions = np.asarray([tv[int(batch.cu_seqlens[i]) + int(batch.prompt_lens[i]):
                                            int(batch.cu_seqlens[i + 1])].min(initial=int(prompt_ver[i // n]))
                                         for i in range(batch.n_sequences)], dtype=batch.versions.dtype)
            if getattr(self.config, "return_token_versions", False):
                batch.side_channels["token_versions"] = tv.astype(np.int32)
        if want_support:
            support = support_csr(support_parts)
            if not np.array_equal(generated, resp_len):  # keep the rows of the tokens left after the cut
                starts = np.concatenate([[0], np.cumsum(generated)[:-1]])
                support = support.take(np.concatenate(
                    [np.arange(a, a + k, dtype=np.int64) for a, k in zip(starts, resp_len)]))
            batch.side_channels["sample_support"] = support
        if hooks is not None:
            batch.side_channels["routed_experts"] = routes_channel(batch, prompt_routes, resp_routes, n)
        if indexers is not None:
            batch.side_channels[INDEXER_CHANNEL] = routes_channel(batch, prompt_picks, resp_picks, n)
        batch.validate()
        return batch

    def _keep_turns(self, cache: Any, attn: torch.Tensor, prompts: list[list[int]], rows: torch.Tensor,
                    seq_of_row: torch.Tensor, out_tok: torch.Tensor, out_len: torch.Tensor) -> None:
        """Keep the KV of what batch ``rows`` fed (prompt, response but its last token) in
        the turn cache, under those token ids."""
        for r in rows.tolist():
            seq = int(seq_of_row[r])
            fed = len(prompts[seq]) + max(0, int(out_len[seq]) - 1)
            cols = torch.nonzero(attn[r])[:fed, 0]  # its real columns, in order (padding never is)
            if cols.numel() != fed:
                continue
            keys, values = row_kv(cache, r, cols)
            ids = list(prompts[seq]) + out_tok[seq, : fed - len(prompts[seq])].tolist()
            self._turns.put(ids, keys, values)

    def _forward(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any):
        with self._forward_lock:
            updated = self._base_version != getattr(self, "_call_base", self._base_version)
            self._fwd_version = self._base_label if updated else getattr(self, "_call_label", 0)
            self._fwd_base = self._base_version
            return self._forward_unlocked(model, ids, mask, pos, cache)

    def _forward_unlocked(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                          cache: Any):
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self._cache_kw: cache}, **self._extra
        )
        return out.logits[:, -1, :].float()

    def _resubmit(self, model: torch.nn.Module, prompts: list[list[int]], rep: torch.Tensor,
                  seq_of_row: torch.Tensor, out_tok: torch.Tensor, t: int, max_new: int) -> tuple[Any, ...]:
        """Resubmit the requests of batch rows ``seq_of_row`` after decode step ``t``: each
        one's prompt and its generated tokens ``0..t`` as one new prompt, prefilled (left-
        padded) with the weights now served, in a fresh cache with room for the decode
        steps left. Returns the cache, the attention mask, the logits of each row's next
        token, and the column offset ``width`` such that the token of step ``t2 > t`` is
        fed at column ``width + t2`` (as the decode loop counts)."""
        dev = self.device
        contexts = [list(prompts[int(rep[s])]) + out_tok[s, : t + 1].tolist() for s in seq_of_row.tolist()]
        rows = len(contexts)
        full = max(len(c) for c in contexts)
        cap = max(full, full + max_new - t - 2)  # tokens t+1 .. max_new-2 are still to be fed
        ids = torch.full((rows, full), self.pad_token_id, dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, full - len(c) :] = torch.tensor(c, dtype=torch.long)
        ids = ids.to(dev)
        lens = torch.tensor([len(c) for c in contexts], dtype=torch.long, device=dev)
        cols = torch.arange(full, device=dev)
        first = (full - lens)[:, None]
        attn = torch.zeros((rows, cap), dtype=torch.bool, device=dev)
        attn[:, :full] = cols[None, :] >= first
        cache = make_cache(model.config, cap)
        logits = self._forward(model, ids, attn[:, :full], (cols[None, :] - first).clamp_min(0), cache)
        self.resubmitted += rows
        return cache, attn, logits, full - (t + 1)

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
        reuse: list[Any] | None = None,
    ) -> tuple[Any, ...]:
        """``reuse`` (continue_turn with the turn cache): per prompt, the kept KV of its
        first tokens or None; then only the rest is prefilled, and what this call feeds
        is kept for the next turn."""
        dev = self.device
        hooks, indexers = self._hooks, self._indexers
        force_picks = None
        if force is not None and indexers is not None:  # (routes, indexer picks) per conversation
            force, force_picks = [f[0] for f in force], [f[1] for f in force]
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        n_prompts = len(prompts)
        store = reuse is not None
        if reuse is not None and any(e is not None for e in reuse):
            # Row i: [padding | its kept KV (c_i tokens) | padding | its other s_i tokens], the
            # kept parts right-aligned at column `before`, the rest right-aligned after it;
            # the attention mask hides both paddings, positions count on from c_i.
            c = [0 if e is None else int(e[2]) for e in reuse]
            rest = [len(p) - ci for p, ci in zip(prompts, c)]
            before, fill = max(c), max(rest)
            width = before + fill
            cap = width + max_new - 1
            ids = torch.full((n_prompts, fill), self.pad_token_id, dtype=torch.long)
            pos = torch.zeros((n_prompts, fill), dtype=torch.long)
            attn = torch.zeros((n_prompts, max(cap, width)), dtype=torch.bool, device=dev)
            for i, (p, ci, si) in enumerate(zip(prompts, c, rest)):
                ids[i, fill - si :] = torch.tensor(p[ci:], dtype=torch.long)
                pos[i, fill - si :] = torch.arange(ci, ci + si)
                attn[i, before - ci : before] = True
                attn[i, width - si : width] = True
            ids, pos = ids.to(dev), pos.to(dev)
            cache = cache_with_prefix(model.config, cap, reuse, before)
            prefill_cols = width
        else:
            width = int(lens.max())
            cap = width + max_new - 1  # the last sampled token is never fed back
            ids = torch.full((n_prompts, width), self.pad_token_id, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            ids = ids.to(dev)
            cols = torch.arange(width, device=dev)
            first = (width - lens)[:, None]
            pos = (cols[None, :] - first).clamp_min(0)
            attn = torch.zeros((n_prompts, max(cap, width)), dtype=torch.bool, device=dev)
            attn[:, :width] = cols[None, :] >= first
            cache = make_cache(model.config, cap)
            prefill_cols = width

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
        with forcing, (indexers.prefill_forcing(prompts, force_picks, width, dev) if indexers is not None
                       else contextlib.nullcontext()):
            logits = self._forward(model, ids, mask_upto(prefill_cols), pos, cache)
        prefill_version = self._fwd_version
        logits_version = prefill_version  # the version of the forward the current logits came from
        kv_base = self._fwd_base  # the weights the cache's KV was made with
        aborting = self._abort_on_update
        if indexers is not None:
            pre_picks = indexers.after_prefill(prompts, width, dev)
        if hooks is not None:
            pre_all = hooks.take().reshape(n_prompts, width, hooks.n_layers, hooks.k).cpu().numpy()
            pre_routes = [pre_all[i, width - len(p) :].astype(self.route_dtype) for i, p in enumerate(prompts)]

        rows = rep.numel()
        if rows != n_prompts or not torch.equal(rep, torch.arange(rows, device=dev)):
            select_rows(cache, rep)
            attn = attn.index_select(0, rep)
            logits = logits.index_select(0, rep)
        next_pos = lens.index_select(0, rep)

        out_tok = torch.zeros((rows, max_new), dtype=torch.int32, device=dev)
        out_lp = torch.zeros((rows, max_new), dtype=torch.float32, device=dev)
        out_len = torch.zeros(rows, dtype=torch.long, device=dev)
        out_stop = torch.zeros(rows, dtype=torch.bool, device=dev)
        out_ver = np.full((rows, max_new), prefill_version, dtype=np.int64)  # version of each token's forward
        if hooks is not None:
            # Routes of each response token fed back (the last one never is: it stays 0).
            out_routes = torch.zeros((rows, max_new, hooks.n_layers, hooks.k), dtype=torch.int32, device=dev)
        if indexers is not None:  # the key picks of each response token fed back (the last one's stay -1)
            out_picks = torch.full((rows, max_new, *indexers.shape), -1, dtype=torch.int32, device=dev)
            first_col = width - lens.index_select(0, rep)  # cache column of each chunk sequence's first token
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
            if logits_version != prefill_version:
                out_ver[live_seq.cpu().numpy(), t] = logits_version
            hit = torch.isin(tok, self._stops)
            if self._stop_scan is not None:  # a response whose text now holds a stop string ends here too
                hit |= self._stop_scan.hits(out_tok.index_select(0, live_seq), t)
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
                    if store and self._base_version == self._call_base:  # finished rows leave: keep their KV
                        gone = torch.ones(rows, dtype=torch.bool, device=dev)
                        gone[alive] = False
                        self._keep_turns(cache, attn, prompts, torch.nonzero(gone)[:, 0], seq_of_row, out_tok, out_len)
                    select_rows(cache, alive)
                    attn = attn.index_select(0, alive)
                    next_pos = next_pos.index_select(0, alive)
                    seq_of_row = seq_of_row.index_select(0, alive)
                    feed = tok
                    rows = alive.numel()
                    alive = None
            slot = width + t
            # abort_on_update: the check and the forward under one hold of the lock, so an
            # update cannot land between them.
            with (self._forward_lock if aborting else contextlib.nullcontext()):
                resubmit = aborting and self._base_version != kv_base
                if resubmit:  # new weights: abort the live requests, resubmit them with what they generated
                    if alive is not None:
                        seq_of_row, next_pos = seq_of_row.index_select(0, alive), next_pos.index_select(0, alive)
                        alive = None
                    rows = seq_of_row.numel()
                    cache, attn, logits, width = self._resubmit(model, prompts, rep, seq_of_row, out_tok, t,
                                                                max_new)
                    kv_base = self._fwd_base
                else:
                    attn[:, slot] = True
                    logits = self._forward(model, feed[:, None], mask_upto(slot + 1), next_pos[:, None], cache)
            logits_version = self._fwd_version
            if resubmit:
                next_pos = next_pos + 1
                continue
            if hooks is not None:
                step_routes = hooks.take()  # [rows, L, k]: the routes of response token t of each row
                if alive is None:
                    out_routes[seq_of_row, t] = step_routes.to(torch.int32)
                else:
                    out_routes[seq_of_row.index_select(0, alive), t] = step_routes.index_select(0, alive).to(torch.int32)
            if indexers is not None:
                step_picks = indexers.after_step(first_col.index_select(0, seq_of_row), next_pos)
                if alive is None:
                    out_picks[seq_of_row, t] = step_picks
                else:
                    out_picks[seq_of_row.index_select(0, alive), t] = step_picks.index_select(0, alive)
            next_pos = next_pos + 1
        store = store and self._base_version == self._call_base  # KV made across an update is not kept
        if store:
            self._keep_turns(cache, attn, prompts, torch.arange(rows, device=dev), seq_of_row, out_tok, out_len)
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
        picks = None
        if indexers is not None:
            picks = (pre_picks, out_picks.cpu().numpy())
        versions = (np.full(n_prompts, prefill_version, dtype=np.int64), out_ver)
        return out + (support, routes, picks, versions)

"""Continuous batching over an embedded engine's model: requests join a running decode.

:class:`ContinuousBatcher` owns one decode thread. Callers :meth:`~ContinuousBatcher.submit`
requests from any thread and get a :class:`concurrent.futures.Future`; the thread loops:

1. **Admit**: waiting sequences fill the free rows (at most ``config.max_batch_size``
   live rows; a request's ``n`` samples may join over several steps): at the next step
   when at least a quarter of the rows are free (``ADMIT_FRACTION``), else once they
   have waited ``ADMIT_WAIT`` steps, since prefilling a handful of rows costs about as
   much as a whole decode step. The newcomers'
   distinct prompts are prefilled in one batched forward (left-padded, explicit position
   ids, a 2-D mask; each prompt once, its rows replicated to its samples), and their KV
   rows are put into the running cache (``skyrl_engines._kv_cache.SlotLayer``): every
   live row shares one filled length, newcomers are right-aligned to it (or the running
   rows move right when a newcomer's prompt is longer), the mask hides the padding.
2. **Sample** every live row with its request's own parameters (temperature, top-k,
   top-p; temperature 0 is greedy) and its own random stream: the uniform draw of sample
   ``j`` of a request at its token ``t`` is a hash of ``(seed, j, t)``, so what a request
   samples does not depend on what else is in the batch (beyond float noise in the
   logits) nor on when it was admitted.
3. **Stop**: a row ends at one of the engine's or the request's stop tokens, at a stop
   string (its recent text is decoded each step), or at ``max_tokens``; it is removed at
   once (the last live row moves into its slot) and its request's future resolves when
   its last sample ends: tokens, logprobs and stop reason per sample.
4. **Decode**: one forward for every live row. LoRA adapters are per row: rows are
   grouped by adapter and each group gets its own adapter's delta
   (``EngineAdapters.per_row``); rows without an adapter get the base model.

A model with other cache layers than attention (linear attention, Mamba states) cannot
take rows into a running cache: it decodes in **waves** (the waiting requests start
together whenever the batch is empty; still one batch across requests and adapters).

**Faults stay with their request.** When a step fails (a request's own forward raised,
past every check at submit), the batch cannot tell whose row it was: every request in it
starts over alone, first in line (its samples are seeded per token, so it gives what it
would have given), and only a request whose run alone fails gets the error; the others,
and the batching after them, go on (``stats["isolated"]`` counts the restarts).

Columns no live row uses any more (on the left) are dropped when they are a tenth of
the filled width or when the cache needs room, so the width stays near the longest live
row. Randomness never comes from a shared generator.

Sampling logprobs are those of the distribution each token was drawn from (log_softmax
of the scaled, truncated logits, as ``skyrl_samplers``' "processed"); greedy rows report
``log_softmax(logits)`` (temperature 1), as the greedy sampler does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import traceback
from typing import Any, Mapping, Sequence

import attrs
import numpy as np
import torch

from skyrl_engines._kv_cache import make_cache, make_slot_cache, select_rows, slot_cache_supported

M32 = 0xFFFFFFFF
log = logging.getLogger("skyrl.engine")
NEG_INF = float("-inf")
MASK_LOGPROB = -99999.0  # the SDK's "no top-k entry here" (tinker.types.topk_logprobs)
TRIM_FRACTION = 0.1  # drop unused left columns once they are this share of the filled width
# Newcomers join a running batch once this share of its rows is free (or they waited
# ADMIT_WAIT steps): a prefill forward of a few rows costs about a whole decode step.
ADMIT_FRACTION = 0.25
ADMIT_WAIT = 8


def _mul32(x: Any, c: int) -> Any:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` without leaving int64 (python ints or tensors)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x: Any) -> Any:
    """A 32-bit integer hash (same results for python ints and int64 tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int, sample: int) -> int:
    """The random stream of sample ``sample`` of a request seeded ``seed``."""
    return mix32(mix32(mix32(seed & M32) ^ ((seed >> 32) & M32)) ^ (sample & M32))


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in [0, 1) with 53 random bits, one per (stream key, token index)."""
    a = mix32(keys ^ mix32((2 * steps) & M32))
    b = mix32(keys ^ mix32((2 * steps + 1) & M32))
    return ((a >> 5) * 67108864 + (b >> 6)).double() / 9007199254740992.0


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                keys: torch.Tensor, steps: torch.Tensor, want_kept: bool = False) -> tuple[torch.Tensor, ...]:
    """One token per row of ``logits`` [R, V] with that row's parameters (``temperature``
    0: greedy; ``top_k`` 0: off; ``top_p`` 1: off) and its uniform from ``(keys, steps)``;
    returns (token ids int64 [R], logprobs float32 [R]). The truncation order and the
    ranking (by scaled logit, equal logits by id) are ``skyrl_samplers``'. ``want_kept``:
    also the bool [R, V] mask of the tokens each row could be drawn from (greedy: its token)."""
    rows, vocab = logits.shape
    tok = torch.empty(rows, dtype=torch.long, device=logits.device)
    lp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    greedy = temperature == 0
    kept = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device) if want_kept else None
    g = torch.nonzero(greedy)[:, 0]
    if g.numel():
        x = logits.index_select(0, g)
        t = torch.argmax(x, dim=-1)
        tok[g] = t
        lp[g] = torch.log_softmax(x, dim=-1).gather(-1, t[:, None])[:, 0]
        if want_kept:
            kept[g, t] = True
    s = torch.nonzero(~greedy)[:, 0]
    if s.numel():
        x = logits.index_select(0, s) / temperature.index_select(0, s)[:, None]
        k, p = top_k.index_select(0, s), top_p.index_select(0, s)
        keep = x != NEG_INF
        if bool(((k > 0) & (k < vocab)).any()) or bool((p < 1).any()):
            ranked, order = torch.sort(x, dim=-1, descending=True, stable=True)
            cols = torch.arange(vocab, device=x.device)[None, :]
            ranked_keep = (ranked != NEG_INF) & ((k[:, None] <= 0) | (cols < k[:, None]))
            probs = torch.softmax(ranked.masked_fill(~ranked_keep, NEG_INF), dim=-1)
            mass_before = torch.cumsum(probs, dim=-1).roll(1, dims=-1)
            mass_before[:, 0] = 0.0  # the top token is always kept
            ranked_keep &= mass_before < p[:, None]
            keep = torch.zeros_like(keep).scatter_(-1, order, ranked_keep)
        logp = torch.log_softmax(x.masked_fill(~keep, NEG_INF), dim=-1)
        cdf = torch.cumsum(logp.exp().double(), dim=-1)
        u = uniforms(keys.index_select(0, s), steps.index_select(0, s)) * cdf[:, -1]
        idx = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
        # Rounding can put the draw past the last kept token's end: take that token.
        last_kept = (vocab - 1) - torch.argmax(keep.flip(-1).to(torch.int8), dim=-1)
        idx = torch.minimum(idx, last_kept)
        tok[s] = idx
        lp[s] = logp.gather(-1, idx[:, None])[:, 0]
        if want_kept:
            kept[s] = keep
    return (tok, lp, kept) if want_kept else (tok, lp)


@attrs.define(eq=False)
class Adapter:
    """A LoRA adapter to sample with: ``key`` names it (same key, same adapter; the batcher
    keeps the banks of recent keys), ``tensors`` ``{name: tensor}`` as
    ``EmbeddedEngine.adapter_slots`` names them, ``config`` rank / alpha / targets."""

    key: Any
    tensors: Mapping[str, Any]
    config: Mapping[str, Any]
    version: int = 0


@attrs.define(eq=False)
class _Request:
    prompt: list[int]
    n: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stops: frozenset
    stop_strings: tuple
    adapter: Adapter | None
    prompt_logprobs: bool
    record: bool
    future: concurrent.futures.Future
    topk_sample: int = 0
    topk_prompt: int = 0
    tokens: list = attrs.field(factory=list)
    logprobs: list = attrs.field(factory=list)
    reasons: list = attrs.field(factory=list)
    admitted: int = 0  # samples that got a row so far
    left: int = 0  # samples not finished
    budget: int = 0  # tokens counted against the queue until it finishes
    bank: Any = None
    prompt_lp: Any = None
    version: int = 0
    prompt_routes: Any = None
    routes: list = attrs.field(factory=list)
    kept: list = attrs.field(factory=list)
    topk: list = attrs.field(factory=list)
    prompt_topk: Any = None
    alone: bool = False  # a fault struck a batch it shared: it runs again with no other request

    def restart(self) -> None:
        """Forget every sample's progress: the request starts over (its samples are seeded
        per token, so it gives what it would have given)."""
        n = self.n
        self.admitted, self.left = 0, n
        self.tokens, self.logprobs, self.reasons = [None] * n, [None] * n, [None] * n
        self.routes, self.kept, self.topk = [None] * n, [None] * n, [None] * n
        self.prompt_lp = self.prompt_routes = self.prompt_topk = None


@attrs.define(eq=False)
class _Row:
    request: _Request
    j: int  # sample index in the request
    key: int
    first_col: int  # cache column of the prompt's first token
    tokens: list = attrs.field(factory=list)
    logprobs: list = attrs.field(factory=list)
    routes: list = attrs.field(factory=list)  # with record: the routers' expert ids of each token fed back
    kept: list = attrs.field(factory=list)  # with record: the ids each token could be drawn from
    topk: list = attrs.field(factory=list)  # with topk_sample: (ids, logprobs) of the k most likely, per token


class ContinuousBatcher:
    """Continuous batching over ``engine`` (a started ``EmbeddedEngine``; see the module
    docstring). ``max_rows``: the live-row cap (default ``engine.config.max_batch_size``).
    Thread-safe ``submit``; one decode thread, started at the first request;
    :meth:`close` stops it. ``stats`` counts forwards, rows and tokens. ``bank_cache``:
    how many adapters (by key, most recently used) keep their bank on the device.
    While it decodes, nothing else may run the engine (its router hooks record for
    one caller at a time); the model is used as it is (the embedded engine's own copy
    is in eval mode)."""

    def __init__(self, engine: Any, max_rows: int | None = None, bank_cache: int = 32):
        if engine.model is None:
            raise RuntimeError("the engine has not been started (call start(loaded) first)")
        self.engine = engine
        self.model = engine.model
        self.device = engine.device
        self.max_rows = int(max_rows or engine.config.max_batch_size)
        self.pad = int(engine.pad_token_id)
        self.tokenizer = engine.tokenizer
        self.vocab = int(self.model.get_input_embeddings().num_embeddings)
        self._cache_kw = engine._cache_kw
        self.hooks = engine._hooks  # RouterHooks when the engine records routes (nobody else records meanwhile)
        self.slots = slot_cache_supported(self.model.config)  # else linear attention / Mamba: waves (see waves)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._queued_tokens = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._banks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._bank_cache = bank_cache
        self.stats = {"decode_forwards": 0, "prefill_forwards": 0, "tokens": 0, "requests": 0, "max_rows": 0,
                      "max_adapters": 0, "decode_columns": 0, "decode_rows": 0, "isolated": 0}
        self._newcomers: list[tuple[_Request, int]] = []  # the sequences joining in the step under way

    # -- the callers' side ------------------------------------------------------------

    @property
    def queued_tokens(self) -> int:
        """Tokens (prompt + max_tokens per sequence) of the requests waiting or decoding."""
        return self._queued_tokens

    @staticmethod
    def cost(prompt_len: int, n: int, max_tokens: int) -> int:
        """What a request counts against :attr:`queued_tokens`."""
        return n * (prompt_len + max_tokens)

    def submit(self, prompt_ids: Sequence[int], *, n: int = 1, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, max_tokens: int = 16, stop_token_ids: Sequence[int] = (),
               stop_strings: Sequence[str] = (), adapter: Adapter | None = None,
               prompt_logprobs: bool = False, record: bool = False, topk_sample_logprobs: int = 0,
               topk_prompt_logprobs: int = 0) -> concurrent.futures.Future:
        """Queue ``n`` samples of ``prompt_ids``; the future's result is ``{"sequences": [{
        "tokens": int32, "logprobs": float32, "stop_reason": "stop" | "length"}] * n,
        "prompt_logprobs": float32 [len(prompt)] (NaN first) or None, "version": int}``.
        The engine's own stop tokens always stop too; a stop token or string is kept.
        ``record``: each sequence also gets ``"kept"`` (a list of int32 arrays: the ids each
        token could be drawn from) and, on an engine that records its MoE routers
        (``return_routed_experts``), ``"routes"`` [tokens, layers, k] (the last token's row
        0: never fed back); the result then has ``"prompt_routes"`` [prompt, layers, k].
        ``topk_sample_logprobs`` k: each sequence gets ``"topk"`` (token ids int32 [tokens,
        k], logprobs float32), the k most likely tokens of the model's distribution
        (``log_softmax(logits)``) at each sampled position; ``topk_prompt_logprobs`` k:
        ``"prompt_topk"`` alike for each prompt position (the first, which nothing
        predicts: ids 0, logprobs -99999, the SDK's empty entry)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty: it needs at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ValueError(f"the prompt holds a token outside the vocabulary (0..{self.vocab - 1})")
        if n < 1 or max_tokens < 1:
            raise ValueError(f"n and max_tokens must be at least 1, found n={n}, max_tokens={max_tokens}")
        if not temperature >= 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"expected temperature >= 0, top_k >= 0, 0 < top_p <= 1; found {temperature}, {top_k}, "
                             f"{top_p}")
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer, and this engine has none")
        future: concurrent.futures.Future = concurrent.futures.Future()
        req = _Request(prompt, int(n), float(temperature), int(top_k), float(top_p), int(seed), int(max_tokens),
                       frozenset(int(t) for t in (*self.engine.stop_token_ids, *stop_token_ids)),
                       tuple(s for s in (*getattr(self.engine.config, "stop_strings", ()), *stop_strings) if s),
                       adapter, bool(prompt_logprobs), bool(record), future,
                       min(int(topk_sample_logprobs), self.vocab), min(int(topk_prompt_logprobs), self.vocab))
        req.left = req.n
        req.tokens, req.logprobs, req.reasons = [None] * req.n, [None] * req.n, [None] * req.n
        req.routes, req.kept, req.topk = [None] * req.n, [None] * req.n, [None] * req.n
        req.budget = self.cost(len(prompt), req.n, req.max_tokens)
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._waiting.append(req)
            self._queued_tokens += req.budget
            self.stats["requests"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="skyrl-batcher", daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def close(self) -> None:
        """Stop the decode thread; requests still waiting or decoding fail."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the decode thread --------------------------------------------------------------

    def _loop(self) -> None:
        self._reset()
        while True:
            with self._cond:
                while not self._waiting and not self.rows and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
            try:
                with torch.no_grad():
                    self._step()
            except Exception as exc:  # noqa: BLE001 - a fault: isolate it to its request, the loop goes on
                detail = traceback.format_exc()
                involved = {id(r.request): r.request for r in self.rows}
                for req, _ in self._newcomers:
                    involved.setdefault(id(req), req)
                self._reset()
                if len(involved) == 1 or any(r.alone for r in involved.values()):
                    for req in involved.values():  # it ran alone: the fault is its own
                        self._fail(req, RuntimeError(f"{type(exc).__name__}: {exc}".splitlines()[0]), detail)
                else:
                    self._isolate(list(involved.values()))
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for req in {id(r.request): r.request for r in self.rows}.values():
            waiting.append(req)
        for req in waiting:
            self._fail(req, RuntimeError("the batcher was closed"), None)

    def _reset(self) -> None:
        self.rows: list[_Row] = []
        self.cache = make_slot_cache(self.model.config, self.max_rows) if self.slots else None
        self.capacity = 0
        self.length = 0
        self.attn = torch.zeros((self.max_rows, 0), dtype=torch.bool, device=self.device)
        self.next_pos = torch.zeros(self.max_rows, dtype=torch.long, device=self.device)
        self.logits: torch.Tensor | None = None
        self._params: tuple | None = None  # per-row sampling tensors, rebuilt when the rows change
        self._held = 0  # steps newcomers have been kept waiting for more free rows
        self._groups: list | None = None

    def _isolate(self, requests: list[_Request]) -> None:
        """A fault struck a batch of several requests, and which one caused it is unknown:
        each starts over alone, first in line, so only the one whose own run fails fails."""
        log.warning("a fault struck a batch of %d requests: each runs again alone", len(requests))
        self.stats["isolated"] += len(requests)
        with self._cond:
            ids = {id(r) for r in requests}
            rest = [r for r in self._waiting if id(r) not in ids]
            for req in requests:
                req.restart()
                req.alone = True
            self._waiting = collections.deque([*requests, *rest])

    def _fail(self, req: _Request, exc: Exception, detail: str | None) -> None:
        with self._cond:
            self._queued_tokens -= req.budget
            req.budget = 0
        if not req.future.done():
            req.future.set_exception(exc)

    def _bank(self, adapter: Adapter | None) -> Any:
        if adapter is None:
            return None
        bank = self._banks.get(adapter.key)
        if bank is None:
            bank = self.engine.adapters.build(list(adapter.tensors.items()), adapter.config, adapter.version)
            self._banks[adapter.key] = bank
            while len(self._banks) > self._bank_cache:
                self._banks.popitem(last=False)
        else:
            self._banks.move_to_end(adapter.key)
        return bank

    def _take_newcomers(self) -> list[tuple[_Request, int]]:
        """(request, sample index) of the sequences that join now."""
        free = self.max_rows - len(self.rows)
        out: list[tuple[_Request, int]] = []
        if not free or not self._waiting or (self.rows and not self.slots):
            return out
        while self._waiting and self._waiting[0].future.done():
            with self._cond:
                self._waiting.popleft()
        if self._waiting and self._waiting[0].alone or any(r.request.alone for r in self.rows):
            # A request being isolated runs with no other: it starts when the batch is empty
            # and nobody joins it (its own later samples do).
            head = self._waiting[0] if self._waiting else None
            live = {id(r.request) for r in self.rows}
            if head is None or not head.alone or (live and live != {id(head)}):
                return out
            k = min(free, head.n - head.admitted)
            out = [(head, head.admitted + i) for i in range(k)]
            head.admitted += k
            if head.admitted == head.n:
                with self._cond:
                    self._waiting.popleft()
            return out
        if self.rows and free < ADMIT_FRACTION * self.max_rows and self._held < ADMIT_WAIT:
            self._held += 1  # a few rows free: let more finish first, a few steps at most
            return out
        self._held = 0
        with self._cond:
            while free and self._waiting:
                req = self._waiting[0]
                if req.future.done():  # failed (its adapter, a fault): its other samples never start
                    self._waiting.popleft()
                    continue
                k = min(free, req.n - req.admitted)
                out += [(req, req.admitted + i) for i in range(k)]
                req.admitted += k
                free -= k
                if req.admitted == req.n:
                    self._waiting.popleft()
        return out

    def _step(self) -> None:
        newcomers = self._take_newcomers()
        self._newcomers = newcomers
        if newcomers:
            self._admit(newcomers)
        self._newcomers = []
        if not self.rows:
            return
        tok, lp = self._sample()
        tok_list, lp_list = tok.tolist(), lp.tolist()
        finished: list[int] = []
        for i, row in enumerate(self.rows):
            t, req = tok_list[i], row.request
            row.tokens.append(t)
            row.logprobs.append(lp_list[i])
            if t in req.stops or (req.stop_strings and self._holds_stop_string(row)):
                finished.append(i)
                self._finish(row, "stop")
            elif len(row.tokens) >= req.max_tokens:
                finished.append(i)
                self._finish(row, "length")
        self.stats["tokens"] += len(tok_list)
        if finished:
            tok = self._remove(finished, tok)
        if self.rows:
            self._decode(tok)

    def _holds_stop_string(self, row: _Row) -> bool:
        strings = row.request.stop_strings
        window = 4 * max(len(s) for s in strings) + 4  # a string the newest token completes lies in here
        text = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=False)
        return any(s in text for s in strings)

    def _finish(self, row: _Row, reason: str) -> None:
        req = row.request
        req.tokens[row.j] = np.asarray(row.tokens, dtype=np.int32)
        req.logprobs[row.j] = np.asarray(row.logprobs, dtype=np.float32)
        req.reasons[row.j] = reason
        if req.topk_sample:
            req.topk[row.j] = (np.stack([t[0] for t in row.topk]).astype(np.int32),
                               np.stack([t[1] for t in row.topk]).astype(np.float32))
        if req.record:
            req.kept[row.j] = row.kept
            if self.hooks is not None:
                shape = (self.hooks.n_layers, self.hooks.k)
                routes = np.zeros((len(row.tokens), *shape), dtype=self.engine.route_dtype)
                if row.routes:
                    routes[: len(row.routes)] = np.stack(row.routes)
                req.routes[row.j] = routes
        req.left -= 1
        if req.left == 0:
            with self._cond:
                self._queued_tokens -= req.budget
                req.budget = 0
            result = {"sequences": [{"tokens": t, "logprobs": p, "stop_reason": r}
                                    for t, p, r in zip(req.tokens, req.logprobs, req.reasons)],
                      "prompt_logprobs": req.prompt_lp, "version": req.version}
            if req.topk_sample:
                for j, seq in enumerate(result["sequences"]):
                    seq["topk"] = req.topk[j]
            if req.topk_prompt:
                result["prompt_topk"] = req.prompt_topk
            if req.record:
                for j, seq in enumerate(result["sequences"]):
                    seq["kept"] = req.kept[j]
                    if self.hooks is not None:
                        seq["routes"] = req.routes[j]
                result["prompt_routes"] = req.prompt_routes
            if not req.future.done():
                req.future.set_result(result)

    # -- admission ---------------------------------------------------------------------

    def _admit(self, newcomers: list[tuple[_Request, int]]) -> None:
        reqs: list[_Request] = []
        index: dict[int, int] = {}
        rep: list[int] = []
        for req, _ in newcomers:
            if id(req) not in index:
                index[id(req)] = len(reqs)
                reqs.append(req)
            rep.append(index[id(req)])
        ok = []
        for req in reqs:  # an adapter that does not fit fails its request alone
            try:
                if req.adapter is not None and req.bank is None:
                    req.bank = self._bank(req.adapter)
                ok.append(True)
            except Exception as exc:  # noqa: BLE001 - AdapterError and the like: the request's own error
                ok.append(False)
                self._fail(req, ValueError(str(exc).splitlines()[0]), None)
        if not all(ok):
            keep = [i for i, (req, _) in enumerate(newcomers) if ok[rep[i]]]
            newcomers = [newcomers[i] for i in keep]
            if not newcomers:
                return
            return self._admit(newcomers)
        dev = self.device
        lens = [len(r.prompt) for r in reqs]
        width = max(lens)
        ids = torch.full((len(reqs), width), self.pad, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - lens[i]:] = torch.tensor(r.prompt, dtype=torch.long)
        ids = ids.to(dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        cols = torch.arange(width, device=dev)
        first = (width - lens_t)[:, None]
        pos = (cols[None, :] - first).clamp_min(0)
        mask = cols[None, :] >= first
        most = max(r.max_tokens for r in reqs)
        # Slots: the prompts' own cache, copied into the running one. Waves: it is the running one.
        pre_cache = make_cache(self.model.config, width if self.slots else width + most - 1)
        want_all = any(r.prompt_logprobs or r.topk_prompt for r in reqs)
        extra = {} if want_all else {"logits_to_keep": 1}
        if "logits_to_keep" not in self.engine._extra:
            extra = {}
        routes = self.hooks is not None and any(r.record for r in reqs)
        with self._adapters([r.bank for r in reqs]), (self.hooks.recording() if routes else contextlib.nullcontext()):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             **{self._cache_kw: pre_cache}, **extra)
            if routes:
                pre = self.hooks.take().reshape(len(reqs), width, self.hooks.n_layers, self.hooks.k).cpu().numpy()
                for i, r in enumerate(reqs):
                    if r.record and r.prompt_routes is None:
                        r.prompt_routes = pre[i, width - lens[i]:].astype(self.engine.route_dtype)
        self.stats["prefill_forwards"] += 1
        logits = out.logits.float()
        version = int(self.engine.weight_version)
        for i, r in enumerate(reqs):
            r.version = version
            if r.prompt_logprobs and r.prompt_lp is None:
                lp = torch.log_softmax(logits[i, width - lens[i]: width - 1], dim=-1)
                got = lp.gather(-1, ids[i, width - lens[i] + 1:, None])[:, 0].cpu().numpy()
                r.prompt_lp = np.concatenate([[np.nan], got]).astype(np.float32)
            if r.topk_prompt and r.prompt_topk is None:
                lp = torch.log_softmax(logits[i, width - lens[i]: width - 1], dim=-1)
                v, ix = torch.topk(lp, r.topk_prompt, dim=-1)
                ids_k = np.zeros((lens[i], r.topk_prompt), dtype=np.int32)
                lps_k = np.full((lens[i], r.topk_prompt), MASK_LOGPROB, dtype=np.float32)
                ids_k[1:], lps_k[1:] = ix.cpu().numpy(), v.cpu().numpy()
                r.prompt_topk = (ids_k, lps_k)
        last = logits[:, -1, :]
        rep_t = torch.tensor(rep, dtype=torch.long, device=dev)

        if not self.slots:
            return self._start_wave(newcomers, pre_cache, rep_t, lens_t, width, width + most - 1, last)
        # Fit the newcomers into the running cache: one filled length for every row.
        old = len(self.rows)
        if old == 0:
            self.length = 0
            for layer in self.cache.layers:
                layer.rows = layer.length = 0
        grow, need = self._room(width, most)
        if need > self.capacity and old and min(r.first_col for r in self.rows):
            self._trim(min(r.first_col for r in self.rows))  # unused left columns first
            grow, need = self._room(width, most)
        if need > self.capacity:
            self._grow(max(need, self.capacity + self.capacity // 2, 64))
        if grow:
            for layer in self.cache.layers:
                if layer.is_initialized:
                    layer.shift(grow)
                else:
                    layer.length += grow
            self.attn[:old] = torch.cat([torch.zeros((old, grow), dtype=torch.bool, device=dev),
                                         self.attn[:old, : self.capacity - grow]], dim=1)
            for r in self.rows:
                r.first_col += grow
            self.length += grow
        new_rows = [_Row(req, j, stream_key(req.seed, j), self.length - len(req.prompt)) for req, j in newcomers]
        for layer, pre in zip(self.cache.layers, pre_cache.layers):
            k, v = pre.keys.index_select(0, rep_t), pre.values.index_select(0, rep_t)
            layer.reserve(self.capacity, like=(k, v))
            layer.put_rows(old, k, v)
        k_new = len(new_rows)
        self.attn[old : old + k_new] = False
        plen = lens_t.index_select(0, rep_t)
        ccols = torch.arange(self.capacity, device=dev)[None, :]
        self.attn[old : old + k_new] = (ccols >= (self.length - plen)[:, None]) & (ccols < self.length)
        self.next_pos[old : old + k_new] = plen
        new_logits = last.index_select(0, rep_t)
        self.logits = new_logits if old == 0 else torch.cat([self.logits, new_logits])
        self.rows += new_rows
        self._params = self._groups = None
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self.rows))

    def _start_wave(self, newcomers: list[tuple[_Request, int]], cache: Any, rep_t: torch.Tensor,
                    lens_t: torch.Tensor, width: int, capacity: int, last: torch.Tensor) -> None:
        """A model whose cache cannot take rows that come and go (linear attention, Mamba
        states) decodes in waves: the waiting requests start together when the batch is
        empty (still across requests and adapters), finished rows leave by ``select_rows``."""
        dev = self.device
        if not torch.equal(rep_t, torch.arange(len(lens_t), device=dev)):
            select_rows(cache, rep_t)
        self.cache, self.length, self.capacity = cache, width, capacity
        plen = lens_t.index_select(0, rep_t)
        cols = torch.arange(capacity, device=dev)[None, :]
        self.attn = torch.zeros((self.max_rows, capacity), dtype=torch.bool, device=dev)
        self.attn[: len(newcomers)] = (cols >= (width - plen)[:, None]) & (cols < width)
        self.next_pos[: len(newcomers)] = plen
        self.rows = [_Row(req, j, stream_key(req.seed, j), width - len(req.prompt)) for req, j in newcomers]
        self.logits = last.index_select(0, rep_t)
        self._params = self._groups = None
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self.rows))

    def _room(self, width: int, max_tokens: int) -> tuple[int, int]:
        """For newcomers of prompt width ``width``: how far the running rows move right,
        and the columns every row needs to its end after that."""
        grow = max(0, width - self.length)
        end = self.length + grow
        need = max([r.first_col + grow + len(r.request.prompt) + r.request.max_tokens - 1 for r in self.rows]
                   + [end + max_tokens - 1, end])
        return grow, need

    def _grow(self, capacity: int) -> None:
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.reserve(capacity)
        attn = torch.zeros((self.max_rows, capacity), dtype=torch.bool, device=self.device)
        attn[:, : self.capacity] = self.attn
        self.attn = attn
        self.capacity = capacity

    def _trim(self, drop: int) -> None:
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.shift(-drop)
        n = len(self.rows)
        self.attn[:n, : self.length - drop] = self.attn[:n, drop : self.length].clone()
        self.attn[:n, self.length - drop :] = False
        self.length -= drop
        for r in self.rows:
            r.first_col -= drop

    # -- sampling, removal, decode ---------------------------------------------------------

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._params is None:
            dev = self.device
            reqs = [r.request for r in self.rows]
            self._params = (
                torch.tensor([q.temperature for q in reqs], dtype=torch.float32, device=dev),
                torch.tensor([q.top_k for q in reqs], dtype=torch.long, device=dev),
                torch.tensor([q.top_p for q in reqs], dtype=torch.float32, device=dev),
                torch.tensor([r.key for r in self.rows], dtype=torch.long, device=dev),
                torch.tensor([len(r.tokens) for r in self.rows], dtype=torch.long, device=dev),
            )
        temp, top_k, top_p, keys, steps = self._params
        recording = [i for i, r in enumerate(self.rows) if r.request.record]
        out = sample_rows(self.logits, temp, top_k, top_p, keys, steps, want_kept=bool(recording))
        self._params = (temp, top_k, top_p, keys, steps + 1)
        topk_rows = [i for i, r in enumerate(self.rows) if r.request.topk_sample]
        if topk_rows:
            idx = torch.tensor(topk_rows, dtype=torch.long, device=self.device)
            kmax = max(self.rows[i].request.topk_sample for i in topk_rows)
            v, ix = torch.topk(torch.log_softmax(self.logits.index_select(0, idx), dim=-1), kmax, dim=-1)
            v, ix = v.cpu().numpy(), ix.cpu().numpy()
            for n, i in enumerate(topk_rows):
                k = self.rows[i].request.topk_sample
                self.rows[i].topk.append((ix[n, :k], v[n, :k]))
        if recording:
            kept = out[2]
            for i in recording:
                self.rows[i].kept.append(torch.nonzero(kept[i])[:, 0].to(torch.int32).cpu().numpy())
        return out[0], out[1]

    def _remove(self, finished: list[int], tok: torch.Tensor) -> torch.Tensor:
        """Drop the finished rows: live rows from the tail fill their slots."""
        if not self.slots:
            done = set(finished)
            keep = [i for i in range(len(self.rows)) if i not in done]
            self.rows = [self.rows[i] for i in keep]
            self._params = self._groups = None
            if not keep:
                return tok[:0]
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            select_rows(self.cache, idx)
            self.attn[: len(keep)] = self.attn.index_select(0, idx)
            self.next_pos[: len(keep)] = self.next_pos.index_select(0, idx)
            return tok.index_select(0, idx)
        n = len(self.rows)
        done = set(finished)
        live = n - len(done)
        holes = [i for i in finished if i < live]
        fillers = [i for i in range(live, n) if i not in done]
        dev = self.device
        src = torch.tensor(fillers, dtype=torch.long, device=dev)
        dst = torch.tensor(holes, dtype=torch.long, device=dev)
        for layer in self.cache.layers:
            layer.move_rows(src, dst, live)
        if holes:
            self.attn[dst] = self.attn[src]
            self.next_pos[dst] = self.next_pos[src]
            tok = tok.clone()
            tok[dst] = tok[src]
            for h, f in zip(holes, fillers):
                self.rows[h] = self.rows[f]
        del self.rows[live:]
        self._params = self._groups = None
        if self.rows:
            drop = min(r.first_col for r in self.rows)
            if drop and drop >= TRIM_FRACTION * self.length:
                self._trim(drop)
        return tok[:live]

    @contextlib.contextmanager
    def _adapters(self, banks: list[Any]):
        """Per-row adapters for a forward over rows whose banks are ``banks``."""
        by_bank: dict[int, tuple[Any, list[int]]] = {}
        for i, b in enumerate(banks):
            if b is not None:
                by_bank.setdefault(id(b), (b, []))[1].append(i)
        groups = [(b, None if len(rows) == len(banks) else torch.tensor(rows, dtype=torch.long, device=self.device))
                  for b, rows in by_bank.values()]
        self.stats["max_adapters"] = max(self.stats["max_adapters"], len(groups))
        with self.engine.adapters.per_row(groups):
            yield

    def _decode(self, tok: torch.Tensor) -> None:
        n = len(self.rows)
        if self.length + 1 > self.capacity:  # (admission reserves room for every row's end; this is a guard)
            self._grow(self.length + 1 + self.capacity // 2)
        self.attn[:n, self.length] = True
        mask = self.attn[:n, : self.length + 1]
        routes = self.hooks is not None and any(r.request.record for r in self.rows)
        with self._adapters([r.request.bank for r in self.rows]), (
                self.hooks.recording() if routes else contextlib.nullcontext()):
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=self.next_pos[:n, None],
                             use_cache=True, **{self._cache_kw: self.cache}, **self.engine._extra)
            if routes:  # the routes of the token each row just fed
                step = self.hooks.take().cpu().numpy().astype(self.engine.route_dtype)
                for i, r in enumerate(self.rows):
                    if r.request.record:
                        r.routes.append(step[i])
        self.length += 1
        self.next_pos[:n] += 1
        self.logits = out.logits[:, -1, :].float()
        self.stats["decode_forwards"] += 1
        self.stats["decode_columns"] += self.length
        self.stats["decode_rows"] += n

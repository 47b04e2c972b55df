"""Routing replay (R3) for Tinker clients: the experts the engine routed each token to,
recorded when a sampling request asks for it (``record_stability_info``), replayed when
a forward_backward datum names those tokens through the SDK's provenance spans.

At sampling time a mixture-of-experts base samples with an engine that records its
routers' choices (``return_routed_experts``); each sampled sequence's record (its
prompt tokens and their routes, its sampled tokens and theirs) is kept under its
``sequence_id`` in a :class:`RouteStore` bounded by bytes (least recently used first
out). In forward_backward, a datum whose ``model_input_spans`` tile its input tokens
with runs of recorded prompts and sampled tokens is scored with those experts forced
(``skyrl_toolkit.routing.RouterHooks``): the trainer's logprobs then equal the sampler's,
as ``skyrl run``'s ``r3`` makes them. A run naming a sequence the store no longer
holds (evicted, or never recorded) is scored with free routing, and the metric
``replay_missed_tokens:sum`` counts it; ``replay_tokens:sum`` counts the forced ones.
A run whose tokens differ from the recorded ones is a user error (the spans lie).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

import attrs
import numpy as np

from skyrl_server._errors import BadRequest


@attrs.define
class RouteRecord:
    """What one sampled sequence left for replay."""

    prompt: np.ndarray  # int64 [P]
    prompt_routes: np.ndarray | None  # [P, L, k] (None: a dense model)
    tokens: np.ndarray  # int64 [R]: the sampled tokens
    routes: np.ndarray | None  # [R, L, k]: the last one was never fed back (not replayed)
    support: Any = None  # CSR, one row per sampled token: the ids its sampler could draw (None: not recorded)
    temperature: float = 1.0  # the sampler's, for the support logprobs

    @property
    def nbytes(self) -> int:
        arrays = [self.prompt, self.prompt_routes, self.tokens, self.routes]
        if self.support is not None:
            arrays += [self.support.offsets, self.support.values]
        return int(sum(a.nbytes for a in arrays if a is not None))


class RouteStore:
    """Records by sequence id, at most ``max_bytes`` of them (the oldest used go first)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.evicted = 0
        self._records: collections.OrderedDict[str, RouteRecord] = collections.OrderedDict()
        self._lock = threading.Lock()  # sampling and training run on different threads

    def __len__(self) -> int:
        return len(self._records)

    def put(self, sequence_id: str, record: RouteRecord) -> None:
        with self._lock:
            old = self._records.pop(sequence_id, None)
            if old is not None:
                self.bytes -= old.nbytes
            if record.nbytes > self.max_bytes:
                self.evicted += 1
                return
            self._records[sequence_id] = record
            self.bytes += record.nbytes
            while self.bytes > self.max_bytes:
                _, gone = self._records.popitem(last=False)
                self.bytes -= gone.nbytes
                self.evicted += 1

    def get(self, sequence_id: str) -> RouteRecord | None:
        with self._lock:
            record = self._records.get(sequence_id)
            if record is not None:
                self._records.move_to_end(sequence_id)
            return record


def batch_records(batch: Any, prompt_len: int, temperature: float = 1.0) -> list[RouteRecord]:
    """One record per sequence of an engine batch: its routes when the batch has
    ``routed_experts`` (prompt routes, then response routes, sequence by sequence) and
    its sampled tokens' kept sets when it has ``sample_support`` (one row per generated token)."""
    routes = batch.side_channels.get("routed_experts")
    support = batch.side_channels.get("sample_support")
    out = []
    first = 0  # the batch's first generated token of sequence i (support rows)
    for i in range(batch.n_sequences):
        seq = np.asarray(batch.sequence(i), dtype=np.int64)
        rows = routes[batch.cu_seqlens[i] : batch.cu_seqlens[i + 1]] if routes is not None else None
        n = len(seq) - prompt_len
        kept = support.take(np.arange(first, first + n, dtype=np.int64)) if support is not None else None
        first += n
        out.append(RouteRecord(seq[:prompt_len].copy(), None if rows is None else rows[:prompt_len].copy(),
                               seq[prompt_len:].copy(), None if rows is None else rows[prompt_len:].copy(),
                               kept, float(temperature)))
    return out


def _claimed(record: RouteRecord, kind: str, sequence_id: str, offset: int, length: int, tokens: np.ndarray, at: int,
             field: str, what: str, datum: int) -> np.ndarray:
    """The recorded prompt or sampled tokens a span run names, checked against the
    datum's ``tokens[at : at + length]`` (a 400 when the run passes them or they differ)."""
    own = record.prompt if kind == "prompt" else record.tokens
    if offset + length > len(own):
        raise BadRequest(f"datum {datum}: {field}: a {kind} run of sequence {sequence_id!r} at offset {offset} "
                         f"with length {length} passes its {len(own)} tokens")
    if not np.array_equal(own[offset : offset + length], tokens[at : at + length]):
        raise BadRequest(f"datum {datum}: {field}: the {what} at positions {at}..{at + length - 1} are not the {kind} "
                         f"tokens of sequence {sequence_id!r} they claim to be")
    return own


def forced_routes(store: RouteStore, spans: Sequence[tuple[str, str, int, int]], tokens: np.ndarray,
                  n_layers: int, k: int, datum: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Expert ids [N, L, k] and mask [N] (forced where true) for a datum's N input
    tokens from its ``model_input_spans`` ``(kind, sequence_id, offset, length)``;
    with the forced and the missed token counts."""
    n = len(tokens)
    ids = np.zeros((n, n_layers, k), dtype=np.int64)
    mask = np.zeros(n, dtype=bool)
    forced = missed = 0
    at = 0
    for kind, sequence_id, offset, length in spans:
        record = store.get(sequence_id)
        if record is None:
            missed += length
            at += length
            continue
        own = _claimed(record, kind, sequence_id, offset, length, tokens, at, "model_input_spans", "tokens", datum)
        rows = record.prompt_routes if kind == "prompt" else record.routes
        if rows is None or rows.shape[1:] != (n_layers, k):
            raise BadRequest(f"datum {datum}: sequence {sequence_id!r} was recorded on another model")
        ids[at : at + length] = rows[offset : offset + length]
        fed = np.ones(length, dtype=bool)
        if kind == "sampled":  # the last sampled token was never fed to the engine: it routes freely
            fed &= np.arange(offset, offset + length) < len(own) - 1
        mask[at : at + length] = fed
        forced += int(fed.sum())
        at += length
    return ids, mask, forced, missed


def kept_sets(store: RouteStore, spans: Sequence[tuple[str, str, int, int]], targets: np.ndarray,
              datum: int) -> tuple[list[tuple[np.ndarray, Any, float]], int, int]:
    """From a datum's ``loss_fn_input_spans``: the target positions whose token was
    sampled with a recorded kept set, as ``(positions, CSR rows, temperature)`` runs;
    with the counts of such targets and of those whose record is gone."""
    runs = []
    found = missed = 0
    at = 0
    for kind, sequence_id, offset, length in spans:
        record = store.get(sequence_id)
        if record is None:
            missed += length if kind == "sampled" else 0
        else:
            _claimed(record, kind, sequence_id, offset, length, targets, at, "loss_fn_input_spans", "target tokens", datum)
            if kind == "sampled" and record.support is not None and length:
                runs.append((np.arange(at, at + length, dtype=np.int64),
                             record.support.take(np.arange(offset, offset + length, dtype=np.int64)), record.temperature))
                found += length
        at += length
    return runs, found, missed


class ReplayPlan:
    """One datum's forced routes (or none): a context manager around its forward."""

    def __init__(self, hooks: Any = None, ids: Any = None, mask: Any = None, forced: int = 0, missed: int = 0):
        self.hooks, self.ids, self.mask, self.forced, self.missed = hooks, ids, mask, forced, missed
        self.sets: list[tuple[np.ndarray, Any, float]] = []  # support runs (see kept_sets)
        self.scored = self.unscored = 0  # targets scored over their kept sets / whose record is gone
        self.spans = False  # the datum came with provenance
        self._ctx: Any = None

    def logprobs(self, logits: Any, targets: Any, logprobs: Any) -> Any:
        """``logprobs`` with each supported target's replaced by its logprob over the
        kept set its sampler drew from, at the sampler's temperature."""
        if not self.sets:
            return logprobs
        import torch
        from skyrl_replay.support_math import masked_logprobs

        out = logprobs
        for positions, rows, temperature in self.sets:
            pos = torch.as_tensor(positions, device=logits.device)
            try:
                lp, _entropy = masked_logprobs(
                    logits.index_select(0, pos), targets.index_select(0, pos),
                    torch.as_tensor(rows.offsets, device=logits.device),
                    torch.as_tensor(rows.values.astype(np.int64), device=logits.device), temperature=temperature)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            out = out.index_put((pos,), lp)
        return out

    def __enter__(self) -> "ReplayPlan":
        if self.hooks is not None and self.forced:
            self._ctx = self.hooks.forcing(self.ids, self.mask)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(*exc)


class StabilityMixin:
    """The replay half of :class:`skyrl_server._service.Service` (``self.route_store``,
    ``self.route_hooks``: the router hooks on each MoE training model's module)."""

    def replay_plans(self, tm: Any, data: Sequence[Any], device: Any) -> list[ReplayPlan]:
        """One plan per datum: its spans checked (all before any gradient is added), the
        recorded experts to force on a mixture-of-experts base, and the kept sets of its
        sampled targets."""
        import torch

        plans = [ReplayPlan() for _ in data]
        if not any(d.get("spans") for d in data):
            return plans
        base = self.bases[tm.base]
        routers = list(getattr(base.loaded, "routers", ()) or ())
        hooks = None
        if routers:
            held = self.route_hooks.get(tm.model_id)
            if held is None or held[0] is not tm.backend.module:
                from skyrl_toolkit.routing import RouterHooks

                held = self.route_hooks[tm.model_id] = (tm.backend.module, RouterHooks(tm.backend.module, routers))
            hooks = held[1]
        for i, datum in enumerate(data):
            if not datum.get("spans"):
                continue
            plan = plans[i]
            plan.spans = True
            if hooks is not None:
                ids, mask, plan.forced, plan.missed = forced_routes(self.route_store, datum["spans"], datum["tokens"],
                                                                    hooks.n_layers, hooks.k, i)
                plan.hooks, plan.ids, plan.mask = hooks, torch.as_tensor(ids, device=device), torch.as_tensor(mask, device=device)
            if datum.get("loss_spans"):
                plan.sets, plan.scored, plan.unscored = kept_sets(self.route_store, datum["loss_spans"],
                                                                  datum["inputs"]["target_tokens"], i)
        return plans

    def record_stability(self, batch: Any, prompt_len: int, sequence_ids: Sequence[str], temperature: float = 1.0) -> None:
        """Keep what an engine batch's sequences leave for replay (routes, kept sets) under their ids."""
        if "routed_experts" not in batch.side_channels and "sample_support" not in batch.side_channels:
            return
        for sequence_id, record in zip(sequence_ids, batch_records(batch, prompt_len, temperature)):
            self.route_store.put(sequence_id, record)

    @staticmethod
    def replay_metrics(plans: Sequence[ReplayPlan]) -> dict[str, float]:
        if not any(p.spans for p in plans):
            return {}
        metrics = {"support_tokens:sum": float(sum(p.scored for p in plans)),
                   "support_missed_tokens:sum": float(sum(p.unscored for p in plans))}
        if any(p.hooks is not None for p in plans):
            metrics["replay_tokens:sum"] = float(sum(p.forced for p in plans))
            metrics["replay_missed_tokens:sum"] = float(sum(p.missed for p in plans))
        return metrics


__all__ = ["ReplayPlan", "RouteRecord", "RouteStore", "StabilityMixin", "batch_records", "forced_routes", "kept_sets"]

"""The replay strategies' implementation (imports torch; see ``r3.py`` and ``support.py``)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

from skyrl_host.contracts import has
from skyrl_host.errors import UserError
from skyrl_host.interfaces import LoadedModel, ReplayView, VocabShard
from skyrl_host.rollout import CSR
from skyrl_toolkit.routing import INDEXER_CHANNEL, IndexerHooks, RouterHooks, indexer_paths


def _missing(strategy: str, channel: str, how: str) -> ValueError:
    return ValueError(f"replay strategy {strategy!r}: the batch has no {channel!r} side channel ({how})")


class RoutingReplay:
    """``r3``: see :mod:`skyrl_replay.r3`."""

    name = "r3"
    side_channel = "routed_experts"

    def __init__(self) -> None:
        self.hooks: RouterHooks | None = None
        self.indexers: IndexerHooks | None = None  # the model's sparse-attention indexers, if any
        self._last_of: tuple[Any, np.ndarray] | None = None  # (batch, bool [T]: last token of its sequence)
        self._pos_of: tuple[Any, np.ndarray] | None = None  # (batch, int64 [T]: position in its sequence)

    def bind(self, model: Any, loaded: LoadedModel) -> None:
        routers = list(loaded.routers)
        if not routers and loaded.router_problems:
            path, why = next(iter(loaded.router_problems.items()))
            raise UserError(f"replay strategy 'r3' cannot replay this model's routers ({path}: {why}); "
                            "remove 'r3' from replay.strategies")
        if not routers:
            raise ValueError(
                f"replay strategy 'r3' needs a mixture-of-experts model, but model family {loaded.family or '?'!r} "
                "lists no MoE routers for this model"
            )
        for hooks in (self.hooks, self.indexers):
            if hooks is not None:
                hooks.remove()
        self.hooks = RouterHooks(model, routers)
        self.indexers = IndexerHooks(model) if indexer_paths(model) else None

    def _is_last(self, batch: Any) -> np.ndarray:
        # Cached for the batch object itself (not its id: a later batch may reuse a freed id).
        if self._last_of is None or self._last_of[0] is not batch:
            self._last_of = (batch, batch.last_tokens())
        return self._last_of[1]

    @contextlib.contextmanager
    def replaying(self, view: ReplayView) -> Iterator[None]:
        if self.hooks is None:
            raise RuntimeError("replay strategy 'r3' used before bind()")
        routes = view.batch.side_channels.get(self.side_channel)
        if routes is None:
            raise _missing("r3", self.side_channel, "set engine.return_routed_experts = true")
        L, k = self.hooks.n_layers, self.hooks.k
        if isinstance(routes, CSR) or routes.ndim != 3 or routes.shape[1:] != (L, k):
            shape = "CSR" if isinstance(routes, CSR) else list(routes.shape)
            raise ValueError(
                f"replay strategy 'r3': side channel 'routed_experts' must be [tokens, {L} MoE layers, top_k {k}] "
                f"for this model, found {shape}"
            )
        slots = np.asarray(view.slot_tokens, dtype=np.int64)
        real = slots >= 0
        ids = np.zeros((len(slots), L, k), dtype=routes.dtype)
        ids[real] = routes[slots[real]]
        # The engine never fed a sequence's last token: route it (and padding) freely.
        mask = real.copy()
        mask[real] = ~self._is_last(view.batch)[slots[real]]
        dev = view.device
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.hooks.forcing(torch.as_tensor(ids, device=dev), torch.as_tensor(mask, device=dev)))
            if self.indexers is not None:
                rel, qpos = self._indexer_rows(view, slots, real)
                stack.enter_context(self.indexers.forcing(
                    torch.as_tensor(rel, device=dev), torch.as_tensor(qpos, device=dev), torch.as_tensor(mask, device=dev)))
            yield

    def _indexer_rows(self, view: ReplayView, slots: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The engine's indexer picks (positions in each sequence) and the position of
        every slot of the forward (padding: no picks, position 0)."""
        picks = view.batch.side_channels.get(INDEXER_CHANNEL)
        if picks is None:
            raise _missing(
                "r3", INDEXER_CHANNEL,
                "the model attends through a sparse-attention indexer, so r3 also replays the keys it picked: "
                "the engine must record them (the embedded engine does with engine.return_routed_experts = true)",
            )
        L, k = self.indexers.n_layers, self.indexers.k
        if isinstance(picks, CSR) or picks.ndim != 3 or picks.shape[1:] != (L, k):
            shape = "CSR" if isinstance(picks, CSR) else list(picks.shape)
            raise ValueError(
                f"replay strategy 'r3': side channel {INDEXER_CHANNEL!r} must be [tokens, {L} indexer layers, "
                f"index_topk {k}] for this model, found {shape}"
            )
        rel = np.full((len(slots), L, k), -1, dtype=np.int64)
        rel[real] = picks[slots[real]]
        qpos = np.zeros(len(slots), dtype=np.int64)
        if self._pos_of is None or self._pos_of[0] is not view.batch:
            self._pos_of = (view.batch, view.batch.positions())
        qpos[real] = self._pos_of[1][slots[real]]
        return rel, qpos


class SupportReplay:
    """``support``: see :mod:`skyrl_replay.support`."""

    name = "support"
    side_channel = "sample_support"

    def __init__(self, chunk: int = 16384):
        self.chunk = int(chunk)
        self._rank_of: tuple[Any, np.ndarray] | None = None

    def bind(self, model: Any, loaded: LoadedModel) -> None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or not hasattr(head, "weight"):
            raise ValueError("replay strategy 'support' needs a model with an output head (get_output_embeddings())")

    @contextlib.contextmanager
    def replaying(self, view: ReplayView) -> Iterator[None]:
        self._channel(view)
        yield

    def _channel(self, view: ReplayView) -> CSR:
        channel = view.batch.side_channels.get(self.side_channel)
        if channel is None:
            raise _missing("support", self.side_channel, "set sampler.return_support = true")
        if not isinstance(channel, CSR):
            raise ValueError("replay strategy 'support': side channel 'sample_support' must be CSR (one row per generated token)")
        return channel

    def _rows(self, view: ReplayView) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept sets of the scored tokens, as (offsets, ids) tensors."""
        batch = view.batch
        if self._rank_of is None or self._rank_of[0] is not batch:
            mask = np.asarray(batch.loss_mask) != 0
            self._rank_of = (batch, np.where(mask, np.cumsum(mask) - 1, -1))
        rank = self._rank_of[1][np.asarray(view.scored_tokens, dtype=np.int64)]
        if len(rank) and rank.min() < 0:
            raise ValueError("replay strategy 'support': a scored token was not generated (loss_mask 0): it has no kept set")
        sets = self._channel(view).take(rank)
        return (
            torch.as_tensor(sets.offsets, device=view.device),
            torch.as_tensor(sets.values.astype(np.int64, copy=False), device=view.device),
        )

    def score(
        self,
        view: ReplayView,
        targets: torch.Tensor,
        temperature: float,
        *,
        hidden: torch.Tensor | None = None,
        head: Any = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [K], entropy [K]) of the scored tokens over their kept sets: from
        ``hidden`` [K, H] and the ``head`` module's rows, or from full ``logits`` [K, V]."""
        from skyrl_replay.support_math import masked_logprobs, support_logprobs

        offsets, ids = self._rows(view)
        if logits is not None:
            return masked_logprobs(logits, targets, offsets, ids, temperature=temperature)
        return support_logprobs(
            hidden, head.weight, getattr(head, "bias", None), targets, offsets, ids,
            temperature=temperature, chunk=self.chunk, shard=head if has(head, VocabShard) else None,
        )

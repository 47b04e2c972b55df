"""Recording the sparse-attention indexer's key picks in the embedded engine (GLM-5,
DeepSeek-V3.2), for ``r3`` to replay in the trainer (side channel ``indexer_topk``).

Active with ``engine.return_routed_experts`` on a model whose attention runs a key
indexer (:func:`skyrl_toolkit.routing.indexer_paths`). Rows hold, per token and indexer
layer, the ``index_topk`` keys the token's query attended to, as positions in its own
sequence (int32, -1 where the query saw fewer keys), largest first: prompt tokens'
rows from the prefill, one row per fed response token from its decode step; the last
response token is never fed, so its row is all -1 (the trainer picks freely there, as
that token's output feeds no logprob). Positions, unlike cache columns, survive every
layout: left padding here, packed rows in the trainer, a conversation continued.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import numpy as np
import torch

from skyrl_toolkit.routing import IndexerHooks, columns_to_positions


class IndexerCapture:
    """The indexer hooks of the engine's model, and the layout of what they record."""

    def __init__(self, model: torch.nn.Module):
        self.hooks = IndexerHooks(model)
        self.shape = (self.hooks.n_layers, self.hooks.k)

    def remove(self) -> None:
        self.hooks.remove()

    def recording(self) -> ContextManager[None]:
        return self.hooks.recording()

    def empty(self, *lead: int) -> np.ndarray:
        return np.full((*lead, *self.shape), -1, dtype=np.int32)

    def prefill_forcing(self, prompts: list[list[int]], force: list[np.ndarray] | None, width: int,
                        device: torch.device) -> ContextManager[None]:
        """While prefilling left-padded ``prompts`` (``width`` columns), force the picks
        ``force[i]`` (rows of prompt i's first tokens: an earlier turn's) where given."""
        if force is None:
            return contextlib.nullcontext()
        n = len(prompts)
        rel = np.full((n, width, *self.shape), -1, dtype=np.int64)
        qpos = np.zeros((n, width), dtype=np.int64)
        mask = np.zeros((n, width), dtype=bool)
        for i, (p, r) in enumerate(zip(prompts, force)):
            if len(r) > len(p):
                raise ValueError(f"conversation {i}: {len(r)} rows of indexer picks for a context of {len(p)} tokens")
            s = width - len(p)
            rel[i, s : s + len(r)] = r
            qpos[i, s:] = np.arange(len(p))
            mask[i, s : s + len(r)] = True
        return self.hooks.forcing(
            torch.as_tensor(rel.reshape(n * width, *self.shape), device=device),
            torch.as_tensor(qpos.reshape(-1), device=device),
            torch.as_tensor(mask.reshape(-1), device=device),
        )

    def after_prefill(self, prompts: list[list[int]], width: int, device: torch.device) -> list[np.ndarray]:
        """The prefill's picks: one [len(p), L, k] int32 array per prompt."""
        n = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        cols = torch.arange(width, device=device)
        first = (width - lens)[:, None].expand(n, width).reshape(-1)
        qpos = (cols[None, :] - (width - lens)[:, None]).reshape(-1)
        pos = columns_to_positions(self.hooks.take(), first, qpos).reshape(n, width, *self.shape)
        pos = pos.to(torch.int32).cpu().numpy()
        return [pos[i, width - len(p) :] for i, p in enumerate(prompts)]

    def after_step(self, first: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """A decode step's picks, int32 [rows, L, k]: row r's sequence starts at cache
        column ``first[r]`` and its fed token sits at position ``qpos[r]``."""
        return columns_to_positions(self.hooks.take(), first, qpos).to(torch.int32)

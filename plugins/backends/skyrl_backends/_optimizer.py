"""The torch backend's optimizer: AdamW (matrices decay, norms and biases do not) and its
learning-rate schedule (linear warmup, then constant or cosine)."""

from __future__ import annotations

import math
from typing import Any

import torch


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


def make_optimizer(model: torch.nn.Module, cfg: Any, total_steps: int) -> tuple[Any, Any]:
    """``(AdamW, LambdaLR)`` over ``model``'s trainable parameters, with the options of
    ``[backend]`` (``cfg``): ``mini_batches`` updates for each of ``total_steps`` steps."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
    )
    total_updates = max(1, total_steps) * cfg.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, LrSchedule(cfg.warmup_steps, total_updates, cfg.schedule, cfg.min_lr_ratio)
    )
    return optimizer, scheduler

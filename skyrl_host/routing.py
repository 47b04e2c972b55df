"""MoE routing, the service engines and replay strategies share: whether a selected
model has MoE layers (:func:`model_is_moe`, light), and router hooks that record the
experts MoE routers choose, or force given ones (:class:`RouterHooks`; needs torch,
imported on first use).

Shared by the engine (routing capture; forcing the earlier turns' routes when a
conversation continues) and the ``r3`` strategy in the trainer (routing replay), next
to the :class:`~skyrl_host.interfaces.RouterInfo` that model families describe their
routers with.

A forward hook on each router module (``RouterInfo.path``) sees the router's output
``(logits, weights, expert_ids)`` for the ``N`` tokens of one forward (the batch
flattened row-major, ``[N, top_k]`` ids). Recording keeps the ids; forcing replaces
them where a mask says so and recomputes the weights from the router's *own* logits
at the forced ids (:func:`weights_at`), so the router still gets gradients and an
unforced row is exactly what the router computed.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from skyrl_host.interfaces import RouterInfo

if TYPE_CHECKING:  # pragma: no cover
    import torch

ROUTER_KINDS = ("softmax_topk", "sigmoid_group_topk")
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def model_is_moe(choice: Any) -> bool | None:
    """Whether the model a job selects (its ``[model]`` PluginChoice) has MoE layers:
    from its local folder's config.json, or the family config's ``is_moe`` for presets;
    None when unknown."""
    config = choice.config
    path = getattr(config, "path", None)
    if isinstance(path, str):
        try:
            data = json.loads((pathlib.Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # the family's own validator reports a bad folder
        tables = [data] + [v for k, v in data.items() if k.endswith("_config") and isinstance(v, dict)]
        return any(isinstance(t.get(k), int) and t.get(k) > 0 for t in tables for k in _EXPERT_KEYS)
    value = getattr(config, "is_moe", None)
    return value if isinstance(value, bool) else None


def expert_dtype(n_experts: int) -> np.dtype:
    """The smallest unsigned dtype that holds every expert id ``0 .. n_experts - 1``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if n_experts - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"{n_experts} experts do not fit an unsigned 32-bit id")


def weights_at(info: RouterInfo, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The routing weights of experts ``ids`` [N, k] from router ``logits`` [N, E], the
    way a router of ``info.kind`` computes them for the experts it chose (same ops in
    the same order, so equal ids give bitwise-equal weights)."""
    import torch

    if info.kind == "softmax_topk":
        w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
        if info.normalize:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(logits.dtype)
    elif info.kind == "sigmoid_group_topk":
        w = logits.float().sigmoid().gather(-1, ids)
        if info.normalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"router {info.path!r}: unknown router kind {info.kind!r} (known: {', '.join(ROUTER_KINDS)})")
    return w * info.scale if info.scale != 1.0 else w


class RouterHooks:
    """Forward hooks on every router of ``model`` (as ``routers`` lists them).

    Idle unless inside :meth:`recording` or :meth:`forcing`; both may be active at once
    (force some rows, record what every row used)."""

    def __init__(self, model: torch.nn.Module, routers: Sequence[RouterInfo]):
        if not routers:
            raise ValueError("the model has no MoE routers")
        self.routers = list(routers)
        self.top_k = {r.top_k for r in self.routers}
        if len(self.top_k) != 1:
            raise ValueError(f"routers choose different numbers of experts ({sorted(self.top_k)}); one top_k is needed")
        self.k = self.routers[0].top_k
        self.n_experts = max(r.n_experts for r in self.routers)
        self.n_layers = len(self.routers)
        self._force: torch.Tensor | None = None  # long [N, L, k]
        self._mask: torch.Tensor | None = None  # bool [N]
        self._record: list[list[torch.Tensor]] | None = None
        self._handles = []
        for layer, info in enumerate(self.routers):
            try:
                module = model.get_submodule(info.path)
            except AttributeError:
                raise ValueError(f"router {info.path!r} (layer {info.layer}) is not a module of the model") from None
            self._handles.append(module.register_forward_hook(self._hook(layer, info)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int, info: RouterInfo) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> Any:
            if self._force is None and self._record is None:
                return None
            logits, weights, ids = output
            if self._force is not None:
                forced = self._force[:, layer, :]
                if forced.shape[0] != ids.shape[0]:
                    raise ValueError(
                        f"routing replay: the forward routes {ids.shape[0]} tokens at {info.path!r}, "
                        f"but {forced.shape[0]} rows of expert ids were given"
                    )
                ids = forced.where(self._mask[:, None], ids) if self._mask is not None else forced
                weights = weights_at(info, logits, ids).to(weights.dtype)
                output = (logits, weights, ids)
            if self._record is not None:
                self._record[layer].append(ids.detach())
            return output

        return hook

    @contextlib.contextmanager
    def forcing(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> Iterator[None]:
        """Inside the block, every forward uses expert ids ``ids`` [N, L, k] (any integer
        dtype) for its N tokens, where ``mask`` [N] is true (all rows if None)."""
        if ids.ndim != 3 or ids.shape[1] != self.n_layers or ids.shape[2] != self.k:
            raise ValueError(
                f"routing replay: expert ids must be [tokens, {self.n_layers} MoE layers, top_k {self.k}], "
                f"found {list(ids.shape)}"
            )
        if int(ids.numel()) and (int(ids.max()) >= self.n_experts or int(ids.min()) < 0):
            raise ValueError(f"routing replay: expert ids outside 0..{self.n_experts - 1}")
        prev = self._force, self._mask
        self._force, self._mask = ids.long(), mask
        try:
            yield
        finally:
            self._force, self._mask = prev

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside the block, the routers' ids are recorded; :meth:`take` returns those
        of the last forward."""
        prev = self._record
        self._record = [[] for _ in self.routers]
        try:
            yield
        finally:
            self._record = prev

    def take(self) -> torch.Tensor:
        """The ids of the last forward's tokens: [N, L, k] (and forget them)."""
        if self._record is None:
            raise RuntimeError("take() outside recording()")
        if any(len(r) != 1 for r in self._record):
            counts = sorted({len(r) for r in self._record})
            raise RuntimeError(f"expected one router call per layer since the last take(), found {counts}")
        import torch

        ids = torch.stack([r[0] for r in self._record], dim=1)
        for r in self._record:
            r.clear()
        return ids

"""MoE routing, the service engines and replay strategies share: router hooks that
record the experts MoE routers choose, or force given ones (:class:`RouterHooks`; needs
torch, imported on first use). Whether a selected model has MoE layers or a
sparse-attention indexer is its family's declared traits (``choice.traits.is_moe``,
``has_indexer``: :class:`skyrl_host.interfaces.ModelTraits`).

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
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from skyrl_host.interfaces import RouterInfo

if TYPE_CHECKING:  # pragma: no cover
    import torch

ROUTER_KINDS = ("softmax_topk", "sigmoid_group_topk")


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


class _LayerRecorder:
    """What the router and indexer hooks share: per-layer records of the last forward,
    kept inside :meth:`recording` and handed out (and forgotten) by :meth:`take`.
    A subclass sets ``_record_layers`` (one entry per hooked layer), ``_what`` and
    ``_handles`` (its forward hooks, which :meth:`remove` takes off)."""

    _record: list[list[torch.Tensor]] | None = None
    _handles: list[Any] = []
    _record_layers: Sequence[Any] = ()
    _what = "layer"

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside the block, the hooked layers' outputs are recorded; :meth:`take`
        returns those of the last forward."""
        prev = self._record
        self._record = [[] for _ in self._record_layers]
        try:
            yield
        finally:
            self._record = prev

    def take(self) -> torch.Tensor:
        """The last forward's records, stacked per layer: [N, L, ...] (and forget them)."""
        if self._record is None:
            raise RuntimeError("take() outside recording()")
        if any(len(r) != 1 for r in self._record):
            counts = sorted({len(r) for r in self._record})
            raise RuntimeError(f"expected one {self._what} call per layer since the last take(), found {counts}")
        import torch

        out = torch.stack([r[0] for r in self._record], dim=1)
        for r in self._record:
            r.clear()
        return out

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []


class RouterHooks(_LayerRecorder):
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
        self._record_layers, self._what = self.routers, "router"
        self._handles = []
        self._modules: list[Any] = []  # the hooked routers: a copy of the model (an engine's) carries the hooks too
        for layer, info in enumerate(self.routers):
            try:
                module = model.get_submodule(info.path)
            except AttributeError:
                raise ValueError(f"router {info.path!r} (layer {info.layer}) is not a module of the model") from None
            self._modules.append(module)
            self._handles.append(module.register_forward_hook(self._hook(layer, info)))

    def _hook(self, layer: int, info: RouterInfo) -> Any:
        def hook(module: Any, _inputs: Any, output: Any) -> Any:
            if (self._force is None and self._record is None) or module is not self._modules[layer]:
                return None  # idle, or a deep copy of the hooked model (an engine's own) running its forward
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

    # recording() / take(): the expert ids of the last forward's tokens, [N, L, k] (_LayerRecorder)


# -- sparse-attention indexers (DeepSeek Sparse Attention) ------------------------------
#
# GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``) attend, at each query, only
# to the ``index_topk`` keys a light indexer scores best. The indexer's scores are ReLU
# sums, so exact ties (zeros) are common, and ``topk`` breaks them differently in a
# KV-cached decode (one query against the cache) than in a full forward: the engine and
# the trainer would attend to different keys. The engine records the indexer's picks
# (side channel ``indexer_topk``) and ``r3`` forces the trainer's indexers to them.
# Layers that reuse the previous layer's choice (GLM-5's ``indexer_types = "shared"``)
# have no indexer module: they reuse the forced choice as they would their own.

#: Indexer modules (transformers class names) returning ``[B, S, topk]`` key indices of
#: the forward's key axis (columns of the attention mask).
KEY_INDEXER_CLASSES = ("GlmMoeDsaIndexer", "DeepseekV32Indexer")
#: The model types whose attention uses a key indexer.
KEY_INDEXER_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
INDEXER_CHANNEL = "indexer_topk"


def indexer_paths(model: torch.nn.Module) -> list[str]:
    """The dotted paths of ``model``'s key-indexer modules, in module (layer) order."""
    return [name for name, m in model.named_modules() if type(m).__name__ in KEY_INDEXER_CLASSES]


class IndexerHooks(_LayerRecorder):
    """Forward hooks on every key indexer of ``model`` (:func:`indexer_paths`): record the
    key columns each indexer picked for each query of a forward, or force given ones.

    An indexer returns ``[B, S, k']`` int key columns (``k' = min(index_topk, keys)``);
    recorded rows are ``[N = B * S, L, index_topk]``, padded with -1 when ``k'`` is
    smaller. Forcing takes each query's picks as *positions in its own sequence* (-1:
    none) plus each query's own position: in a forward without a cache prefix (the
    trainer's, an engine's prefill) a query at column ``c`` of its row sits at sequence
    position ``p``, so position ``q`` is column ``c - p + q``. A -1 becomes the query's
    own column (a row with fewer than ``index_topk`` picks holds every key the query
    may see, its own included, so this adds nothing)."""

    def __init__(self, model: torch.nn.Module):
        self.paths = indexer_paths(model)
        if not self.paths:
            raise ValueError("the model has no sparse-attention indexer")
        modules = [model.get_submodule(p) for p in self.paths]
        ks = {int(m.index_topk) for m in modules}
        if len(ks) != 1:
            raise ValueError(f"indexers keep different numbers of keys ({sorted(ks)}); one index_topk is needed")
        self.k = ks.pop()
        self.n_layers = len(modules)
        self._force: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self._record: list[list[torch.Tensor]] | None = None
        self._record_layers, self._what = self.paths, "indexer"
        self._modules = modules
        self._handles = [m.register_forward_hook(self._hook(i, p)) for i, (p, m) in enumerate(zip(self.paths, modules))]

    def _hook(self, layer: int, path: str) -> Any:
        def hook(module: Any, _inputs: Any, output: Any) -> Any:
            if (self._force is None and self._record is None) or module is not self._modules[layer]:
                return None  # idle, or a deep copy of the hooked model running its forward
            import torch

            B, S, kk = output.shape
            if self._force is not None:
                rel, qpos, mask = self._force
                if rel.shape[0] != B * S:
                    raise ValueError(
                        f"indexer replay: the forward has {B * S} query slots at {path!r}, "
                        f"but {rel.shape[0]} rows of key positions were given"
                    )
                col = torch.arange(B * S, device=rel.device) % S
                base = (col - qpos)[:, None]
                picks = rel[:, layer, :]
                forced = torch.where(picks >= 0, picks + base, col[:, None])
                if int(forced.numel()) and (int(forced.min()) < 0 or int(forced.max()) >= S):
                    raise ValueError(
                        f"indexer replay: key positions outside their sequences at {path!r} "
                        "(rows of other tokens, or a forward with a cache prefix)"
                    )
                own = output.reshape(B * S, kk).long()
                if kk < self.k:  # fewer keys than index_topk: pad the free rows with their own column
                    own = torch.cat([own, col[:, None].expand(-1, self.k - kk)], dim=1)
                out = forced.where(mask[:, None], own) if mask is not None else forced
                output = out.reshape(B, S, self.k).to(output.dtype)
            if self._record is not None:
                flat = output.reshape(B * S, -1).long()
                if flat.shape[1] < self.k:
                    flat = torch.cat([flat, flat.new_full((B * S, self.k - flat.shape[1]), -1)], dim=1)
                self._record[layer].append(flat)
            return output

        return hook

    @contextlib.contextmanager
    def forcing(self, rel: torch.Tensor, qpos: torch.Tensor, mask: torch.Tensor | None = None) -> Iterator[None]:
        """Inside the block, every forward's indexers pick the keys at sequence positions
        ``rel`` [N, L, index_topk] (-1: none) for the queries at sequence positions
        ``qpos`` [N], where ``mask`` [N] is true (all rows if None)."""
        if rel.ndim != 3 or rel.shape[1] != self.n_layers or rel.shape[2] != self.k:
            raise ValueError(
                f"indexer replay: key positions must be [tokens, {self.n_layers} indexer layers, index_topk {self.k}], "
                f"found {list(rel.shape)}"
            )
        rel = rel.long()
        if int(rel.numel()) and bool(((rel > qpos.long()[:, None, None]) | (rel < -1)).any()):
            raise ValueError("indexer replay: a query picks a key after its own position")
        prev = self._force
        self._force = (rel, qpos.long(), mask)
        try:
            yield
        finally:
            self._force = prev

    # recording() / take(): the key columns of the last forward's queries, long [N, L, index_topk]
    # (-1 padded) (_LayerRecorder)


def columns_to_positions(cols: torch.Tensor, first: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Recorded key columns ``cols`` [N, L, k] (-1 padded) as positions in each query's
    sequence: its sequence starts at column ``first`` [N] and the query sits at position
    ``qpos`` [N]. Picks outside ``0..qpos`` (masked keys an indexer takes when a query
    sees fewer than k keys) become -1; each row sorted, largest first (-1s last)."""
    pos = cols - first[:, None, None]
    pos = pos.where((cols >= 0) & (pos >= 0) & (pos <= qpos[:, None, None]), pos.new_full((), -1))
    return pos.sort(dim=-1, descending=True).values

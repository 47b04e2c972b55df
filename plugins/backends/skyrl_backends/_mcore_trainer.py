"""The megatron backend: :class:`MegatronBackend` (imported by the factory in
``skyrl_backends.megatron``).

It is the torch backend's train step (``_train_step``: packing, the no-grad pass, the
algorithm's loss, clipping, AdamW, metrics) run on a megatron-core ``GPTModel``:

- ``start`` rebuilds the loaded transformers model as a ``GPTModel``
  (``skyrl_backends._mcore_model.build``) and converts its weights into it;
- the policy forward is :class:`skyrl_backends._mcore_model.MegatronLM` (packed rows,
  logits at the loss positions only), called exactly where the torch backend calls
  ``PackedLM``;
- ``r3`` is replayed through megatron-core's own routing replay: each router's
  ``RouterReplay`` returns the engine's expert ids for the tokens the engine routed
  (:class:`EngineRoutes`); ``support`` scores through the same kept-set math as the
  torch backend, from the output head's rows;
- weights leave with Hugging Face names (``named_weights``: ``mcore_to_hf``), so every
  transport, engine and the final Hugging Face folder work unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

from skyrl_backends import _parallel
from skyrl_backends._mcore_arch import NotExpressible, describe
from skyrl_backends._mcore_model import MegatronLM, build, ensure_parallel_state, hf_to_mcore, load_into, mcore_to_hf, weights_of
from skyrl_backends._optimizer import make_optimizer
from skyrl_backends._trainer import TorchBackend
from skyrl_host.contracts import has
from skyrl_host.errors import UserError
from skyrl_host.interfaces import ReplayView, ScoringReplay
from skyrl_host.rollout import CSR


def _router_replay_class() -> type:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class EngineRoutes(RouterReplay):
        """A router's ``RouterReplay`` that, while ``forced`` is set, takes the engine's
        expert ids for the tokens the engine routed and the router's own top-k for the
        rest (a sequence's last token, which the engine never fed, and padding). The
        routing weights are the router's scores at those ids (megatron-core's replay
        semantics), so the gradient reaches the router as in an ordinary forward."""

        def __init__(self) -> None:
            super().__init__()
            self.forced: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids [N, k], bool [N])

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if self.forced is None:
                return probs, idx
            ids, mask = self.forced
            if ids.shape != idx.shape:
                raise ValueError(f"r3: {tuple(ids.shape)} replayed routes for a router that routes {tuple(idx.shape)}")
            idx = torch.where(mask[:, None], ids.to(idx.device, idx.dtype), idx)
            return scores.gather(1, idx), idx

    return EngineRoutes


class MegatronRoutingReplay:
    """``r3`` inside the megatron backend: the job's r3 strategy, carried out by the
    routers' replay objects instead of module hooks (ReplayStrategy's native form)."""

    name = "r3"
    side_channel = "routed_experts"

    def __init__(self, gpt: Any, k: int):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        cls = _router_replay_class()
        self.k = k
        self.replays = []
        for layer in gpt.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is None:
                continue
            router.router_replay = cls()
            self.replays.append(router.router_replay)
        RouterReplay.clear_global_router_replay_instances()  # ours are held here, not in the global list
        self._last_of: tuple[Any, np.ndarray] | None = None
        self.rows = 1  # the forward's row count, set by the backend before each replaying()

    def _is_last(self, batch: Any) -> np.ndarray:
        if self._last_of is None or self._last_of[0] is not batch:
            last = np.zeros(batch.n_tokens, dtype=bool)
            last[batch.cu_seqlens[1:][batch.seq_lens > 0] - 1] = True
            self._last_of = (batch, last)
        return self._last_of[1]

    @contextlib.contextmanager
    def replaying(self, view: ReplayView) -> Iterator[None]:
        routes = view.batch.side_channels.get(self.side_channel)
        if routes is None:
            raise ValueError("replay strategy 'r3': the batch has no 'routed_experts' side channel "
                             "(set engine.return_routed_experts = true)")
        L, k = len(self.replays), self.k
        if isinstance(routes, CSR) or routes.ndim != 3 or routes.shape[1:] != (L, k):
            shape = "CSR" if isinstance(routes, CSR) else list(routes.shape)
            raise ValueError(f"replay strategy 'r3': side channel 'routed_experts' must be [tokens, {L} MoE layers, "
                             f"top_k {k}] for this model, found {shape}")
        slots = np.asarray(view.slot_tokens, dtype=np.int64)
        real = slots >= 0
        ids = np.zeros((len(slots), L, k), dtype=np.int64)
        ids[real] = routes[slots[real]]
        mask = real.copy()
        mask[real] = ~self._is_last(view.batch)[slots[real]]  # the engine never fed a sequence's last token
        # megatron-core routes tokens sequence-major ([R, rows] flattened); the slots are row-major.
        n_rows = self.rows
        R = len(slots) // n_rows
        ids = torch.as_tensor(ids.reshape(n_rows, R, L, k).transpose(1, 0, 2, 3).reshape(R * n_rows, L, k), device=view.device)
        mask = torch.as_tensor(mask.reshape(n_rows, R).T.reshape(-1), device=view.device)
        try:
            for layer, replay in enumerate(self.replays):
                replay.forced = (ids[:, layer], mask)
            yield
        finally:
            for replay in self.replays:
                replay.forced = None


class MegatronBackend(TorchBackend):
    """A :class:`skyrl_host.interfaces.Backend` on megatron-core, one process."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.arch: Any = None
        self._r3: MegatronRoutingReplay | None = None

    def start(self, loaded: Any, *, seed: int, total_steps: int, reference: bool, replay: Any = ()) -> None:
        """Build the ``GPTModel`` of ``loaded``'s model, with its weights; ``replay``: the
        job's strategies (``r3`` natively, scoring strategies through the output head)."""
        cfg = self.config
        try:
            self.arch = describe(loaded.model.config)
        except NotExpressible as exc:
            raise UserError(f"[backend] name = \"megatron\" cannot build this model: {exc}") from None
        self.device = _parallel.pick_device(False, cfg.device)
        self.seed = seed
        ensure_parallel_state(1, 1, self.device, seed)
        torch.manual_seed(seed)
        hf = {k: v.detach().to(self.device, torch.float32) for k, v in loaded.model.state_dict().items()}
        weights = hf_to_mcore(self.arch, hf)
        names = [s.name for s in replay]
        wants_r3 = "r3" in names
        if wants_r3 and not self.arch.is_moe:
            raise ValueError(f"replay strategy 'r3' needs a mixture-of-experts model, but model family "
                             f"{loaded.family or '?'!r} builds a dense {self.arch.model_type!r} model")
        padding_idx = getattr(loaded.model.get_input_embeddings(), "padding_idx", None)
        gpt = build(self.arch, self.device, routing_replay=False, recompute=cfg.gradient_checkpointing)
        load_into(gpt, weights)
        gpt.train()
        if reference:
            ref = build(self.arch, self.device, routing_replay=False)
            load_into(ref, weights)
            ref.eval()
            ref.requires_grad_(False)
            self.reference = ref
            self._ref_lm = MegatronLM(ref, padding_idx)
        self._lm = MegatronLM(gpt, padding_idx)
        self.module = gpt
        self.replay = []
        for strategy in replay:
            if strategy.name == "r3":
                self._r3 = MegatronRoutingReplay(gpt, self.arch.top_k)
                self.replay.append(self._r3)
            elif has(strategy, ScoringReplay):
                strategy.bind(self._lm, loaded)  # reads the output head through MegatronLM.get_output_embeddings
                self.replay.append(strategy)
            else:
                raise ValueError(f"replay strategy {strategy.name!r} is not supported by the megatron backend "
                                 "(it replays 'r3' and scoring strategies such as 'support')")
        self._scorer_strategy = next((s for s in self.replay if has(s, ScoringReplay)), None)
        self.optimizer, self.scheduler = make_optimizer(gpt, cfg, total_steps)

    def _replaying(self, mb: Any) -> Any:
        if self._r3 is not None and mb.ids is not None:
            self._r3.rows = int(mb.ids.shape[0])
        return super()._replaying(mb)

    # -- weights ------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The model's weights with the transformers model's names and layouts (the tied
        head's alias included), converted from megatron-core's."""
        if self.module is None:
            raise RuntimeError("named_weights before start()")
        return iter(list(mcore_to_hf(self.arch, [weights_of(self.module)]).items()))

    def local_weights(self) -> Iterator[tuple[str, Any]]:
        """One rank holds every weight: :meth:`named_weights`."""
        return self.named_weights()

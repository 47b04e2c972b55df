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
  torch backend, from the output head's rows (under tensor parallelism this rank's rows,
  a ``VocabShard``);
- a quantizing precision computes with the weights the engine is served
  (``skyrl_backends._mcore_precision``);
- tensor parallelism runs with megatron-core's sequence parallelism (its MoE layers need
  it): :meth:`MegatronBackend._clip_gradients` sums the unsplit weights' gradients; the
  ranks form ``world / (tensor_parallel x pipeline_parallel)`` data-parallel replicas (the
  train step reduces over megatron-core's data-parallel group, the gradients are summed
  over it);
- context parallelism: each rank computes its own chunks of every row through the
  decoder (its queries attend to every rank's keys: ``_mcore_model``) and the logits of
  its own loss tokens; their logprobs are summed over the ranks, so every rank computes
  the same loss; the gradients are summed over the context-parallel ranks with the
  data-parallel replicas;
- pipeline parallelism runs every stage through the same train step in lockstep, one
  micro-batch at a time (``skyrl_backends._mcore_pipeline``): the stages exchange hidden
  states and their gradients at the boundaries, the last stage computes the logprobs and
  hands them to the others, so every stage computes the same loss and metrics;
- weights leave with Hugging Face names (``named_weights``: ``mcore_to_hf``), so every
  transport, engine and the final Hugging Face folder work unchanged;
- checkpoints are megatron-core distributed checkpoints (``save_checkpoint`` /
  ``load_checkpoint``, ``_mcore_checkpoint``): each rank writes its own shards, and any
  tensor / expert / pipeline-parallel layout reads them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from skyrl_backends import _mcore_checkpoint, _parallel
from skyrl_backends._mcore_arch import NotExpressible, describe
from skyrl_backends._mcore_model import (MegatronLM, build, context_slots, ensure_parallel_state, hf_to_mcore, load_into,
                                         mcore_to_hf, weights_of)
from skyrl_backends._mcore_pipeline import global_layer_names, pipeline_stage
from skyrl_backends._mcore_precision import MegatronPrecision, quantized_names
from skyrl_backends._optimizer import make_optimizer
from skyrl_backends._trainer import TorchBackend
from skyrl_backends._options import context_parallel_problem
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

        def __init__(self, group_best: int | None = None) -> None:
            super().__init__()
            self.forced: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids [N, k], bool [N])
            # group-limited routing scores each group by its best ``group_best`` experts (DeepSeek-V3,
            # GLM-4.5 and Kimi K2: 2), where megatron-core's own top-k takes top_k / group_topk
            self.group_best = group_best

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if group_topk and self.group_best:
                probs, idx = _group_limited_topk(scores, topk, num_groups, group_topk, self.group_best)
            else:
                probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if self.forced is None:
                return probs, idx
            ids, mask = self.forced
            if ids.shape != idx.shape:
                raise ValueError(f"r3: {tuple(ids.shape)} replayed routes for a router that routes {tuple(idx.shape)}")
            idx = torch.where(mask[:, None], ids.to(idx.device, idx.dtype), idx)
            return scores.gather(1, idx), idx

    return EngineRoutes


def _group_limited_topk(scores: torch.Tensor, topk: int, groups: int, group_topk: int, best: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's choice: the ``group_topk`` groups whose ``best`` highest scores sum
    highest, then the top ``topk`` experts within them (as the transformers routers do)."""
    n, e = scores.shape
    group_scores = scores.view(n, groups, e // groups).topk(best, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
    mask = mask.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)
    return torch.topk(scores.masked_fill(~mask, float("-inf")), k=topk, dim=-1)


def install_router_replays(gpt: Any, group_best: int | None) -> list[Any]:
    """An :class:`EngineRoutes` on every MoE router of ``gpt`` (they hold the group rule
    and, under r3, the engine's routes); returns them in layer order."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    cls = _router_replay_class()
    replays = []
    for layer in gpt.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            router.router_replay = cls(group_best)
            replays.append(router.router_replay)
    RouterReplay.clear_global_router_replay_instances()  # ours are held by their routers, not the global list
    return replays


class MegatronRoutingReplay:
    """``r3`` inside the megatron backend: the job's r3 strategy, carried out by the
    routers' replay objects instead of module hooks (ReplayStrategy's native form)."""

    name = "r3"
    side_channel = "routed_experts"

    def __init__(self, replays: list[Any], k: int, first: int = 0, total: int | None = None):
        self.k = k
        self.replays = replays  # the routers' EngineRoutes, in layer order
        # (pipeline parallelism: this stage's routers are the model's MoE layers first .. first + len(replays) - 1
        # of ``total``; the side channel has a column for each)
        self.first = first
        self.total = len(replays) if total is None else total
        self._last_of: tuple[Any, np.ndarray] | None = None
        self.rows = 1  # the forward's row count, set by the backend before each replaying()
        self.sequence_parallel = 1  # the tensor-parallel size, whose ranks each route a slice of the sequence

    def _is_last(self, batch: Any) -> np.ndarray:
        if self._last_of is None or self._last_of[0] is not batch:
            self._last_of = (batch, batch.last_tokens())
        return self._last_of[1]

    @contextlib.contextmanager
    def replaying(self, view: ReplayView) -> Iterator[None]:
        routes = view.batch.side_channels.get(self.side_channel)
        if routes is None:
            raise ValueError("replay strategy 'r3': the batch has no 'routed_experts' side channel "
                             "(set engine.return_routed_experts = true)")
        L, k = len(self.replays), self.k
        if isinstance(routes, CSR) or routes.ndim != 3 or routes.shape[1:] != (self.total, k):
            shape = "CSR" if isinstance(routes, CSR) else list(routes.shape)
            raise ValueError(f"replay strategy 'r3': side channel 'routed_experts' must be [tokens, {self.total} MoE "
                             f"layers, top_k {k}] for this model, found {shape}")
        slots = np.asarray(view.slot_tokens, dtype=np.int64)
        real = slots >= 0
        ids = np.zeros((len(slots), L, k), dtype=np.int64)
        ids[real] = routes[slots[real], self.first:self.first + L]
        mask = real.copy()
        mask[real] = ~self._is_last(view.batch)[slots[real]]  # the engine never fed a sequence's last token
        # megatron-core routes tokens sequence-major ([R, rows] flattened); the slots are row-major.
        n_rows = self.rows
        R = len(slots) // n_rows
        ids = torch.as_tensor(ids.reshape(n_rows, R, L, k).transpose(1, 0, 2, 3), device=view.device)  # [R, rows, L, k]
        mask = torch.as_tensor(mask.reshape(n_rows, R).T, device=view.device)
        split = context_slots(R, view.device)
        if split is not None:  # each context-parallel rank routes its own slots
            ids, mask, R = ids[split[1]], mask[split[1]], len(split[1])
        ids, mask = ids.reshape(R * n_rows, L, k), mask.reshape(-1)
        if self.sequence_parallel > 1:  # each tensor-parallel rank routes its own slice of the sequence
            from megatron.core import parallel_state

            rank, part = parallel_state.get_tensor_model_parallel_rank(), R * n_rows // self.sequence_parallel
            ids, mask = ids[rank * part:(rank + 1) * part], mask[rank * part:(rank + 1) * part]
        try:
            for layer, replay in enumerate(self.replays):
                replay.forced = (ids[:, layer], mask)
            yield
        finally:
            for replay in self.replays:
                replay.forced = None


def _cpu(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


_TP_SPLIT = ("word_embeddings", "output_layer", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
             "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
"""The weights tensor parallelism splits across ranks (by name); norms and routers are whole on every rank."""


def _vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, Any]:
    """Logprobs of ``targets`` (and entropies) from this tensor-parallel rank's vocabulary shard
    of the logits: the row max and the sum of exponentials reduced over the ranks, the
    target's logit taken where it lives."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_sum

    group = parallel_state.get_tensor_model_parallel_group()
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    top = logits.detach().max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    z = logits - top[:, None]
    lse = torch.log(reduce_sum(torch.exp(z).sum(-1))) + top
    local = targets - start
    here = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, width - 1)[:, None]).squeeze(-1) * here
    lp = reduce_sum(picked) + top - lse
    ent = None
    if entropy:
        with torch.no_grad():
            p = torch.exp(logits - lse[:, None])
            mean_logit = (p * logits).sum(-1)
            dist.all_reduce(mean_logit, group=group)
            ent = lse - mean_logit
    return lp, ent


def _from_context_ranks(owned: torch.Tensor, lp: torch.Tensor, ent: Any) -> tuple[torch.Tensor, Any]:
    """Every loss token's logprob (and entropy) on every context-parallel rank, from each
    rank's own tokens (``owned``: bool [K], this rank's): summed over the ranks into [K]
    vectors; the backward hands each rank the gradient of its own tokens (megatron-core's
    reduce: all-reduce forward, identity backward, as every rank computes the same loss)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_context_parallel_group()
    where = owned.nonzero().squeeze(-1)
    full = reduce_from_tensor_model_parallel_region(lp.new_zeros(len(owned)).index_copy(0, where, lp), group=group)
    if ent is not None:
        ent = ent.new_zeros(len(owned)).index_copy(0, where, ent)
        dist.all_reduce(ent, group=group)
    return full, ent


class MegatronBackend(TorchBackend):
    """A :class:`skyrl_host.interfaces.Backend` on megatron-core: one process, or a model
    over ``tensor_parallel`` x ``expert_parallel`` x ``pipeline_parallel`` x
    ``context_parallel`` processes, in ``world / (tensor_parallel x pipeline_parallel x
    context_parallel)`` data-parallel replicas."""

    owns_weights = True  # (OwnWeights: megatron-core's tensors, never the loaded model's)

    def __init__(self, config: Any):
        super().__init__(config)
        self.arch: Any = None
        self._r3: MegatronRoutingReplay | None = None
        self._router_replays: list[Any] = []  # every MoE router's EngineRoutes
        self._mp: Any = None  # MegatronPrecision with a quantizing precision
        self._fq: tuple[Any, dict[str, torch.Tensor]] | None = None  # (weights version, quantized weights)
        self._loads = 0  # load_state_dict calls (a part of the weights' version)
        self._dp_rank = 0  # this rank's model replica (data-parallel index)
        self.ranks = 1  # the trainer processes (tensor x expert parallel x pipeline stages x data-parallel replicas)
        self._gathers = 0  # full-weight gathers across the ranks (named_weights under model parallelism)
        self._gathered: tuple[Any, dict[str, torch.Tensor]] | None = None  # (weights version, the last gather)
        self._stage: Any = None  # this rank's pipeline Stage (None without pipeline parallelism)

    def _fake_weights(self) -> dict[str, torch.Tensor]:
        """This rank's quantized megatron-core weights as the engine serves them, made again
        after every optimizer step and checkpoint load (a collective under model parallelism:
        every rank's first forward after a change)."""
        version = (self.steps, self._loads)
        if self._fq is None or self._fq[0] != version:
            # The weight sync after the step has usually gathered this version already: reuse it.
            kept, self._gathered = self._gathered, None
            with torch.no_grad():
                full = kept[1] if kept is not None and kept[0] == version else self._full_weights()
                fake = self._mp.fake(full)
            self._fq = (version, {k: v.to(self.device) for k, v in fake.items()})
        return self._fq[1]

    def start(self, loaded: Any, *, seed: int, total_steps: int, reference: bool, replay: Any = (),
              precision: Any = None) -> None:
        """Build the ``GPTModel`` of ``loaded``'s model, with its weights; ``replay``: the
        job's strategies (``r3`` natively, scoring strategies through the output head);
        ``precision``: fake-quantized as the engine serves it (``_mcore_precision``), the
        reference policy's forward too."""
        cfg = self.config
        try:
            self.arch = describe(loaded.model.config)
        except NotExpressible as exc:
            raise UserError(f"[backend] name = \"megatron\" cannot build this model: {exc}") from None
        self.device = _parallel.pick_device(False, cfg.device)
        self.seed = seed
        tp, ep, pp, cp = cfg.tensor_parallel, cfg.expert_parallel, cfg.pipeline_parallel, cfg.context_parallel
        if cp > 1 and (problem := context_parallel_problem(cfg, self.arch.mla)) is not None:
            raise UserError(f"[backend] {problem}")
        if pp > 1 and self.arch.num_layers % pp:
            raise UserError(f"[backend] pipeline_parallel = {pp} must divide the decoder layers "
                            f"({self.arch.num_layers}): each stage holds as many")
        if ep > 1 and not self.arch.is_moe:
            raise UserError(f"[backend] expert_parallel = {ep} needs a mixture-of-experts model; this one is dense")
        if tp > 1 and (self.arch.vocab % tp or self.arch.groups % tp):
            raise UserError(f"[backend] tensor_parallel = {tp} must divide the vocabulary ({self.arch.vocab}) and the "
                            f"key/value heads ({self.arch.groups})")
        if tp > 1 and self.arch.mla and self.arch.heads % tp:
            raise UserError(f"[backend] tensor_parallel = {tp} must divide the attention heads ({self.arch.heads})")
        # megatron-core's multi-latent attention rotates by 0..R-1 along each row: one sequence a row
        self._one_sequence_per_row = self.arch.mla
        if ep > 1 and self.arch.experts % ep:
            raise UserError(f"[backend] expert_parallel = {ep} must divide the experts ({self.arch.experts})")
        self.rank, world = ensure_parallel_state(tp, ep, self.device, seed, pipeline_parallel=pp, context_parallel=cp)
        if world % (tp * ep * pp * cp):
            raise UserError(f"[backend] tensor_parallel = {tp} x expert_parallel = {ep} x pipeline_parallel = {pp} "
                            f"x context_parallel = {cp} must divide the trainer processes, found {world}")
        # The ranks form world / (tp x pp x cp) data-parallel replicas of the model, each training on its
        # own share of the batch, as the torch backend's data parallel does (the normalisers and
        # metrics reduce over the data-parallel group; _clip_gradients sums the gradients over it).
        # Tensor-parallel ranks, context-parallel ranks and pipeline stages of one replica all see its
        # whole share. Expert parallelism carves its groups out of the data-parallel ranks: each of
        # those holds experts / ep experts.
        from megatron.core import parallel_state

        dp = world // (tp * pp * cp)
        self._stage = pipeline_stage(self.arch.num_layers)
        self.ranks = world
        self._dp, self.world = dp > 1, dp
        self._dp_group = parallel_state.get_data_parallel_group() if dp > 1 else None
        self._dp_rank = parallel_state.get_data_parallel_rank() if dp > 1 else 0
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
        group_best = 2 if self.arch.route_groups else None
        self._router_replays = install_router_replays(gpt, group_best)
        if reference:
            ref = build(self.arch, self.device, routing_replay=False)
            load_into(ref, weights)
            install_router_replays(ref, group_best)
            ref.eval()
            ref.requires_grad_(False)
            self.reference = ref
            self._ref_lm = MegatronLM(ref, padding_idx, self._stage)
        self._lm = MegatronLM(gpt, padding_idx, self._stage)
        self.module = gpt
        self.precision = precision
        if precision is not None and precision.quantizes:
            names = quantized_names(precision, loaded.model, tuple(loaded.precision_keep))
            self._mp = MegatronPrecision(precision, self.arch, names, hf)
            self._mp.install(gpt, self._fake_weights)
            if reference:
                frozen = self._mp.fake(hf)  # the reference policy's weights never change
                self._mp.install(self.reference, lambda: frozen)
        self.replay = []
        for strategy in replay:
            if strategy.name == "r3":
                # (pipeline parallelism: this stage's MoE layers are the model's from its first layer's on)
                first = max(0, (self._stage.offset if self._stage else 0) - self.arch.dense_layers)
                total = self.arch.num_layers - self.arch.dense_layers
                self._r3 = MegatronRoutingReplay(self._router_replays, self.arch.top_k, first, total)
                self._r3.sequence_parallel = tp
                self.replay.append(self._r3)
            elif has(strategy, ScoringReplay):
                if self._stage is None or self._stage.last:  # (the head and the scoring are the last stage's)
                    strategy.bind(self._lm, loaded)  # reads the output head through MegatronLM.get_output_embeddings
                self.replay.append(strategy)
            else:
                raise ValueError(f"replay strategy {strategy.name!r} is not supported by the megatron backend "
                                 "(it replays 'r3' and scoring strategies such as 'support')")
        # (under tensor parallelism the strategy scores over this rank's vocabulary rows: MegatronLM's ShardedHead)
        self._scorer_strategy = next((s for s in self.replay if has(s, ScoringReplay)), None)
        self.optimizer, self.scheduler = make_optimizer(gpt, cfg, total_steps)

    # -- model parallelism --------------------------------------------------------------

    def _loss_scale(self) -> float:
        return 1.0  # _clip_gradients sums the replicated weights' gradients itself

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Under tensor parallelism first sum the q/k norms' partial gradients over the ranks,
        under expert parallelism the replicated (non-expert) weights' gradients; then the
        global norm: the squares of tensor-parallel shards and of experts summed over the
        ranks holding parts of them, replicated weights counted once. (Which weights are
        split is read from their names: megatron-core sets its partition attributes only
        when it initialises the weights itself.) Under pipeline parallelism the tied
        embedding's two copies (the first stage's embedding, the last stage's head) get their
        gradients summed over megatron-core's embedding group, and the squares are summed over
        the stages, the head's copy left out."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        tp, ep, dp = self.config.tensor_parallel, self.config.expert_parallel, self.world
        cp = self.config.context_parallel
        if self.ranks == 1:
            return super()._clip_gradients(max_norm)
        named = [(k, p) for k, p in self.module.named_parameters() if p.grad is not None]
        if tp > 1:
            # Sequence parallel: every weight tensor parallelism does not split (norms, routers, the
            # q/k norms acting on each rank's own heads) saw only this rank's slice of the sequence
            # or its own heads: its gradient is a partial sum (megatron-core's finalize_model_grads
            # sums them the same way).
            group = parallel_state.get_tensor_model_parallel_group()
            for name, p in named:
                if not any(part in name for part in _TP_SPLIT):
                    dist.all_reduce(p.grad, group=group)
        if dp * cp > 1:
            # The replicas' gradients summed (the loss is normalised by the global counts); an
            # expert's only over the ranks holding that expert (the expert-data-parallel group).
            # Context-parallel ranks each hold their own slots' share of the gradient: summed too.
            group = parallel_state.get_data_parallel_group(with_context_parallel=cp > 1)
            expert_group = parallel_state.get_expert_data_parallel_group() if dp * cp > ep else None
            for name, p in named:
                if ".experts." not in name:
                    dist.all_reduce(p.grad, group=group)
                elif expert_group is not None:
                    dist.all_reduce(p.grad, group=expert_group)
        stage, copy = self._stage, None
        if stage is not None and self.arch.tied and (stage.first or stage.last):
            # One weight in two places: the first stage's embedding and the last stage's head. Each
            # copy got the gradient of its own use: both take the sum (megatron-core's embedding group).
            shared = self.module.shared_embedding_or_output_weight()
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            dist.all_reduce(shared.grad, group=parallel_state.get_embedding_group())
            copy = shared if not stage.first else None  # (counted once in the norm: the first stage's)
            named = [(k, p) for k, p in self.module.named_parameters() if p.grad is not None]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        split, experts, replicated = zero.clone(), zero.clone(), zero.clone()
        for name, p in named:
            if p is copy:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if ".experts." in name and tp * ep > 1:
                experts += sq
            elif tp > 1 and any(part in name for part in _TP_SPLIT):
                split += sq
            else:
                replicated += sq
        # (the split weights' squares over the ranks that split them: the tensor-parallel shards over
        # the tensor-parallel group, the experts over the ranks that split them by expert and by
        # tensor parallelism; every replica holds the same summed gradients)
        if tp > 1:
            dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
        if tp * ep > 1:
            dist.all_reduce(experts, group=parallel_state.get_expert_tensor_and_model_parallel_group())
        squares = split + experts + replicated
        if stage is not None:  # every stage its own layers
            stage.all_reduce(squares)
        norm = squares.sqrt()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for _, p in named:
                p.grad.mul_(coef)
        return norm.float()

    def _same_shape(self, mb: Any) -> None:
        """Under expert parallelism pad ``mb``'s rows (in place, once) to the largest
        ``[rows, R]`` of the ranks' micro-batches at this forward: megatron-core's allgather
        dispatcher gathers equal-sized token blocks (a collective: every rank calls it at the
        same forwards). Under tensor parallelism pad ``R`` to a multiple of the ranks, which
        each hold ``R / tensor_parallel`` slots of the sequence between the tensor-parallel
        regions, and under context parallelism to a multiple of ``2 x context_parallel x
        tensor_parallel`` (each context-parallel rank holds two equal chunks of every row:
        ``_mcore_model.context_slots``). Padding slots (id 0, position 0: each its own
        sequence) are neither scored nor replayed; ``keep`` and ``slot_tokens`` follow the
        new row length."""
        tp, cp = self.config.tensor_parallel, self.config.context_parallel
        if (self.config.expert_parallel == 1 and tp == 1 and cp == 1) or getattr(mb, "_same_shape", False) \
                or mb.ids is None:
            return
        import torch.distributed as dist

        rows2, R2 = rows, R = mb.ids.shape
        if self.config.expert_parallel > 1:
            shape = torch.tensor([rows, R], dtype=torch.int64)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX)
            rows2, R2 = int(shape[0]), int(shape[1])
        # sequence parallel: the tensor-parallel ranks (all with this micro-batch) take R / tp slots each;
        # context parallel: each rank 2 of 2 x cp equal chunks of the row
        unit = tp * 2 * cp if cp > 1 else tp
        if unit > 1:
            R2 = -(-R2 // unit) * unit
        if (rows2, R2) != (rows, R):
            ids = torch.zeros((rows2, R2), dtype=mb.ids.dtype, device=mb.ids.device)
            pos = torch.zeros((rows2, R2), dtype=mb.pos.dtype, device=mb.pos.device)
            ids[:rows, :R], pos[:rows, :R] = mb.ids, mb.pos
            mb.ids, mb.pos = ids, pos
            mb.keep = (mb.keep // R) * R2 + mb.keep % R
            if mb.slot_tokens is not None:
                slots = np.full((rows2, R2), -1, dtype=np.int64)
                slots[:rows, :R] = np.asarray(mb.slot_tokens, dtype=np.int64).reshape(rows, R)
                mb.slot_tokens = slots.reshape(-1)
        mb._same_shape = True

    def _logprobs(self, module: Any, mb: Any, temperature: float, entropy: bool = False) -> tuple[Any, Any, Any]:
        """The torch backend's (logprobs, entropy, logits); under pipeline parallelism the last
        stage computes them and hands the logprobs and entropies to the earlier stages
        (``_mcore_pipeline``), which return them as their own: every stage computes the same
        loss and metrics from them, and the earlier stages' backward passes take their hidden
        states' gradients from the next stage."""
        self._same_shape(mb)
        stage = self._stage
        if stage is None:
            return self._head_logprobs(module, mb, temperature, entropy)
        if self._mp is not None and module is self._lm:
            # A new weight version's quantized weights are gathered from every stage (a collective):
            # here, where every stage is, not at the first quantized layer (on a later stage that
            # forward is waiting for the previous stage's hidden states).
            self._fake_weights()
        if stage.last:
            lp, ent, logits = self._head_logprobs(module, mb, temperature, entropy)
            if mb.n_loss:
                stage.share(torch.stack([lp.detach(), ent]) if entropy else lp.detach()[None])
            return lp, ent, logits
        keep = mb.keep if mb.n_loss else torch.zeros(1, dtype=torch.long, device=self.device)
        with self._autocast():
            hidden = module(mb.ids, mb.pos, keep)
        # (no loss token: the last stage sends nothing, and a zero stands for its logits)
        out = stage.to_last(hidden, (2 if entropy else 1, len(mb.keep)) if mb.n_loss else None)
        if not mb.n_loss:
            return None, None, out
        return out[0], (out[1].detach() if entropy else None), out[0]

    def _head_logprobs(self, module: Any, mb: Any, temperature: float, entropy: bool = False) -> tuple[Any, Any, Any]:
        """Under tensor parallelism each rank holds a vocabulary shard of the logits: the
        log-softmax reduces its max and sums over the ranks (never gathering the logits).
        Under context parallelism each rank computes the logits of the loss tokens in its own
        slots only, and their logprobs and entropies are summed into every rank's [K]
        vectors (each token is one rank's), so every rank gets the same loss while no rank
        holds the logits of another's tokens. (A scoring strategy takes the whole view: its
        hidden states are gathered instead, ``MegatronLM``.)"""
        scored = self._scorer_strategy is not None and mb.n_loss and mb.batch is not None
        context = self.config.context_parallel > 1 and bool(mb.n_loss) and not scored
        if (self.config.tensor_parallel == 1 and not context) or scored:  # (a scorer reduces over the shards itself)
            return super()._logprobs(module, mb, temperature, entropy)
        keep = mb.keep if mb.n_loss else torch.zeros(1, dtype=torch.long, device=self.device)
        with self._autocast():
            out = module(mb.ids, mb.pos, keep, own_tokens=context)
        logits, owned = out if context else (out, None)
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        if not mb.n_loss:
            return None, None, logits
        targets = mb.targets if owned is None else mb.targets[owned]
        if self.config.tensor_parallel > 1:
            lp, ent = _vocab_parallel_logprobs(logits, targets, entropy)
        else:
            lse = torch.logsumexp(logits, dim=-1)
            lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
            ent = None
            if entropy:
                with torch.no_grad():
                    z = logits.detach()
                    ent = lse.detach() - (torch.softmax(z, dim=-1) * z).sum(-1)
        if owned is None:
            return lp, ent, logits
        lp, ent = _from_context_ranks(owned, lp, ent)
        return lp, ent, lp

    def _teacher_topk(self, mb: Any, logits: Any) -> dict[str, Any]:
        """The teacher's top-k term needs each loss token's logits over the whole vocabulary
        on one rank: refused when tensor, pipeline or context parallelism splits them."""
        c = self.config
        split = [f"{name} = {getattr(c, name)}" for name in ("tensor_parallel", "pipeline_parallel", "context_parallel")
                 if getattr(c, name) > 1]
        if split and mb.batch is not None and "teacher_topk_ids" in mb.batch.side_channels:
            from skyrl_host.errors import UserError

            raise UserError(f"[algorithm] teacher_kl_topk needs each token's logits over the whole vocabulary on one "
                            f"rank; [backend] {', '.join(split)} splits them (use the sampled-token teacher KL: "
                            "teacher_kl_topk = 0)")
        return super()._teacher_topk(mb, logits)

    def _replaying(self, mb: Any) -> Any:
        self._same_shape(mb)
        if self._r3 is not None and mb.ids is not None:
            self._r3.rows = int(mb.ids.shape[0])
        return super()._replaying(mb)

    # -- weights ------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The model's weights with the transformers model's names and layouts (the tied
        head's alias included), converted from megatron-core's. With several ranks a
        collective (every rank calls it; every rank gets the full weights)."""
        if self.module is None:
            raise RuntimeError("named_weights before start()")
        full = self._full_weights()
        if self.ranks > 1 and self._mp is not None:  # kept until the next forward quantizes this version
            self._gathered = ((self.steps, self._loads), full)
        return iter(list(full.items()))

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model by transformers names (:meth:`named_weights`; with several ranks
        a collective gathering every rank's shards)."""
        own = weights_of(self.module)
        tp, ep = self.config.tensor_parallel, self.config.expert_parallel
        if self.ranks == 1:
            return mcore_to_hf(self.arch, [own])
        import torch.distributed as dist

        from megatron.core import parallel_state

        # One copy of each (tensor-parallel rank, expert-parallel rank)'s shards: the ranks of the
        # first expert-data-parallel replica send theirs, tagged with their coordinates; each
        # pipeline stage its own layers, by their numbers in the whole model.
        coords = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank())
        first = parallel_state.get_expert_data_parallel_rank() == 0
        if self._stage is not None:
            own = global_layer_names(own, self._stage.offset)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (coords, {k: v.cpu() for k, v in own.items()}) if first else None)
        by: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for c, sd in (g for g in gathered if g is not None):
            by.setdefault(c, {}).update(sd)  # (the stages' parts of one (tp, ep) coordinate)
        shards = [by[(t, 0)] for t in range(tp)]
        experts = [[by[(t, e)] for t in range(tp)] for e in range(ep)] if ep > 1 else None
        self._gathers += 1
        return mcore_to_hf(self.arch, shards, experts=experts)

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size): the tensor-parallel
        ranks of one model replica train on the same data, each replica (and each
        expert-parallel rank) on its own share."""
        return (self._dp_rank, self.world) if self.world > 1 else (0, 1)

    def state_dict(self) -> Mapping[str, Any]:
        """One process: the torch backend's state (model by megatron-core names, AdamW,
        schedule, steps). With several ranks a collective: rank 0 gets every
        rank's own state (``"ranks"``, in rank order), the others an empty dict."""
        if self.ranks == 1:
            return super().state_dict()
        import torch.distributed as dist

        own = {  # this rank's own tensors (torch's full-state helpers give rank 0 everything, the others nothing)
            "model": {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                      for k, v in self.module.state_dict().items()},
            "optimizer": _cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own)
        if self.rank != 0:
            return {}
        return {"format": 1, "steps": own["steps"], "lora": None, "layout": self._layout(), "ranks": gathered}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; with several ranks every rank calls
        it and rank 0's state (the others may pass ``{}``) gives each rank its own part."""
        self._loads += 1
        if self.ranks == 1:
            if "ranks" in state:
                raise ValueError(f"the checkpoint was written by {len(state['ranks'])} megatron ranks "
                                 f"({state.get('layout')}); this backend runs on one process")
            return super().load_state_dict(state)
        import torch.distributed as dist

        box = [state if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        full = box[0] or {}
        if "ranks" not in full or full.get("layout") != self._layout() or len(full["ranks"]) != dist.get_world_size():
            raise ValueError(f"the checkpoint was written with megatron layout {full.get('layout', 'one process')}, "
                             f"this backend runs {self._layout()}: [backend] tensor_parallel and expert_parallel must "
                             "match the run being resumed")
        own = full["ranks"][self.rank]
        self.module.load_state_dict(own["model"], strict=True)
        self.optimizer.load_state_dict(own["optimizer"])
        self.scheduler.load_state_dict(own["scheduler"])
        self.steps = int(own["steps"])

    def save_checkpoint(self, folder: str) -> None:
        """(ShardedCheckpoints) Write the training state into ``folder`` with megatron-core's
        distributed checkpointing: each rank its own shards, resumable under any tensor /
        expert / pipeline-parallel layout (``_mcore_checkpoint``). A collective."""
        _mcore_checkpoint.save(self, folder)

    def load_checkpoint(self, folder: str) -> None:
        """(ShardedCheckpoints) Restore what :meth:`save_checkpoint` wrote, written under any
        layout. A collective."""
        self._loads += 1
        _mcore_checkpoint.load(self, folder)

    def _layout(self) -> dict[str, int]:
        layout = {"tensor_parallel": self.config.tensor_parallel, "expert_parallel": self.config.expert_parallel}
        if self.config.pipeline_parallel > 1:
            layout["pipeline_parallel"] = self.config.pipeline_parallel
        if self.config.context_parallel > 1:
            layout["context_parallel"] = self.config.context_parallel
        replicas = self.world // self.config.expert_parallel if self.config.expert_parallel > 1 else self.world
        return {**layout, "data_parallel": replicas} if replicas > 1 else layout

    def local_weights(self) -> Iterator[tuple[str, Any]]:
        """Every rank's full weights (:meth:`named_weights`; shards by name are not served yet)."""
        return self.named_weights()

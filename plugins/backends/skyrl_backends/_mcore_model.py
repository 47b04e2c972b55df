"""megatron-core models built from a Hugging Face config, and their weights in both naming schemes.

- (:func:`skyrl_backends._mcore_arch.describe`: the :class:`Architecture` of a Hugging
  Face config, or a ``NotExpressible`` naming what megatron-core lacks for it;)
- :func:`ensure_parallel_state`: torch.distributed and megatron-core's parallel groups
  (a one-process gloo group when the launcher started none), plus the CPU shims
  megatron-core 0.16 needs (FACTS.md: ``torch.cuda.current_device`` while building,
  the inference RNG tracker, no TransformerEngine GEMM in the router; activation
  recompute without a CUDA generator to save; multi-latent attention told that
  TransformerEngine is absent);
- :func:`build`: the ``GPTModel`` (local, TransformerEngine-free layer specs, with the
  backend's own :class:`RMSNorm`, whole-weight MLA down projections and, for scaled
  RoPE, :func:`rope_inv_freq`);
- :func:`hf_to_mcore` / :func:`mcore_to_hf`: a state dict in the other scheme (fused QKV
  in query-group order, fused gate/up, per-expert MLPs, tied heads), for this rank's
  tensor-parallel shard or from the gathered shards;
- :class:`MegatronLM`: the model called the way the torch backend's train step calls
  ``PackedLM``: packed rows with positions restarting per sequence (a block-diagonal
  causal mask and rotary angles taken at each slot's own position), logits at the loss
  positions only; under context parallelism each rank computes its own chunks of every
  row (:func:`context_slots`), attending to every rank's keys.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from skyrl_backends._mcore_arch import Architecture


# -- process groups and the CPU shims ---------------------------------------------------


def _quiet_megatron() -> None:
    """megatron-core warns on import and in every forward about what a CPU machine lacks
    (TransformerEngine, Apex) and about its own deprecations: not the user's business.
    Only warnings raised inside megatron-core's modules are silenced."""
    import warnings

    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\.")


def _patch_moe_utils() -> None:
    # megatron-core 0.16.1's router GEMM reads the module global ``te_general_gemm``, which is
    # left undefined when TransformerEngine did not import (a NameError in every MoE forward).
    import megatron.core.transformer.moe.moe_utils as mu

    if not hasattr(mu, "te_general_gemm") or not torch.cuda.is_available():
        mu.te_general_gemm = None


_OWN_GROUP = False  # whether ensure_parallel_state started the process's torch.distributed group


def release_parallel_state() -> None:
    """Undo :func:`ensure_parallel_state`: megatron-core's groups, and the one-process
    torch.distributed group if it started one (a group the launcher started stays). For
    a process that goes on without the backend (tests, notebooks): other code reads an
    initialised group as the launcher's."""
    global _OWN_GROUP
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if _OWN_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP = False


def _patch_mla() -> None:
    # Without TransformerEngine megatron-core 0.16.1's TE extension module still imports, with
    # mock classes in place of TE's, so multi_latent_attention sets HAVE_TE = True and then
    # calls isinstance(..., <a mock>) while building (a TypeError). Tell it the truth.
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        import megatron.core.transformer.multi_latent_attention as mla

        mla.HAVE_TE = False


def ensure_parallel_state(tensor_parallel: int, expert_parallel: int, device: torch.device, seed: int,
                          pipeline_parallel: int = 1, context_parallel: int = 1) -> tuple[int, int]:
    """torch.distributed (a one-process gloo group when none runs) and megatron-core's model-parallel
    groups of these sizes; returns (rank, world)."""
    import torch.distributed as dist

    _quiet_megatron()
    from megatron.core import parallel_state, tensor_parallel as tp

    _patch_moe_utils()
    _patch_mla()
    _cpu_shims()
    if not dist.is_initialized():
        if tensor_parallel * expert_parallel * pipeline_parallel * context_parallel > 1:
            raise ValueError(
                f"tensor_parallel = {tensor_parallel}, expert_parallel = {expert_parallel}, pipeline_parallel = "
                f"{pipeline_parallel}, context_parallel = {context_parallel} need that many processes: "
                "start the trainer ranks with [cluster] trainer_ranks"
            )
        fd, path = tempfile.mkstemp(prefix="skyrl-megatron-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{path}", rank=0,
                                world_size=1)
        global _OWN_GROUP
        _OWN_GROUP = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel * context_parallel) or (world // pipeline_parallel) % expert_parallel:
        raise ValueError(f"{world} trainer ranks do not divide into tensor_parallel = {tensor_parallel} x "
                         f"expert_parallel = {expert_parallel} x pipeline_parallel = {pipeline_parallel} x "
                         f"context_parallel = {context_parallel}")
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel
                and parallel_state.get_expert_model_parallel_world_size() == expert_parallel
                and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_parallel
                and parallel_state.get_context_parallel_world_size() == context_parallel)
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, expert_model_parallel_size=expert_parallel,
            pipeline_model_parallel_size=pipeline_parallel, context_parallel_size=context_parallel,
            distributed_timeout_minutes=30, order="tp-cp-ep-dp-pp",
            create_gloo_process_groups=backend == "gloo",
        )
    if device.type == "cuda":
        tp.model_parallel_cuda_manual_seed(seed)
    else:
        tp.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return rank, world


def _cpu_shims() -> None:
    """megatron-core asks ``torch.cuda.current_device()`` where to put buffers (while building,
    and for attention's scratch buffer in every forward). On a machine without CUDA that call
    can only raise; it answers "cpu" instead (process-wide, installed once; a machine with
    CUDA is left alone)."""
    if torch.cuda.is_available() or getattr(torch.cuda.current_device, "_skyrl_cpu", False):
        return

    def current_device() -> str:
        return "cpu"

    current_device._skyrl_cpu = True  # type: ignore[attr-defined]
    torch.cuda.current_device = current_device  # type: ignore[assignment]
    # Activation recompute saves and restores the CUDA generator's state around each layer
    # (megatron-core keeps the CPU generator's itself): without CUDA there is none to keep.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def transformer_config(m: Architecture, *, routing_replay: bool, recompute: bool = False) -> Any:
    """megatron-core's TransformerConfig for ``m``: float32 parameters, no fusions, no dropout;
    ``recompute``: full activation recompute of every layer in the backward pass."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=m.num_layers, hidden_size=m.hidden, num_attention_heads=m.heads, num_query_groups=m.groups,
        kv_channels=m.head_dim, ffn_hidden_size=m.dense_ffn if m.dense_layers else m.ffn, normalization="RMSNorm",
        layernorm_epsilon=m.eps, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=m.qkv_bias, qk_layernorm=m.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32, use_cpu_initialization=True,
        perform_initialization=False, attention_softmax_in_fp32=True,
    )
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    from megatron.core import parallel_state

    kw["tensor_model_parallel_size"] = parallel_state.get_tensor_model_parallel_world_size()
    # Under tensor parallelism the sequence is split too between the tensor-parallel regions
    # (norms, routers: megatron-core's MoE layers require it); MegatronLM gathers it for the head.
    kw["sequence_parallel"] = kw["tensor_model_parallel_size"] > 1
    kw["expert_model_parallel_size"] = parallel_state.get_expert_model_parallel_world_size()
    kw["pipeline_model_parallel_size"] = parallel_state.get_pipeline_model_parallel_world_size()
    # (context parallelism is the backend's own, in SDPAttention and MegatronLM: megatron-core's is
    # TransformerEngine's attention, and its local DotProductAttention refuses a context-parallel config)
    if kw["pipeline_model_parallel_size"] > 1:
        kw["pipeline_dtype"] = torch.float32  # (megatron-core requires it; the backend's own exchange sends float32)
    if m.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kw.update(
            multi_latent_attention=True, q_lora_rank=m.q_lora or None, kv_lora_rank=m.kv_lora,
            qk_head_dim=m.head_dim, qk_pos_emb_head_dim=m.rope_dim, v_head_dim=m.v_dim, rope_type="rope",
            rotary_base=m.rope_theta, qk_layernorm=True,  # (megatron-core's switch for the latents' RMSNorms)
        )
        if m.rope_type == "yarn":  # megatron-core's MLA has YaRN itself (its ramp, temperature and softmax scale)
            kw.update(
                rope_type="yarn", rotary_scaling_factor=m.rope_factor, original_max_position_embeddings=m.yarn_original_max,
                beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow, mscale_all_dim=m.mscale_all_dim,
                mscale=_concentration_mscale(m, m.mscale_all_dim),
            )
        return MLATransformerConfig(**_moe_options(m, kw, routing_replay))
    config = TransformerConfig(**_moe_options(m, kw, routing_replay))
    if m.rope_type == "yarn":
        # The attention multiplies cos and sin by the concentration factor these give (megatron-core
        # reads them off the config); the frequencies are set on the model (:func:`rope_inv_freq`).
        config.yarn_rotary_scaling_factor = m.rope_factor
        config.yarn_mscale, config.yarn_mscale_all_dim = _concentration_mscale(m, 0.0), 0.0
    return config


def _concentration_mscale(m: Architecture, mscale_all_dim: float) -> float:
    """The ``mscale`` for which megatron-core's concentration factor, mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), is the model's attention factor (transformers' value)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_mscale

    if m.rope_factor <= 1:
        return 1.0
    return (m.attention_factor * _yarn_get_mscale(m.rope_factor, mscale_all_dim) - 1.0) / (0.1 * math.log(m.rope_factor))


def rope_inv_freq(m: Architecture, dim: int) -> torch.Tensor:
    """The rotary frequencies of ``dim`` rotated dimensions, scaled as the model's config says
    (transformers' formulas: linear divides them by the factor; yarn blends the scaled and the
    original ones along megatron-core's ramp between beta_fast and beta_slow rotations)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_linear_ramp_mask,
    )

    periods = m.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if m.rope_type == "default":
        return 1.0 / periods
    if m.rope_type == "linear":
        return 1.0 / periods / m.rope_factor
    low, high = _yarn_find_correction_range(m.yarn_beta_fast, m.yarn_beta_slow, dim, m.rope_theta, m.yarn_original_max,
                                            m.yarn_truncate)
    extrapolate = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device=torch.device("cpu"))
    return 1.0 / (m.rope_factor * periods) * (1 - extrapolate) + 1.0 / periods * extrapolate


def _moe_options(m: Architecture, kw: dict[str, Any], routing_replay: bool) -> dict[str, Any]:
    """``kw`` with the MoE layers' options of ``m`` (none for a dense model)."""
    if m.is_moe:
        kw.update(
            num_moe_experts=m.experts, moe_router_topk=m.top_k, moe_ffn_hidden_size=m.ffn,
            # norm_topk_prob: softmax over the top-k logits (= the renormalised top-k of the full softmax)
            moe_router_pre_softmax=m.score == "softmax" and not m.norm_topk, moe_router_score_function=m.score,
            moe_router_enable_expert_bias=m.expert_bias, moe_router_topk_scaling_factor=m.scaling,
            moe_router_num_groups=m.route_groups or None, moe_router_group_topk=m.topk_groups or None,
            moe_shared_expert_intermediate_size=m.shared_ffn or None,
            moe_layer_freq=[0] * m.dense_layers + [1] * (m.num_layers - m.dense_layers),
            # allgather: every expert-parallel rank's micro-batch has the same shape (the backend pads
            # them to it); megatron-core's alltoall dispatcher needs CUDA streams
            moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_dtype="fp32",
            moe_enable_routing_replay=routing_replay,
        )
    return kw


def _sdpa_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        """megatron-core's local core attention computed by ``F.scaled_dot_product_attention``
        (one fused kernel: no [b, heads, s, s] scores kept for the backward as the local
        DotProductAttention's baddbmm + masked softmax + bmm do), with the same mask
        convention (True: masked), scale and grouped-query layout."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            # (multi-latent attention passes its key and value widths, which SDPA reads off the tensors)
            super().__init__(*args, **kwargs)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("SDPAttention takes neither packed_seq_params nor an attention bias")
            cp = _cp_group()
            if cp is not None:
                # Context parallelism: this rank's queries attend to every rank's keys and values
                # (gathered in the ranks' order; the mask's columns follow it); the backward sums
                # each key's and value's gradient over the ranks whose queries read it.
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=cp)
                value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=cp)
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            per = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if per > 1:
                k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
            sq, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # (MLA: heads x v_head_dim)

    return SDPAttention


class RMSNorm:
    """megatron-core's torch RMSNorm (what its local specs build without Apex: a plain
    ``torch.nn.RMSNorm``) without the refusal of sequence parallelism, which is only a
    bookkeeping guard there: the backend sums those weights' gradients over the
    tensor-parallel ranks itself (``_clip_gradients``)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)


def _own_norms(spec: Any) -> None:
    """Every torch norm in a layer spec (recursively) replaced by :class:`RMSNorm`."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub = getattr(spec, "submodules", None)
    if sub is None or not dataclasses.is_dataclass(sub):
        return
    for field in dataclasses.fields(sub):
        value = getattr(sub, field.name)
        if value is WrappedTorchNorm:
            setattr(sub, field.name, RMSNorm)
        elif hasattr(value, "submodules"):
            _own_norms(value)


def _stage_model_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class StageModel(GPTModel):
        """A ``GPTModel`` (or, under pipeline parallelism, one stage of it) whose tied head on
        the last stage does not all-reduce its initial weights with the first stage's
        embedding at construction: megatron-core moves them to CUDA for that, and the
        backend loads every stage's weights right after building anyway (the two copies'
        gradients are summed in ``MegatronBackend._clip_gradients``)."""

        def _is_in_embd_group(self) -> bool:
            return False

    return StageModel


def build(m: Architecture, device: torch.device, *, routing_replay: bool, recompute: bool = False) -> Any:
    """The ``GPTModel`` of ``m`` on ``device`` (uninitialised weights: load them with :func:`hf_to_mcore`);
    under pipeline parallelism this rank's stage of it (its layers; the embedding on the first
    stage, the final norm and the head on the last)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from skyrl_backends._mcore_pipeline import stage_layers

    config = transformer_config(m, routing_replay=routing_replay, recompute=recompute)
    _, count, first, last = stage_layers(m.num_layers)
    if m.dense_layers:  # dense and MoE layers: one spec per layer (moe_layer_freq), this stage's (cut by megatron-core)
        layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm").layer_specs
    else:  # (megatron-core builds every spec of an explicit list: this stage's only)
        layers = [get_gpt_layer_local_spec(
            num_experts=m.experts or None, moe_grouped_gemm=False, qk_layernorm=m.qk_norm or m.mla,
            multi_latent_attention=m.mla, normalization="RMSNorm",
        )] * count
    if len(layers) != count:
        raise RuntimeError(f"megatron: {len(layers)} layer specs for a pipeline stage of {count} layers")
    spec = TransformerBlockSubmodules(layer_specs=list(layers), layer_norm=RMSNorm)
    for layer in {id(x): x for x in layers}.values():  # (a spec object may serve several layers)
        _own_norms(layer)
        if m.mla:
            # The latents' down projections whole on every rank (megatron-core's Linear), as its
            # TransformerEngine specs have them ("duplicated"): each rank projects its slice of the
            # sequence, and the rotary key part is gathered along the sequence, which sums its
            # gradient over the ranks' heads. (Split by rows, as the local specs have them, that
            # gradient would keep one rank's heads only.)
            from megatron.core.post_training.modelopt.layers import Linear

            attn = layer.submodules.self_attention.submodules
            if m.q_lora:
                attn.linear_q_down_proj = Linear
            attn.linear_kv_down_proj = Linear
        layer.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    # RouterReplay keeps a process-wide list of its instances: this model's routers are its own.
    RouterReplay.clear_global_router_replay_instances()
    model = _stage_model_class()(
        config, spec, vocab_size=m.vocab, max_sequence_length=m.max_positions, pre_process=first, post_process=last,
        share_embeddings_and_output_weights=m.tied, position_embedding_type="rope", rotary_percent=m.rotary_percent,
        rotary_base=m.rope_theta, parallel_output=True,
    )
    RouterReplay.clear_global_router_replay_instances()
    if not m.mla and m.rope_type != "default":  # (MegatronLM rotates by these; MLA's rotary has its own)
        model.rotary_pos_emb.inv_freq = rope_inv_freq(m, model.rotary_pos_emb.inv_freq.numel() * 2)
    return model.to(device)


# -- weights: Hugging Face <-> megatron-core -----------------------------------------------


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _cp_group() -> Any:
    """megatron-core's context-parallel group when it has more than one rank, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def context_slots(R: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Under context parallelism (None without): ``(order, mine)`` for rows of ``R`` slots, a
    multiple of twice the context-parallel size c. The row is cut into 2c equal chunks and
    rank r holds chunks r and 2c - 1 - r (an early chunk with a late one, so the ranks'
    causal attention costs the same); ``mine`` are this rank's slots, ``order`` every
    rank's in rank order (what a gather over the ranks gives)."""
    from megatron.core import parallel_state

    if _cp_group() is None:
        return None
    c, r = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if R % (2 * c):
        raise ValueError(f"context parallelism: rows of {R} slots do not split into 2 x {c} equal chunks")
    n = R // (2 * c)
    order = torch.cat([torch.cat([torch.arange(i * n, (i + 1) * n), torch.arange((2 * c - 1 - i) * n, (2 * c - i) * n)])
                       for i in range(c)]).to(device)
    return order, order[r * 2 * n:(r + 1) * 2 * n]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _ep() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def _fuse_qkv(m: Architecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``linear_qkv`` rows: per query group, its query heads, then its key, then its value head."""
    per = m.heads // m.groups
    d, h = m.head_dim, q.shape[-1]
    q = q.reshape(m.groups, per * d, h)
    k = k.reshape(m.groups, d, h)
    v = v.reshape(m.groups, d, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def _split_qkv(m: Architecture, qkv: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = m.heads // m.groups
    d, h = m.head_dim, qkv.shape[-1]
    g = qkv.reshape(groups, (per + 2) * d, h)
    return (g[:, : per * d].reshape(-1, h), g[:, per * d: (per + 1) * d].reshape(-1, h), g[:, (per + 1) * d:].reshape(-1, h))


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank] if size > 1 else t


def hf_to_mcore(m: Architecture, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's megatron-core state dict (weights only) from a full Hugging Face state dict
    (under pipeline parallelism its stage's, the layers numbered from 0 within the stage)."""
    from skyrl_backends._mcore_pipeline import stage_layers

    tr, ts = _tp()
    er, es = _ep()
    start, count, first, last = stage_layers(m.num_layers)
    out: dict[str, torch.Tensor] = {}
    vocab_rows = hf["model.embed_tokens.weight"]
    if first:
        out["embedding.word_embeddings.weight"] = _shard(vocab_rows, 0, tr, ts)
    for i in range(start, start + count):
        a, o = f"model.layers.{i}.", f"decoder.layers.{i - start}."
        if m.mla:  # (the up projections column-parallel: split by heads; the down projections and norms whole)
            out.update({k: _shard(v, 0, tr, ts) if _mla_split(k) else v for k, v in _mla_to_mcore(m, hf, a, o).items()})
        else:
            # the fused QKV is split by query group across tensor-parallel ranks
            qkv = _fuse_qkv(m, hf[a + "self_attn.q_proj.weight"], hf[a + "self_attn.k_proj.weight"], hf[a + "self_attn.v_proj.weight"])
            out[o + "self_attention.linear_qkv.weight"] = _shard(qkv, 0, tr, ts)
        out[o + "self_attention.linear_proj.weight"] = _shard(hf[a + "self_attn.o_proj.weight"], 1, tr, ts)
        if m.qkv_bias:
            bias = _fuse_qkv(m, *(hf[a + f"self_attn.{x}_proj.bias"][:, None] for x in "qkv"))[:, 0]
            out[o + "self_attention.linear_qkv.bias"] = _shard(bias, 0, tr, ts)
        if m.qk_norm:
            out[o + "self_attention.q_layernorm.weight"] = hf[a + "self_attn.q_norm.weight"]
            out[o + "self_attention.k_layernorm.weight"] = hf[a + "self_attn.k_norm.weight"]
        out[o + "input_layernorm.weight"] = hf[a + "input_layernorm.weight"]
        out[o + "pre_mlp_layernorm.weight"] = hf[a + "post_attention_layernorm.weight"]
        if m.is_moe and i >= m.dense_layers:
            out[o + "mlp.router.weight"] = hf[a + "mlp.gate.weight"]
            if m.expert_bias:
                out[o + "mlp.router.expert_bias"] = hf[a + "mlp.gate.e_score_correction_bias"]
            if m.shared_ffn:
                sh = a + "mlp.shared_experts."
                fc1 = torch.cat([hf[sh + "gate_proj.weight"], hf[sh + "up_proj.weight"]], dim=0)
                out[o + "mlp.shared_experts.linear_fc1.weight"] = _shard_glu(fc1, tr, ts)
                out[o + "mlp.shared_experts.linear_fc2.weight"] = _shard(hf[sh + "down_proj.weight"], 1, tr, ts)
            gate_up, down = hf[a + "mlp.experts.gate_up_proj"], hf[a + "mlp.experts.down_proj"]
            local = m.experts // es
            for j in range(local):
                e = er * local + j
                out[o + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = _shard_glu(gate_up[e], tr, ts)
                out[o + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = _shard(down[e], 1, tr, ts)
        else:
            fc1 = torch.cat([hf[a + "mlp.gate_proj.weight"], hf[a + "mlp.up_proj.weight"]], dim=0)
            out[o + "mlp.linear_fc1.weight"] = _shard_glu(fc1, tr, ts)
            out[o + "mlp.linear_fc2.weight"] = _shard(hf[a + "mlp.down_proj.weight"], 1, tr, ts)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not m.tied:
            out["output_layer.weight"] = _shard(hf["lm_head.weight"], 0, tr, ts)
        elif not first:  # the last stage's copy of the tied embedding, for its head
            out["output_layer.weight"] = _shard(vocab_rows, 0, tr, ts)
    return out


def _rope_rows(m: Architecture, w: torch.Tensor, heads: int, to_mcore: bool) -> torch.Tensor:
    """``w`` (rows: per head its unrotated then its rotated dimensions) with each head's
    rotated rows in the layout megatron-core's MLA expects (``to_mcore``) or back.
    megatron-core's MLA takes the rotated dimensions as interleaved (even, odd) pairs and
    de-interleaves them before rotating halves, as DeepSeek-V3's checkpoints
    (``rope_interleave = true``) need: those rows stay as they are. A checkpoint whose
    rotated dimensions are already halves gets them interleaved, so the de-interleave
    gives its halves back."""
    if m.rope_interleave:
        return w
    r = m.rope_dim
    per = w.shape[0] // heads
    w = w.reshape(heads, per, *w.shape[1:])
    half = torch.arange(r // 2, device=w.device)
    order = torch.stack([half, half + r // 2], dim=1).reshape(-1)  # row 2i <- i, row 2i+1 <- r/2 + i
    if not to_mcore:
        order = torch.argsort(order)
    rot = w[:, per - r:].index_select(1, order)
    return torch.cat([w[:, : per - r], rot], dim=1).reshape(heads * per, *w.shape[2:])


def _mla_split(name: str) -> bool:
    """Whether tensor parallelism splits this multi-latent attention weight (by output rows)."""
    return name.endswith(("linear_q_up_proj.weight", "linear_kv_up_proj.weight", "linear_q_proj.weight"))


def _mla_to_mcore(m: Architecture, hf: Mapping[str, torch.Tensor], a: str, o: str) -> dict[str, torch.Tensor]:
    out = {}
    p = o + "self_attention."
    if m.q_lora:
        out[p + "linear_q_down_proj.weight"] = hf[a + "self_attn.q_a_proj.weight"]
        out[p + "q_layernorm.weight"] = hf[a + "self_attn.q_a_layernorm.weight"]
        out[p + "linear_q_up_proj.weight"] = _rope_rows(m, hf[a + "self_attn.q_b_proj.weight"], m.heads, True)
    else:
        out[p + "linear_q_proj.weight"] = _rope_rows(m, hf[a + "self_attn.q_proj.weight"], m.heads, True)
    out[p + "linear_kv_down_proj.weight"] = _rope_rows(m, hf[a + "self_attn.kv_a_proj_with_mqa.weight"], 1, True)
    out[p + "kv_layernorm.weight"] = hf[a + "self_attn.kv_a_layernorm.weight"]
    out[p + "linear_kv_up_proj.weight"] = hf[a + "self_attn.kv_b_proj.weight"]
    return out


def _mla_to_hf(m: Architecture, s0: Mapping[str, torch.Tensor], a: str, o: str) -> dict[str, torch.Tensor]:
    out = {}
    p = o + "self_attention."
    if m.q_lora:
        out[a + "self_attn.q_a_proj.weight"] = s0[p + "linear_q_down_proj.weight"]
        out[a + "self_attn.q_a_layernorm.weight"] = s0[p + "q_layernorm.weight"]
        out[a + "self_attn.q_b_proj.weight"] = _rope_rows(m, s0[p + "linear_q_up_proj.weight"], m.heads, False)
    else:
        out[a + "self_attn.q_proj.weight"] = _rope_rows(m, s0[p + "linear_q_proj.weight"], m.heads, False)
    out[a + "self_attn.kv_a_proj_with_mqa.weight"] = _rope_rows(m, s0[p + "linear_kv_down_proj.weight"], 1, False)
    out[a + "self_attn.kv_a_layernorm.weight"] = s0[p + "kv_layernorm.weight"]
    out[a + "self_attn.kv_b_proj.weight"] = s0[p + "linear_kv_up_proj.weight"]
    return out


def _shard_glu(fc1: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A [gate; up] weight's tensor-parallel shard: [gate shard; up shard]."""
    if size == 1:
        return fc1
    gate, up = fc1.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)


def _unshard_glu(shards: list[torch.Tensor]) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    parts = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([torch.cat([p[0] for p in parts], 0), torch.cat([p[1] for p in parts], 0)], 0)


def mcore_to_hf(m: Architecture, shards: list[Mapping[str, torch.Tensor]], experts: list[list[Mapping[str, torch.Tensor]]] | None = None) -> dict[str, torch.Tensor]:
    """The full Hugging Face state dict from megatron-core state dicts: ``shards[r]`` is
    tensor-parallel rank r's (one entry without tensor parallelism); ``experts[e][r]``, with
    expert parallelism, the state dict of expert-parallel rank e and tensor-parallel rank r
    (None: the experts are in ``shards``). Names and layouts are the live
    transformers model's (``model.state_dict()``), including the tied head's alias."""
    ts = len(shards)
    s0 = shards[0]

    def cat(name: str, dim: int) -> torch.Tensor:
        return shards[0][name] if ts == 1 else torch.cat([s[name] for s in shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)
    for i in range(m.num_layers):
        a, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        if m.mla:
            mla = {k: (cat(k, 0) if _mla_split(k) else v) for k, v in s0.items() if k.startswith(o + "self_attention.")}
            out.update(_mla_to_hf(m, mla, a, o))
        else:
            qs, ks, vs = zip(*[_split_qkv(m, s[o + "self_attention.linear_qkv.weight"], m.groups // ts) for s in shards])
            out[a + "self_attn.q_proj.weight"] = torch.cat(qs, 0)
            out[a + "self_attn.k_proj.weight"] = torch.cat(ks, 0)
            out[a + "self_attn.v_proj.weight"] = torch.cat(vs, 0)
        out[a + "self_attn.o_proj.weight"] = cat(o + "self_attention.linear_proj.weight", 1)
        if m.qkv_bias:
            bq, bk, bv = zip(*[_split_qkv(m, s[o + "self_attention.linear_qkv.bias"][:, None], m.groups // ts) for s in shards])
            for x, parts in zip("qkv", (bq, bk, bv)):
                out[a + f"self_attn.{x}_proj.bias"] = torch.cat(parts, 0)[:, 0]
        if m.qk_norm:
            out[a + "self_attn.q_norm.weight"] = s0[o + "self_attention.q_layernorm.weight"]
            out[a + "self_attn.k_norm.weight"] = s0[o + "self_attention.k_layernorm.weight"]
        if m.is_moe and i >= m.dense_layers:
            if m.expert_bias:
                out[a + "mlp.gate.e_score_correction_bias"] = s0[o + "mlp.router.expert_bias"]
            if m.shared_ffn:
                gate, up = _unshard_glu([s[o + "mlp.shared_experts.linear_fc1.weight"] for s in shards]).chunk(2, dim=0)
                out[a + "mlp.shared_experts.gate_proj.weight"] = gate
                out[a + "mlp.shared_experts.up_proj.weight"] = up
                out[a + "mlp.shared_experts.down_proj.weight"] = cat(o + "mlp.shared_experts.linear_fc2.weight", 1)
            groups = experts if experts is not None else [shards]
            fc1s, fc2s = [], []
            for ep_shards in groups:
                local = m.experts // len(groups)
                for j in range(local):
                    p = o + f"mlp.experts.local_experts.{j}."
                    fc1s.append(_unshard_glu([s[p + "linear_fc1.weight"] for s in ep_shards]))
                    fc2s.append(torch.cat([s[p + "linear_fc2.weight"] for s in ep_shards], 1))
            out[a + "mlp.experts.gate_up_proj"] = torch.stack(fc1s)
            out[a + "mlp.experts.down_proj"] = torch.stack(fc2s)
            out[a + "mlp.gate.weight"] = s0[o + "mlp.router.weight"]
        else:
            gate, up = _unshard_glu([s[o + "mlp.linear_fc1.weight"] for s in shards]).chunk(2, dim=0)
            out[a + "mlp.gate_proj.weight"] = gate
            out[a + "mlp.up_proj.weight"] = up
            out[a + "mlp.down_proj.weight"] = cat(o + "mlp.linear_fc2.weight", 1)
        out[a + "input_layernorm.weight"] = s0[o + "input_layernorm.weight"]
        out[a + "post_attention_layernorm.weight"] = s0[o + "pre_mlp_layernorm.weight"]
    out["model.norm.weight"] = s0["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if m.tied else cat("output_layer.weight", 0)
    return out


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's tensors (no ``_extra_state`` entries), detached."""
    return {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (every weight of the model, nothing else) into ``model``."""
    own = weights_of(model)
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"megatron weights: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k, v in state.items():
            if own[k].shape != v.shape:
                raise ValueError(f"megatron weight {k}: shape {tuple(v.shape)}, the model has {tuple(own[k].shape)}")
            (params[k] if k in params else own[k]).copy_(v.to(own[k].dtype))


# -- the forward the train step calls ---------------------------------------------------------


class OutputHead:
    """What a scoring replay strategy reads of the output head: its ``weight`` and ``bias``
    (none)."""

    bias = None

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


class ShardedHead(OutputHead):
    """The output head under tensor parallelism (a :class:`skyrl_host.interfaces.VocabShard`):
    this rank's vocabulary rows, where they start, and the reduction over the ranks."""

    def __init__(self, weight: torch.Tensor, rank: int, size: int):
        super().__init__(weight)
        self.vocab_start, self.vocab_size = rank * weight.shape[0], size * weight.shape[0]

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.all_reduce(tensor, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op],
                        group=parallel_state.get_tensor_model_parallel_group())


def segment_mask(pos: torch.Tensor) -> torch.Tensor:
    """bool [rows, 1, R, R], True where attention is masked: a new sequence starts wherever a
    position is not its predecessor's + 1 (as transformers reads packed position ids), and
    a slot sees only earlier slots of its own sequence."""
    rows, R = pos.shape
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    seg = torch.cumsum(start.long(), dim=1)
    same = seg[:, :, None] == seg[:, None, :]
    causal = torch.ones(R, R, dtype=torch.bool, device=pos.device).tril()
    return ~(same & causal)[:, None]


class MegatronLM(torch.nn.Module):
    """A ``GPTModel`` called as ``PackedLM`` is: ``forward(ids [rows, R], pos [rows, R], keep [K])``
    gives logits ``[K, V]`` (this rank's vocabulary shard under tensor parallelism), or a
    scorer's result from ``hidden=[K, H], head=OutputHead``.

    Under pipeline parallelism (``stage``, a :class:`skyrl_backends._mcore_pipeline.Stage`)
    a stage that is not the first takes its input hidden states from the previous stage,
    and a stage that is not the last returns its output hidden states ``[R, rows, H]``
    (the backend sends them on: ``MegatronBackend._logprobs``). Under context parallelism
    the rows' length must be a multiple of ``2 x context_parallel`` (the backend pads them)."""

    def __init__(self, gpt: torch.nn.Module, padding_idx: int | None = None, stage: Any = None):
        super().__init__()
        self.gpt = gpt
        self.stage = stage
        # The Hugging Face embedding's padding_idx: that row gets no gradient from its lookups
        # (nn.Embedding's rule, which megatron-core's embedding lacks; the row may still learn
        # through a tied head). Transformers initialises it to zeros, where RMSNorm's gradient is huge.
        self.padding_idx = padding_idx

    def head_weight(self) -> torch.Tensor:
        return self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights else self.gpt.output_layer.weight

    def get_output_embeddings(self) -> OutputHead:
        rank, size = _tp()
        return ShardedHead(self.head_weight(), rank, size) if size > 1 else OutputHead(self.head_weight())

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, scorer: Any = None,
                own_tokens: bool = False, **kwargs: Any) -> Any:
        if kwargs:
            raise ValueError(f"the megatron backend takes packed rows only, not {sorted(kwargs)}")
        gpt = self.gpt
        rank, size = _tp()
        stage = self.stage
        # Context parallelism: this rank computes its own slots of every row (``context_slots``)
        # through the decoder, its queries attending to every rank's keys (SDPAttention gathers
        # them; the mask's rows are this rank's slots, its columns every rank's in gather order).
        # With ``own_tokens`` the head computes the logits of this rank's loss tokens only (the
        # backend sums the ranks' logprobs into every rank's); else (a scorer, which takes the
        # whole view) the hidden states are gathered for the head, which every rank then applies
        # to every slot and whose gradient it scales by 1 / ranks. Each rank's weight gradients
        # are its own slots' share, summed over the ranks by the backend (_clip_gradients).
        split = context_slots(ids.shape[1], ids.device)
        if split is not None:
            order, mine = split
            mask = segment_mask(pos)[:, :, mine][:, :, :, order]
            ids, pos = ids[:, mine], pos[:, mine]
        else:
            mask = segment_mask(pos)
        if stage is not None and not stage.first:
            rows, R = ids.shape
            emb = stage.receive_hidden((R // size, rows, gpt.config.hidden_size), ids.device)
            gpt.decoder.set_input_tensor(emb)  # (a TransformerBlock without pre_process reads its input here)
        else:
            emb = gpt.embedding(input_ids=ids, position_ids=pos)  # [R, rows, H] (sequence parallel: R / size of them)
        if self.padding_idx is not None and emb.requires_grad and (stage is None or stage.first):
            pad = (ids == self.padding_idx).t()
            if size > 1:
                pad = pad.chunk(size, dim=0)[rank]
            emb = torch.where(pad[..., None], emb.detach(), emb)
        if getattr(gpt.config, "multi_latent_attention", False):
            # megatron-core's MLA rotates by 0..R-1 itself: the backend gives it one sequence per row
            rot = None
        else:
            # Rotary angles at each slot's own position (positions restart for every packed sequence).
            # (megatron-core's RotaryEmbedding gives angles of 0..S-1 only.)
            inv_freq = gpt.rotary_pos_emb.inv_freq.to(emb.device)
            angles = pos.t().to(inv_freq.dtype)[..., None] * inv_freq  # [R, rows, d/2]
            rot = torch.cat([angles, angles], dim=-1).unsqueeze(2)  # [R, rows, 1, d]: rotate-half layout
        try:
            hidden = gpt.decoder(hidden_states=emb, attention_mask=mask, rotary_pos_emb=rot)
        finally:
            gpt.decoder.set_input_tensor(None)
        if stage is not None and not stage.last:
            return hidden
        if size > 1:
            # The whole sequence for the head, whose rows are this rank's vocabulary shard: the
            # backward reduce-scatters the ranks' partial input gradients (as megatron-core's
            # sequence-parallel output layer does).
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        if split is not None and own_tokens:
            # ``own_tokens``: the logits of the loss tokens in this rank's slots only, and which of
            # ``keep`` they are (bool [K]); the backend combines the ranks' logprobs
            R, mine = len(split[0]), split[1]
            at = torch.full((R,), -1, dtype=torch.long, device=keep.device)
            at[mine] = torch.arange(len(mine), device=keep.device)
            local = at[keep % R]
            owned = local >= 0
            hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[(keep // R)[owned] * len(mine) + local[owned]]
            return F.linear(hidden, self.get_output_embeddings().weight), owned
        if split is not None:
            # every rank's slots (the backward hands each rank its own slots' gradient: all ranks
            # compute the same loss), back in row order
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=_cp_group())
            hidden = hidden.index_select(0, torch.argsort(split[0]))
        hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[keep]
        head = self.get_output_embeddings()
        if split is not None and torch.is_grad_enabled():
            head.weight = _ScaleGrad.apply(head.weight, 1.0 / _cp_group().size())
        if scorer is not None:
            return scorer(hidden=hidden, head=head)
        return F.linear(hidden, head.weight)

"""One rank of the megatron backend's model-parallel tests (test_megatron.py runs
:func:`train` in 2 gloo processes through ``skyrl_host.testing.run_gloo_ranks``).

``train(rank, world, mode)`` trains a tiny model 3 steps with ``[backend]
tensor_parallel = 2`` (mode "tp": dense Qwen3, every rank the whole batch) or
``expert_parallel = 2`` (mode "ep": Qwen3-MoE, each rank its half of every batch) and
returns the metrics, the logprobs before each step and the full weights by their Hugging
Face names; "tp:fp8" and the like add a precision (and train with lr 1e-9: see train); "pp"
and its variants run ``pipeline_parallel`` stages. :func:`train` with world 1 is the same
training in one process. :func:`pipeline` runs several modes in one launch of the ranks
(starting the processes is most of a test's time).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _tiny as tiny  # noqa: E402

from skyrl_host.interfaces import LoadedModel  # noqa: E402

OPTIONS = dict(lr=1e-3, micro_batch_tokens=32, pack_length=12, max_grad_norm=0.5, weight_decay=0.1)


def preset(name: str):
    """The qwen family's preset ``name`` (random weights, seed 0), as a job loads it."""
    from skyrl_host.plugins import build_host

    reg = build_host().registry.get("models", "qwen")
    return reg.create(reg.config(preset=name)).load(alphabet="0123456789:", seed=0).model


def model(mode: str):
    if mode == "tp":
        return tiny.tiny_model(0)
    if mode.startswith(("pp", "cp")) and mode != "pp-mla":  # the qwen presets "tiny" (tied embedding and head) and "tiny-moe"
        return preset("tiny-moe" if mode in ("pp-moe", "pp-ep", "cp-moe") else "tiny")
    if mode in ("tp-mla", "pp-mla"):  # DeepSeek-V3 / Kimi K2: multi-latent attention, a dense layer, then MoE layers
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(
            hidden_size=32, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, first_k_dense_replace=1, vocab_size=32, max_position_embeddings=64,
        )
        torch.manual_seed(0)
        return DeepseekV3ForCausalLM(cfg)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, vocab_size=32,
                         tie_word_embeddings=False, norm_topk_prob=True)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg)


def sizes(mode: str, world: int, replicas: bool = False) -> dict:
    """[backend] parallel sizes of ``mode`` over ``world`` ranks (``replicas``: two data-parallel
    replicas, each over world / 2 ranks); "tp-ep": tensor_parallel = 2, expert_parallel = world / 2."""
    if mode == "tp-ep":
        return {"tensor_parallel": 2, "expert_parallel": world // 2} if world > 1 else {}
    if mode == "cp-tp":  # 4 ranks: two context-parallel ranks, each over a tensor-parallel pair
        return {"tensor_parallel": 2, "context_parallel": world // 2} if world > 1 else {}
    if mode in ("pp-tp", "pp-ep"):  # 4 ranks: two pipeline stages, each over a tensor- or expert-parallel pair
        key = "tensor_parallel" if mode == "pp-tp" else "expert_parallel"
        return {key: 2, "pipeline_parallel": world // 2} if world > 1 else {}
    key = {"tp": "tensor_parallel", "tp-mla": "tensor_parallel", "ep": "expert_parallel", "pp": "pipeline_parallel",
           "pp-moe": "pipeline_parallel", "pp-mla": "pipeline_parallel", "cp": "context_parallel",
           "cp-moe": "context_parallel"}[mode]
    return {key: world // 2 if replicas and world > 1 else world}


def logprobs(be, batch) -> np.ndarray:
    out = np.zeros(batch.n_tokens, dtype=np.float32)
    with torch.no_grad():
        for micros in be._plan(batch, np.zeros(batch.n_tokens, dtype=np.float32)):
            for mb in micros:
                if mb.n_loss:
                    out[mb.batch_idx] = be._logprobs(be._lm, mb, 1.0)[0].cpu().numpy()
    return out


def kept_sets(batch, seed: int, size: int = 9, vocab: int = 32):
    """A sampler's kept sets for every generated token: ``size`` ids of the ``vocab``, its own among them."""
    from skyrl_host.rollout import CSR

    rng = np.random.default_rng(seed)
    targets = np.asarray(batch.tokens)[np.asarray(batch.loss_mask) != 0]
    return CSR.from_rows([np.union1d([t], rng.choice(vocab, size - 1, replace=False)) for t in targets])


def random_routes(batch, be, seed: int):
    """Random expert choices for every token and MoE layer (each token's top-k distinct):
    routes the routers would not choose, so replaying them changes every MoE layer's output."""
    rng = np.random.default_rng(100 + seed)
    arch = be.arch
    moe_layers = arch.num_layers - arch.dense_layers
    return np.stack([[rng.permutation(arch.experts)[:arch.top_k] for _ in range(moe_layers)]
                     for _ in range(batch.n_tokens)]).astype(np.int32)


def train(rank: int, world: int, mode: str) -> dict:
    """``mode``: "tp", "tp-mla" (DeepSeek-V3's attention), "ep" or "tp-ep" (both, 4 ranks), "pp"
    (the qwen preset "tiny"), "pp-moe" ("tiny-moe"), "cp" / "cp-moe" (``context_parallel``: "tiny" /
    "tiny-moe"), "cp-tp" (two context-parallel ranks over tensor-parallel pairs, "tiny"), "pp-tp" / "pp-ep" (two stages of two
    tensor- / expert-parallel ranks), "pp-mla" (the DeepSeek-V3 model in two stages), with
    "+support" (the support strategy over random kept sets), "+r3" (random routes replayed),
    "+dp" (two data-parallel replicas, each over world / 2 ranks), "+old" (two mini-batches
    and a reference policy: the no-grad passes of old and reference logprobs), "+gc"
    (activation recompute) and / or ":PRECISION" (a precision by its name), e.g. "tp+support:fp8"."""
    from skyrl_backends.megatron import MegatronBackendConfig, create

    mode, _, precision = mode.partition(":")
    mode, *flags = mode.split("+")
    support, r3, replicas, old, gc = ("support" in flags, "r3" in flags, "dp" in flags, "old" in flags,
                                      "gc" in flags)
    from skyrl_host.plugins import build_host

    host = build_host()
    if precision:
        reg = host.registry.get("precisions", precision)
        precision = reg.create(reg.config())
    replay = []
    if support:
        reg = host.registry.get("replay_strategies", "support")
        replay = [reg.create(reg.config(chunk=20))]  # (chunks smaller than a batch's pairs)
    if r3:
        replay = [host.registry.get("replay_strategies", "r3").create(None)]
    # With a precision the weights stay put (lr 1e-9): the layouts' float32 round-off now and then
    # moves an activation across an e4m3 rounding boundary, Adam turns that into weight gaps and
    # the weights' own quantization magnifies them, step after step; with fixed weights every
    # step compares the two layouts' quantized forward and backward afresh.
    options = dict(OPTIONS, lr=1e-9) if precision else dict(OPTIONS)
    if old:
        options["mini_batches"] = 2
    be = create(MegatronBackendConfig(**options, **sizes(mode, world, replicas), gradient_checkpointing=gc))
    be.start(LoadedModel(model=model(mode), tokenizer=None, stop_token_ids=[1], family="test"), seed=0,
             total_steps=3, reference=old, precision=precision or None, replay=replay)
    algo = tiny.TokenMean(needs_reference=old)
    metrics, lps = [], []
    # (every forward's row length R and the slots the decoder computes: R / (context_parallel x tensor_parallel))
    slots: list = []
    be._lm.register_forward_pre_hook(lambda m, args: slots.append([int(args[0].shape[1])]))
    be.module.decoder.register_forward_pre_hook(lambda m, args, kw: slots[-1].append(int(kw["hidden_states"].shape[0])),
                                                with_kwargs=True)
    # (context parallelism: each forward's loss tokens, those in this rank's slots, and the head's logits rows)
    heads: list = []
    be._lm.register_forward_hook(lambda m, args, out: heads.append(
        (int(out[1].numel()), int(out[1].sum()), int(out[0].shape[0])) if isinstance(out, tuple) else None))
    vocab = min(32, int(be.arch.vocab))
    for step in range(3):
        batch = tiny.tiny_batch(10 + step, n=8, vocab=vocab)
        if support:
            batch.side_channels["sample_support"] = kept_sets(batch, seed=step, vocab=vocab)
        if r3:
            batch.side_channels["routed_experts"] = random_routes(batch, be, seed=step)
        adv = tiny.tiny_advantages(batch, seed=step)
        if mode.startswith(("tp", "pp", "cp")) or world == 1:  # (the whole batch; under ep each rank forwards its own share)
            lps.append(logprobs(be, batch))
        metrics.append(be.train_step(*share(be, batch, adv), algo, temperature=1.0, max_new_tokens=8))
        if precision:
            for _ in be.named_weights():  # a weight sync after the step (every rank takes part in the gather)
                pass
    weights = {k: v.detach().cpu().clone() for k, v in be.named_weights()}
    return {"metrics": metrics, "logprobs": lps, "weights": weights if rank == 0 else None, "layout": be._layout(),
            "data_parallel": be.data_parallel(), "gathers": be._gathers, "slots": slots, "heads": heads,
            "own": sorted(k for k in be.module.state_dict() if not k.endswith("_extra_state"))}


def share(be, batch, adv):
    """This rank's share of ``batch`` and its advantages, as the Ray launcher hands it out:
    every ``data_parallel()`` index (a model replica, an expert-parallel rank) its own
    sequences, the tensor-parallel ranks of one replica the same ones."""
    index, size = be.data_parallel()
    if size == 1:
        return batch, adv
    seqs = list(range(index, batch.n_sequences, size))
    idx = np.concatenate([np.arange(batch.cu_seqlens[s], batch.cu_seqlens[s + 1]) for s in seqs])
    return batch.select(seqs), adv[idx]


def _step(be, mode: str, rank: int, world: int, step: int) -> dict:
    batch = tiny.tiny_batch(10 + step, n=8, vocab=min(32, int(be.arch.vocab)))
    adv = tiny.tiny_advantages(batch, seed=step)
    return be.train_step(*share(be, batch, adv), tiny.TokenMean(), temperature=1.0, max_new_tokens=8)


def resharded(rank: int, world: int, mode: str, folder: str, action: str) -> dict:
    """``action`` "save": train 2 steps, write a distributed checkpoint into ``folder``
    (``save_checkpoint``), then train steps 3 and 4; "load": a fresh backend reads the
    checkpoint (``load_checkpoint``, under this run's layout) and trains steps 3 and 4.
    Returns the two steps' metrics and (rank 0) the full weights after them."""
    from skyrl_backends.megatron import MegatronBackendConfig, create

    be = create(MegatronBackendConfig(**OPTIONS, **sizes(mode, world)))
    be.start(LoadedModel(model=model(mode), tokenizer=None, stop_token_ids=[1], family="test"), seed=0, total_steps=4,
             reference=False, precision=None, replay=[])
    if action == "save":
        for step in range(2):
            _step(be, mode, rank, world, step)
        be.save_checkpoint(folder)
        import multiprocessing

        left = [p.name for p in multiprocessing.active_children()]  # (the writer's processes are done)
        assert not left, left
    else:
        be.load_checkpoint(folder)
    metrics = [_step(be, mode, rank, world, step) for step in (2, 3)]
    weights = {k: v.detach().cpu().clone() for k, v in be.named_weights()}
    return {"metrics": metrics, "weights": weights if rank == 0 else None, "steps": be.steps}


def pipeline(rank: int, world: int, *modes: str) -> list[dict]:
    """:func:`train` of each of ``modes``, one after the other in this process."""
    return [train(rank, world, mode) for mode in modes]


def bf16_logprobs(rank: int, world: int) -> np.ndarray:
    """"tiny"'s logprobs of a batch under bfloat16 autocast, with pipeline_parallel = world."""
    from skyrl_backends.megatron import MegatronBackendConfig, create

    be = create(MegatronBackendConfig(**OPTIONS, compute_dtype="bfloat16", pipeline_parallel=world))
    be.start(LoadedModel(model=model("pp"), tokenizer=None, stop_token_ids=[1], family="test"), seed=0,
             total_steps=1, reference=False)
    return logprobs(be, tiny.tiny_batch(3, n=8, vocab=int(be.arch.vocab)))


def pipeline_and_checkpoints(rank: int, world: int, written: str, read: str, *modes: str) -> dict:
    """:func:`pipeline` of ``modes`` and :func:`bf16_logprobs`; then (mode "pp")
    :func:`resharded` "save" into the folder ``written`` and "load" from ``read`` (a
    checkpoint another layout wrote)."""
    trained = pipeline(rank, world, *modes)
    bf16 = bf16_logprobs(rank, world)
    saved = resharded(rank, world, "pp", written, "save")
    return {"modes": trained, "bf16": bf16, "saved": saved, "loaded": resharded(rank, world, "pp", read, "load")}

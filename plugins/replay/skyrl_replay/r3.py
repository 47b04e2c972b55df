"""r3: rollout routing replay. In the trainer's forward, every MoE router uses the
experts the engine chose for each token (side channel ``routed_experts``, filled by
an engine with ``return_routed_experts = true``); the routing weights come from the
trainer's own router logits at those experts, so the router keeps learning.

``[replay] strategies = ["r3"]``. Works with sequence packing, micro-batches and
gradient checkpointing (the replay stays active through the backward, where
checkpointed layers run their forward again). The last token of each sequence is
never fed to the engine, so it has no engine route: the trainer's own routing is
used there (that token's output feeds no logprob). Padding slots route freely too.

On a model whose attention runs a sparse-attention key indexer (GLM-5 ``glm_moe_dsa``,
DeepSeek-V3.2 ``deepseek_v32``), r3 also replays the keys each token attended to: the
engine records the indexer's picks (side channel ``indexer_topk``, positions in the
token's sequence; the embedded engine does so whenever it returns routed experts) and
every indexer of the trainer is forced to them (layers that reuse the previous
layer's choice reuse the forced one). The indexer scores keys with a ReLU, so exact
ties are common, and ``topk`` breaks them differently with a KV cache than in a full
forward: without this, engine and trainer attend to different keys.

This module is light (no torch): the factory imports :mod:`skyrl_replay._impl`.
"""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl

SIDE_CHANNEL = "routed_experts"
ENGINE_KEY = "engine.return_routed_experts"


def create(config: Any = None) -> Any:
    from skyrl_replay._impl import RoutingReplay

    return RoutingReplay()


def check(spec: Any) -> list[tuple[str, str]]:
    """Job-level checks (``skyrl validate``): the engine must record routes and the
    model must have MoE layers. Returns (key, message) problems."""
    from skyrl_replay._checks import check_indexer_capture, check_model_is_moe, check_trait

    problems = check_trait(spec, "engine", "routed_experts", "r3", "routed experts")
    problems += check_model_is_moe(spec)
    if not problems:
        problems += check_indexer_capture(spec)
    return problems


@hookimpl
def skyrl_register_replay_strategies(register: Any) -> None:
    register(
        "r3",
        create,
        description="Rollout routing replay: MoE routers in the trainer use the experts the engine chose",
        check=check,
    )

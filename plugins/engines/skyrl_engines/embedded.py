"""embedded: batched KV-cached generation with torch/transformers, in the job's process.

The CPU default engine. It serves the model family's transformers model: it
shares the model's parameters (same tensors) when the dtype matches, so in a
one-process job the trainer's updates reach it with nothing copied, and keeps a
converted copy otherwise. Generation prefills every distinct prompt once
(left-padded, with an attention mask and position ids), replicates the KV cache
for the ``n`` samples, then decodes all live sequences together, one token per
step, dropping finished ones from the batch.

This module only registers the engine: torch and transformers are imported by
the factory (see :mod:`skyrl_engines._embedded`), so ``skyrl plugins`` stays fast.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_toolkit.devices import check_device, cuda_problem
from skyrl_host.interfaces import EngineTraits
from skyrl_host.options import ge, gt, option


def _check_stop_strings(_inst: Any, _attr: Any, value: Any) -> None:
    for v in value:
        if not isinstance(v, str) or not v:
            raise ValueError(f"expected a list of non-empty strings, found {v!r}")


def _check_stop_token_ids(_inst: Any, _attr: Any, value: Any) -> None:
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"expected a list of token ids (integers >= 0), found {v!r}")


@attrs.frozen
class EmbeddedConfig:
    """Options of ``[engine]`` when ``name = "embedded"``."""

    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        help="dtype the engine computes in; 'auto' = the model's own (then its parameters are shared, not copied)",
    )
    share_weights: bool = option(
        True,
        help="serve the trainer's own parameter tensors where dtype and device match (nothing copied at a sync); "
        "false: keep a copy of its own, which async RL ([job] mode = \"async\") needs since training changes the "
        "trainer's tensors while the engine generates",
    )
    device: str = option(
        "auto",
        help="where the engine builds its model and generates: 'auto' (CUDA when present, else the model's own "
        "device), 'cpu', 'cuda' or 'cuda:N'",
        validator=check_device,
    )
    max_batch_size: int = option(256, help="most sequences decoded together in one batch", validator=gt(0))
    return_token_versions: bool = option(
        False,
        help="side channel 'token_versions': the weight version of the forward that produced each token; with "
        "in-flight weight updates ([job] weight_updates = \"in_flight\") a generation's tokens can span versions",
    )
    turn_cache_mb: int = option(
        1024,
        help="multi-turn: MiB of conversations' KV kept between turns, so a turn (continue_turn) prefills only its "
        "new tokens, not the whole history (least recently kept dropped first; cleared at every weight update; "
        "0 = off; unused on models with sliding-window or linear-attention layers and with return_routed_experts)",
        validator=ge(0),
    )
    return_routed_experts: bool = option(
        False,
        help="record the experts every MoE router chose for every token (side channel 'routed_experts' "
        "[tokens, MoE layers, top_k], for routing replay in the trainer); on a model with a sparse-attention "
        "indexer (GLM-5, DeepSeek-V3.2) also the keys it picked (side channel 'indexer_topk' "
        "[tokens, indexer layers, index_topk])",
    )
    threads: int | None = option(
        None, help="torch CPU threads to use (torch.set_num_threads); unset = leave as is", validator=gt(0)
    )
    stop_token_ids: tuple[int, ...] = option(
        factory=tuple,
        help="token ids that end a response, besides the model's own stop tokens (EOS, end of turn); "
        "the stop token stays in the response",
        validator=_check_stop_token_ids,
    )
    stop_strings: tuple[str, ...] = option(
        factory=tuple,
        help="texts that end a response: a response is cut after the token that completes the first of them "
        "(it stays in the response) and that sequence stops decoding; tokens and logprobs are cut alike",
        validator=_check_stop_strings,
    )


def Embedded(config: EmbeddedConfig | None = None) -> Any:
    """The factory: an :class:`skyrl_engines._embedded.EmbeddedEngine`."""
    from skyrl_engines._embedded import EmbeddedEngine

    return EmbeddedEngine(config if config is not None else EmbeddedConfig())


def traits(config: EmbeddedConfig) -> EngineTraits:
    """What other plugins may know of it. With ``return_routed_experts`` on a model with
    a sparse-attention indexer (GLM-5, DeepSeek-V3.2) it also records the indexer's key
    picks (side channel 'indexer_topk') that r3 replays."""
    return EngineTraits(
        dtype=config.dtype, device=config.device, token_versions=config.return_token_versions,
        routed_experts=config.return_routed_experts, indexer_topk=True,
        switches={"token_versions": "return_token_versions", "routed_experts": "return_routed_experts"},
    )


def check(spec: Any) -> list[tuple[str, str]]:
    """Job-level check (``skyrl validate``): a CUDA device needs CUDA here (in the
    driver's process: with ``launcher = "ray"`` the engine actor checks it on its own
    node); routing capture needs a model with MoE layers."""
    engine, model = spec.plugins.get("engine"), spec.plugins.get("model")
    if engine is None:
        return []
    if spec.cluster.launcher != "ray":
        problem = cuda_problem(engine.config.device)
        if problem is not None:
            return [("engine.device", problem)]
    if model is None or not engine.config.return_routed_experts:
        return []
    if model.traits.is_moe is False:
        return [(
            "engine.return_routed_experts",
            f"model {model.traits.name!r} ({model.name}) has no MoE layers, so there are no routes to return; "
            "set it to false or choose a mixture-of-experts model",
        )]
    return []


@hookimpl
def skyrl_register_engines(register: Any) -> None:
    register(
        "embedded",
        Embedded,
        config=EmbeddedConfig,
        check=check,
        description="Batched KV-cached torch/transformers generation in the job's process (shares the model's weights)",
        traits=traits,
    )

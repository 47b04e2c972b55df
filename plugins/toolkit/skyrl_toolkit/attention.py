"""Routing some of transformers' ``"sdpa"`` attention calls to a function of our own,
through its ``AttentionInterface`` mapping (``ALL_ATTENTION_FUNCTIONS``, transformers'
documented way to swap an attention function).

Several plugins do this in one process (the trainer's flat rows, the engine's decode
steps): each wrapper takes the calls it recognises and hands every other call to the
function that was there before it, so they stack in any order. Each is installed once
per name, however often its plugin starts."""

from __future__ import annotations

from typing import Any, Callable

_ROUTES = "_skyrl_attention_routes"


def route_sdpa(name: str, takes: Callable[..., bool], handler: Callable[..., Any]) -> bool:
    """Wrap transformers' ``"sdpa"`` entry: a call for which ``takes(module, query, key,
    value, attention_mask, **kwargs)`` is true goes to ``handler`` (same arguments, returns
    what an attention function returns); every other call to the previous entry. Returns
    False, and changes nothing, when a route of this ``name`` is installed already."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
    routes = getattr(previous, _ROUTES, frozenset())
    if name in routes:
        return False

    def sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        if takes(module, query, key, value, attention_mask, **kwargs):
            return handler(module, query, key, value, attention_mask, **kwargs)
        return previous(module, query, key, value, attention_mask, **kwargs)

    setattr(sdpa, _ROUTES, routes | {name})
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return True

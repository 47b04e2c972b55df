"""Attention of one new token over the KV cache, on a CPU, as two small matmuls.

transformers' ``"sdpa"`` attention hands a decode step (one query token per row) to
``torch.nn.functional.scaled_dot_product_attention``, whose CPU kernel is a flash
kernel tiled for long queries: for 64 rows x 9 heads x 1 query over ~100 cached keys
it took 1.8-3.8 ms per layer in bf16 (0.3-0.5 ms in float32), about a third of the
embedded engine's generation time on SmolLM2-135M. The same attention as
``softmax(q k^T * scale + mask) v``, computed in float32 with the query heads grouped
by their key/value head (no repeated keys), took 0.3-0.6 ms.

:func:`install_decode_attention` routes transformers' ``"sdpa"`` entry through
:func:`decode_attention` for calls on a CPU with one query token; every other call
(prefill, GPU, training) goes to the function that was there before, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

def decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None) -> torch.Tensor:
    """One query token per row: ``query [B, Hq, 1, D]``, ``key``/``value`` ``[B, Hkv, L, D]``,
    ``attention_mask`` None, a boolean (True: attend) or an additive float mask
    broadcastable to ``[B, Hq, 1, L']`` with ``L' >= L``. Returns ``[B, 1, Hq, Dv]`` in the
    query's dtype, as transformers' attention functions do; computed in float32."""
    b, hq, _, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scaling is None else float(scaling)
    q = query.reshape(b, hkv, group, d).float()  # query head h = kv head h // group (repeat_kv's order)
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, group, L]
    if attention_mask is not None:
        mask = attention_mask[..., :length]
        mask = mask.reshape(mask.shape[0], hkv, group, length) if mask.shape[1] == hq and hq > 1 else mask
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())  # [B, Hkv, group, Dv]
    return out.reshape(b, 1, hq, value.shape[-1]).to(query.dtype)


KEEP_KERNEL = "_skyrl_keep_decode_kernel"
"""A module attribute: True on the attention modules of a model whose decode steps keep
the SDPA kernel (:func:`keep_kernel`)."""


def keep_kernel(model: Any) -> None:
    """Leave ``model``'s decode steps on the SDPA kernel. For an engine whose precision
    plugin quantizes activations: the trainer computes attention with that kernel, and a
    last-bit difference in the attention output can move an FP8 activation by a whole
    quantization step (a 1e-3 logprob gap instead of 5e-7 on the rowwise-FP8 test)."""
    for module in model.modules():
        setattr(module, KEEP_KERNEL, True)


def _takes(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> bool:
    return (
        query.device.type == "cpu"
        and not getattr(module, KEEP_KERNEL, False)
        and query.shape[2] == 1
        and query.shape[1] % key.shape[1] == 0
        and not kwargs.get("dropout")
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions")
        and (attention_mask is None or isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4)
    )


def _handler(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    return decode_attention(module, query, key, value, attention_mask, kwargs.get("scaling")), None


def install_decode_attention() -> None:
    """Route transformers' ``"sdpa"`` attention through :func:`decode_attention` for CPU
    calls with one query token (and no dropout, softcap, position bias or attention
    weights asked for); every other call goes on unchanged
    (:func:`skyrl_toolkit.attention.route_sdpa`). Idempotent."""
    from skyrl_toolkit.attention import route_sdpa

    route_sdpa("decode", _takes, _handler)

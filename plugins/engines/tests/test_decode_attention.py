"""The engine's CPU decode attention: the same numbers as SDPA for every mask form
transformers hands over, and only one-token CPU calls are routed to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyrl_engines._decode_attention import decode_attention, install_decode_attention, keep_kernel


def reference(query, key, value, mask, scaling=None):
    """float64 SDPA with the key/value heads repeated, transformers' output layout."""
    group = query.shape[1] // key.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (key, value))
    m = None if mask is None else mask[..., : key.shape[2]]
    m = m if m is None or m.dtype == torch.bool else m.double()
    out = F.scaled_dot_product_attention(query.double(), k, v, attn_mask=m, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool-per-head", "float", "longer-bool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa(heads, mask_kind, dtype) -> None:
    hq, hkv = heads
    g = torch.Generator().manual_seed(0)
    b, length, d = 5, 37, 16
    q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    pad = torch.arange(length)[None, :] >= torch.tensor([0, 3, 10, 0, 36])[:, None]  # left padding per row
    mask = {
        "none": None,
        "bool": pad[:, None, None, :],
        "bool-per-head": pad[:, None, None, :].expand(b, hq, 1, length).clone(),
        "float": torch.where(pad, 0.0, torch.finfo(torch.float32).min)[:, None, None, :].to(dtype),
        "longer-bool": torch.cat([pad, torch.zeros(b, 4, dtype=torch.bool)], 1)[:, None, None, :],  # L' > L
    }[mask_kind]
    got = decode_attention(None, q, k, v, mask, scaling=0.3)
    want = reference(q, k, v, mask, scaling=0.3)
    assert got.shape == (b, 1, hq, d) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    assert (got.double() - want).abs().max().item() <= tol


def test_only_cpu_one_token_calls_are_routed() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    install_decode_attention()
    install_decode_attention()  # idempotent: one route, however often an engine starts
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert "decode" in sdpa._skyrl_attention_routes

    class Module(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    g = torch.Generator().manual_seed(1)
    module = Module()
    k = torch.randn(2, 3, 11, 8, generator=g)
    v = torch.randn(2, 3, 11, 8, generator=g)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        one = torch.randn(2, 9, 1, 8, generator=g)
        out, _ = sdpa(module, one, k, v, None, scaling=None, dropout=0.0)
        assert calls == []  # the decode step never reached the flash kernel
        prefill = torch.randn(2, 9, 11, 8, generator=g)
        sdpa(module, prefill, k, v, None, scaling=None, dropout=0.0)
        assert len(calls) == 1  # a prefill goes to transformers' own function
        keep_kernel(module)  # an engine whose precision quantizes activations keeps the kernel
        sdpa(module, one, k, v, None, scaling=None, dropout=0.0)
        assert len(calls) == 2
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    assert (out.double() - reference(one, k, v, None)).abs().max().item() <= 1e-6

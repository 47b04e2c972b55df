"""The quantized formats (imports torch; torchao for MXFP8 and the int4 primitives).

Each format turns a high-precision tensor into what goes on the wire and to disk
(``qdata`` + ``scale``) and back (``dequantize``), and gives the fake-quantized value
(quantize then dequantize, in the input's dtype) the trainer computes with. Blocks
follow the last two dimensions (``[..., out, in]`` like ``nn.Linear.weight`` and the
stacked experts ``[experts, out, in]``); leading dimensions are independent matrices.

- ``fp8``: e4m3 values; weights in 128x128 blocks with one float32 scale each
  (``amax / 448``), activations in 1x128 tiles along the last dimension. A ragged edge
  block is quantized as if zero-padded. Equal bit for bit to torchao's
  ``Float8Tensor.from_hp(..., granularity=PerBlock(...))`` where torchao accepts the
  shape (every dimension a multiple of the block).
- ``fp8_rowwise``: e4m3 values with one float32 scale per row (the last dimension is
  the row: a weight's output row over its input dimension, an activation's token over
  its features), the numerics of torchao's rowwise float8 training recipe
  (``Float8LinearConfig.from_recipe_name("rowwise")``): ``amax`` clamped below at 1e-12,
  ``448 / amax`` computed in float64, rounded to float32 and then down to a power of two,
  values saturated to +-448. The wire carries the reciprocal (the value to multiply the
  payload by, as for ``fp8``); it is a power of two, so it is exact.
- ``mxfp8``: e4m3 values in 32-element blocks along the last dimension with an e8m0
  (power-of-two) scale each: torchao's ``MXTensor.to_mx`` (weights and activations).
- ``int4``: group-wise symmetric int4 in groups of 32 along the last dimension, one
  float32 scale per group (``amax / 7.5`` as torchao's symmetric mapping chooses, values
  clamped to [-8, 7]); two values per byte on the wire. torchao's
  ``choose_qparams_affine`` / ``quantize_affine`` compute them.
"""

from __future__ import annotations

import abc
import math
from types import MappingProxyType
from typing import Any, Mapping

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FP8_BLOCK = 128
MX_BLOCK = 32
INT4_GROUP = 32
INT4_MIN, INT4_MAX = -8, 7


def _blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` [..., R, C] zero-padded to whole blocks and viewed as [..., R/rows, rows, C/cols, cols]."""
    r, c = x.shape[-2], x.shape[-1]
    pr, pc = -r % rows, -c % cols
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    lead = x.shape[:-2]
    return x.reshape(*lead, (r + pr) // rows, rows, (c + pc) // cols, cols), (r, c)


def _unblock(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    lead = x.shape[:-4]
    full = x.reshape(*lead, x.shape[-4] * x.shape[-3], x.shape[-2] * x.shape[-1])
    return full[..., : shape[0], : shape[1]]


# -- fp8 blockwise -----------------------------------------------------------------------


def fp8_quantize(x: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata e4m3 with ``x``'s shape, float32 scales [..., ceil(R/br), ceil(C/bc)]).
    A 1-D ``x`` is one row. ``block = (1, 128)`` gives the activations' tiles."""
    flat = x.ndim == 1
    if flat:
        x = x.unsqueeze(0)
    b, shape = _blocks(x.float(), *block)
    amax = b.abs().amax(dim=(-3, -1), keepdim=True)
    scale = amax / FP8_MAX
    q = (b / scale).nan_to_num(0.0).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # an all-zero block gives 0/0: zeros
    q = _unblock(q, shape)
    scale = scale.squeeze(-1).squeeze(-2)
    return (q.squeeze(0), scale.squeeze(0)) if flat else (q, scale)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> torch.Tensor:
    flat = q.ndim == 1
    if flat:
        q, scale = q.unsqueeze(0), scale.unsqueeze(0)
    b, shape = _blocks(q.float(), *block)
    out = _unblock(b * scale.float().unsqueeze(-1).unsqueeze(-3), shape).to(dtype)
    return out.squeeze(0) if flat else out


# -- fp8 rowwise -------------------------------------------------------------------------

ROWWISE_EPS = 1e-12  # the smallest amax a row is scaled for (an all-zero row gets zeros)


def fp8_rowwise_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata e4m3 with ``x``'s shape, float32 power-of-two scales ``x.shape[:-1]``), one
    scale per row along the last dimension, as torchao's rowwise recipe computes them
    (its multiplier ``448 / amax``, rounded down to a power of two; we keep its
    reciprocal). ``x`` is scaled in float32, whatever its dtype."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True)
    # float64 for the division and float32 for the power-of-two rounding, as torchao does,
    # so the exponents agree bit for bit (log2 of a float32 near a power of two decides it).
    multiplier = (FP8_MAX / amax.to(torch.float64).clamp(min=ROWWISE_EPS)).to(torch.float32)
    multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    q = (x.float() * multiplier).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, multiplier.reciprocal().squeeze(-1)


def fp8_rowwise_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


# -- mxfp8 ------------------------------------------------------------------------------


def _mx() -> Any:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor


def mx_supported(x: torch.Tensor) -> bool:
    return x.shape[-1] % MX_BLOCK == 0


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata e4m3 with ``x``'s shape, e8m0 scales [..., C/32]); the last dimension must
    be a multiple of 32."""
    if not mx_supported(x):
        raise ValueError(f"mxfp8 needs the last dimension to be a multiple of {MX_BLOCK}, found shape {tuple(x.shape)}")
    m = _mx().to_mx(x.contiguous(), FP8, MX_BLOCK)
    return m.qdata, m.scale.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK)


def mxfp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    blocks = q.float().reshape(*q.shape[:-1], q.shape[-1] // MX_BLOCK, MX_BLOCK)
    # e8m0 holds 2^(e - 127): its float32 conversion is exact.
    return (blocks * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


# -- int4 -------------------------------------------------------------------------------


def _int4_block(x: torch.Tensor) -> tuple[int, ...]:
    return (1,) * (x.ndim - 1) + (INT4_GROUP,)


def int4_supported(x: torch.Tensor) -> bool:
    return x.shape[-1] % INT4_GROUP == 0


def int4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-8, 7] with ``x``'s shape, float32 scales [..., C/32])."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    if not int4_supported(x):
        raise ValueError(f"int4 needs the last dimension to be a multiple of {INT4_GROUP}, found shape {tuple(x.shape)}")
    x = x.float()
    block = _int4_block(x)
    scale, zero = choose_qparams_affine(x, MappingType.SYMMETRIC, block, torch.int8, quant_min=INT4_MIN,
                                        quant_max=INT4_MAX)
    q = quantize_affine(x, block, scale, zero, torch.int8, quant_min=INT4_MIN, quant_max=INT4_MAX)
    return q, scale.reshape(*x.shape[:-1], x.shape[-1] // INT4_GROUP).float()


def int4_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    groups = q.float().reshape(*q.shape[:-1], q.shape[-1] // INT4_GROUP, INT4_GROUP)
    return (groups * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """Two int4 values per byte (uint8, low nibble first) along the last dimension."""
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def int4_unpack(packed: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    both = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return torch.where(both > 7, both - 16, both)


# -- the formats, by name --------------------------------------------------------------------


class Format(abc.ABC):
    """One quantized format: what the sender ships for a weight and what the trainer
    computes with (the fake-quantized weight and activations). Subclasses implement
    ``pack`` and ``unpack``."""

    name = ""
    scale_dtype: torch.dtype = torch.float32

    def supports(self, w: torch.Tensor) -> bool:
        return w.ndim >= 2

    @abc.abstractmethod
    def pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scale): the wire form of weight ``w``."""

    @abc.abstractmethod
    def unpack(self, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``pack`` encoded, in ``dtype``."""

    def fake_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The value the trainer computes with (no gradient): ``unpack(pack(w))`` in ``w``'s dtype."""
        return self.unpack(*self.pack(w), w.dtype)

    def fake_activation(self, x: torch.Tensor) -> torch.Tensor | None:
        """The fake-quantized activation (no gradient), or None when the format keeps
        activations in high precision."""
        return None

    def payload_bytes(self, w: torch.Tensor) -> int:
        payload, scale = self.pack(w)
        return payload.numel() * payload.element_size() + scale.numel() * scale.element_size()


class FP8Blockwise(Format):
    name = "fp8"

    def pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_quantize(w)

    def unpack(self, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8_dequantize(payload, scale, dtype)

    def fake_activation(self, x: torch.Tensor) -> torch.Tensor:
        q, s = fp8_quantize(x.reshape(-1, x.shape[-1]), (1, FP8_BLOCK))
        return fp8_dequantize(q, s, x.dtype, (1, FP8_BLOCK)).reshape(x.shape)


class FP8Rowwise(Format):
    """``[precision] name = "fp8"`` with ``scaling = "rowwise"``: weights and activations
    alike, one scale per row (see the module docstring)."""

    name = "fp8_rowwise"

    def pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_rowwise_quantize(w)

    def unpack(self, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8_rowwise_dequantize(payload, scale, dtype)

    def fake_activation(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_rowwise_dequantize(*fp8_rowwise_quantize(x), x.dtype)


class MXFP8(Format):
    name = "mxfp8"
    scale_dtype = torch.float8_e8m0fnu

    def supports(self, w: torch.Tensor) -> bool:
        return w.ndim >= 2 and mx_supported(w)

    def pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mxfp8_quantize(w)

    def unpack(self, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return mxfp8_dequantize(payload, scale, dtype)

    def fake_activation(self, x: torch.Tensor) -> torch.Tensor | None:
        if not mx_supported(x):
            return None
        return mxfp8_dequantize(*mxfp8_quantize(x), x.dtype)


class Int4(Format):
    """Weight-only: activations stay in the compute dtype."""

    name = "int4"

    def supports(self, w: torch.Tensor) -> bool:
        return w.ndim >= 2 and int4_supported(w)

    def pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = int4_quantize(w)
        return int4_pack(q), scale

    def unpack(self, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return int4_dequantize(int4_unpack(payload), scale, dtype)

    def fake_weight(self, w: torch.Tensor) -> torch.Tensor:
        return int4_dequantize(*int4_quantize(w), w.dtype)


FORMATS: Mapping[str, Format] = MappingProxyType(  # read-only
    {f.name: f for f in (FP8Blockwise(), FP8Rowwise(), MXFP8(), Int4())})


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), math.ulp(1.0)))

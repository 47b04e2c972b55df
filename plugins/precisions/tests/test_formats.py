"""The quantized formats against torchao's reference (bit for bit where the formats
agree) and against their inputs (error bounds)."""

from __future__ import annotations

import pytest
import torch

from skyrl_precisions import _formats as F


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.02


@pytest.mark.parametrize("shape", [(256, 256), (384, 128), (2, 256, 384)])
def test_fp8_blockwise_weights_equal_torchao_bit_for_bit(shape) -> None:
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerBlock

    w = randn(*shape)
    q, s = F.fp8_quantize(w)
    ref = Float8Tensor.from_hp(w, torch.float8_e4m3fn, granularity=PerBlock([1] * (w.ndim - 2) + [128, 128]))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), ref.qdata.view(torch.uint8))
    assert torch.equal(s, ref.scale.reshape(s.shape))
    assert torch.equal(F.fp8_dequantize(q, s), ref.dequantize().float())


def test_fp8_activation_tiles_equal_torchao_bit_for_bit() -> None:
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerBlock

    x = randn(64, 512, seed=1) * 50
    q, s = F.fp8_quantize(x, (1, 128))
    ref = Float8Tensor.from_hp(x, torch.float8_e4m3fn, granularity=PerBlock([1, 128]))
    assert s.shape == (64, 4)
    assert torch.equal(q.view(torch.uint8), ref.qdata.view(torch.uint8)) and torch.equal(s, ref.scale.reshape(s.shape))


def test_fp8_ragged_blocks_are_zero_padded_blocks() -> None:
    w = randn(200, 72, seed=2)
    q, s = F.fp8_quantize(w)
    assert q.shape == (200, 72) and s.shape == (2, 1)
    padded = torch.zeros(256, 128)
    padded[:200, :72] = w
    qp, sp = F.fp8_quantize(padded)
    assert torch.equal(q.view(torch.uint8), qp[:200, :72].view(torch.uint8)) and torch.equal(s, sp)
    assert torch.equal(F.fp8_quantize(torch.zeros(128, 128))[0].float(), torch.zeros(128, 128))  # no NaN from 0/0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rowwise_equals_torchaos_rowwise_recipe_bit_for_bit(dtype) -> None:
    """Scales and payload as torchao's rowwise float8 recipe computes them (axiswise amax,
    e4m3, power-of-two scales): one scale per row, over the last dimension."""
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    recipe = Float8LinearConfig.from_recipe_name("rowwise")
    cast = recipe.cast_config_weight
    assert cast.scaling_granularity is ScalingGranularity.AXISWISE and recipe.round_scales_to_power_of_2
    w = (randn(96, 384, seed=6) * torch.logspace(-3, 2, 96)[:, None]).to(dtype)  # rows over five decades
    w[3] = 0  # an all-zero row: zeros, no NaN
    q, s = F.fp8_rowwise_quantize(w)
    # torchao scales a weight along its input dimension (the rows of weight.t(), axis 0)
    ref = hp_tensor_to_float8_dynamic(w.t(), cast.target_dtype, LinearMMConfig(),
                                      scaling_granularity=cast.scaling_granularity, axiswise_dim=0,
                                      round_scales_to_power_of_2=True)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (96,)
    assert torch.equal(q.view(torch.uint8), ref._data.t().view(torch.uint8))
    assert torch.equal(s, ref._scale.reshape(96).reciprocal())  # we ship what the payload is multiplied by
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)  # every scale a power of two
    assert torch.equal(F.fp8_rowwise_dequantize(q, s)[3], torch.zeros(384))
    # Activations: the same function, a scale per token (torchao: axiswise_dim = -1 of the input).
    x = (randn(2, 5, 384, seed=7) * 40).to(dtype)
    qx, sx = F.fp8_rowwise_quantize(x)
    ref_x = hp_tensor_to_float8_dynamic(x, cast.target_dtype, LinearMMConfig(),
                                        scaling_granularity=cast.scaling_granularity, axiswise_dim=-1,
                                        round_scales_to_power_of_2=True)
    assert sx.shape == (2, 5) and torch.equal(qx.view(torch.uint8), ref_x._data.view(torch.uint8))
    assert torch.equal(sx, ref_x._scale.squeeze(-1).reciprocal())


def test_fp8_rowwise_round_trips_through_the_wire_and_unpack() -> None:
    from skyrl_precisions._precision import SEP, unpack_named

    fmt = F.FORMATS["fp8_rowwise"]
    w = randn(3, 64, 256, seed=8)  # stacked experts: a scale per expert row
    payload, scale = fmt.pack(w)
    assert payload.shape == w.shape and scale.shape == (3, 64)
    back = dict(unpack_named([("w", payload), (f"w{SEP}fp8_rowwise", scale)], torch.float32))["w"]
    assert torch.equal(back, fmt.fake_weight(w))
    assert torch.equal(fmt.fake_weight(back), back)  # quantizing the quantized weight changes nothing
    rel = (back - w).abs() / w.abs().amax(-1, keepdim=True)
    assert float(rel.max()) <= 2 ** -4 * 2  # e4m3 keeps 3 mantissa bits; a power-of-two scale can halve the range used


def test_mxfp8_equals_torchao_and_has_power_of_two_scales() -> None:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    w = randn(96, 256, seed=3)
    q, s = F.mxfp8_quantize(w)
    ref = MXTensor.to_mx(w, torch.float8_e4m3fn, 32)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (96, 8)
    assert torch.equal(F.mxfp8_dequantize(q, s), ref.dequantize(torch.float32))
    mant, _ = torch.frexp(s.float())
    assert torch.all(mant == 0.5)  # every scale is a power of two
    with pytest.raises(ValueError, match="multiple of 32"):
        F.mxfp8_quantize(randn(8, 40))


def test_int4_groups_equal_torchao_and_pack_two_per_byte() -> None:
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, dequantize_affine, quantize_affine

    w = randn(64, 128, seed=4)
    q, s = F.int4_quantize(w)
    assert q.min() >= -8 and q.max() <= 7 and s.shape == (64, 4)
    scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, (1, 32), torch.int8, quant_min=-8, quant_max=7)
    ref_q = quantize_affine(w, (1, 32), scale, zero, torch.int8, quant_min=-8, quant_max=7)
    assert torch.equal(q, ref_q)
    ref = dequantize_affine(ref_q, (1, 32), scale, zero, torch.int8, -8, 7)
    assert torch.allclose(F.int4_dequantize(q, s), ref, rtol=0, atol=1e-9)
    packed = F.int4_pack(q)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 64)
    assert torch.equal(F.int4_unpack(packed), q)


# Bits per element on the wire: the values plus the scales (fp8: one float32 per 128x128
# block; fp8_rowwise: one float32 per row of 512; mxfp8: one byte per 32 elements; int4:
# one float32 per 32).
@pytest.mark.parametrize(("name", "bound", "bits"), [
    ("fp8", 0.035, 8 + 32 / 16384), ("fp8_rowwise", 0.035, 8 + 32 / 512), ("mxfp8", 0.045, 8.25), ("int4", 0.16, 5),
])
def test_error_bounds_and_wire_size(name: str, bound: float, bits: float) -> None:
    fmt = F.FORMATS[name]
    w = randn(512, 512, seed=5)
    err = F.relative_error(fmt.fake_weight(w), w)
    assert 0 < err < bound, err
    payload, scale = fmt.pack(w)
    assert torch.equal(fmt.unpack(payload, scale, torch.float32), fmt.fake_weight(w))  # the trainer's value is the wire's
    assert fmt.payload_bytes(w) == w.numel() * bits / 8

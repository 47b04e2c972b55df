"""Real low-precision matmuls for the trainer's chosen ``nn.Linear`` layers, through
torchao (imports torch; torchao only when its kernels are used).

``[precision] kernels`` picks how the trainer computes the chosen layers:

- ``"emulated"``: fake quantization (``_fakequant``): float32 (or the compute dtype)
  matmuls on the quantized values, straight-through gradients;
- ``"torchao"``: each chosen plain ``nn.Linear`` becomes torchao's float8 training
  module for the format: ``fp8_rowwise`` torchao's ``Float8Linear`` with its rowwise
  recipe (``convert_to_float8_training``), ``fp8`` (blockwise) its
  ``Float8BlockwiseLinear`` (``blockwise_fp8_training``, through ``quantize_``),
  ``mxfp8`` :class:`MXFP8Linear` (torchao's MXFP8 ``mx_mm``). Forward and backward
  run FP8 / MXFP8 matmuls; the gradients are quantized too (that is where the time goes).
  Layers torchao cannot take stay emulated: stacked 3-D expert parameters (MoE experts:
  transformers' fused expert forward is no ``nn.Linear``), subclasses of ``nn.Linear``
  (their own forward), and shapes the kernels refuse (see :func:`swappable`);
- ``"auto"``: ``"torchao"`` where the model is on a CUDA device that has the kernels
  (:func:`unavailable` says why not), else ``"emulated"``.

The swap keeps each module object: torchao builds its module for a layer, and the
original object then takes that module's class and settings. Parameters (names, the
state dict, the tensors themselves), hooks others put on the module (LoRA's adapters and
its forward hook) and every reference to it stay valid, so checkpoints, weight sync,
LoRA and data parallelism see the same model. :func:`restore` undoes it (an engine's own
copy of a trained model computes with the emulated numbers and its quantized weights).
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Iterable

import torch

from skyrl_host.errors import UserError

TORCHAO, EMULATED = "torchao", "emulated"
KERNELS = ("auto", TORCHAO, EMULATED)

# The smallest CUDA compute capability with the format's tensor-core matmuls.
MIN_CAPABILITY = MappingProxyType({"fp8_rowwise": (8, 9), "fp8": (9, 0), "mxfp8": (10, 0)})
_GPU = MappingProxyType({
    "fp8_rowwise": "a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell)",
    "fp8": "a Hopper-class CUDA GPU (SM90 or newer) and triton",
    "mxfp8": "a Blackwell GPU (SM100)",
})
_LABEL = MappingProxyType({"fp8_rowwise": "rowwise FP8", "fp8": "blockwise FP8", "mxfp8": "MXFP8"})
_MARK = "_skyrl_torchao_kernels"  # on a swapped module: the attribute names the swap added


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def _import_problem(fmt: str) -> str | None:
    """Why torchao's kernels for ``fmt`` cannot be imported here (None: they can)."""
    try:
        if fmt == "fp8_rowwise":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401

            if not hasattr(torch, "_scaled_mm"):
                return f"this torch ({torch.__version__}) has no torch._scaled_mm"
        elif fmt == "fp8":
            import triton  # noqa: F401
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig  # noqa: F401
            from torchao.quantization import quantize_  # noqa: F401
        elif fmt == "mxfp8":
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm  # noqa: F401

            if not hasattr(torch, "float8_e8m0fnu"):
                return f"this torch ({torch.__version__}) has no torch.float8_e8m0fnu"
        else:
            return f"torchao has no training kernels for {fmt!r}"
    except ImportError as exc:
        return f"torchao's kernels for it do not import here ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def _cpu_rowwise_problem() -> str | None:
    """Why torch's CPU ``_scaled_mm`` cannot take rowwise scales here (None: it can):
    torch 2.11's oneDNN kernel asserts per-tensor scales; torch 2.13 takes rows. Found
    by one tiny call, once a process."""
    a = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as exc:
        return (f"this torch ({torch.__version__}) has no rowwise-scaled torch._scaled_mm on the CPU (its oneDNN "
                f"kernel takes per-tensor scales only; torch 2.13 has it): {str(exc).strip().splitlines()[0][:120]}")
    return None


def unavailable(fmt: str, device: torch.device) -> str | None:
    """Why torchao's kernels for format ``fmt`` cannot train a model on ``device`` (None:
    they can). Rowwise FP8 runs on the CPU too where torch's CPU ``_scaled_mm`` takes
    rowwise scales (torch 2.13; not 2.11); the others need their GPU."""
    if fmt not in MIN_CAPABILITY:
        return f"torchao has no training kernels for {fmt!r}"
    if fmt == "fp8_rowwise" and device.type == "cpu":
        problem = _import_problem(fmt) or _cpu_rowwise_problem()
        return f"rowwise FP8 matmuls on the CPU: {problem}" if problem else None
    capability = _cuda_capability(device)
    if capability is None:
        return f"{_LABEL[fmt]} matmuls need {_GPU[fmt]}; the model is on {device}"
    if capability < MIN_CAPABILITY[fmt]:
        major, minor = capability
        return f"{_LABEL[fmt]} matmuls need {_GPU[fmt]}; {device} has compute capability {major}.{minor}"
    return _import_problem(fmt)


def resolve(requested: str, fmt: str, device: torch.device, *, activations: bool) -> str:
    """The kernels a trainer on ``device`` computes format ``fmt`` with, for
    ``[precision] kernels = requested``. ``"torchao"`` where it cannot run is a user
    error saying why; ``"auto"`` takes it only on a CUDA device that has the kernels.
    A model on the meta device (a skeleton that only names the weights) is emulated."""
    if requested == EMULATED or device.type == "meta":
        return EMULATED
    if requested == "auto":
        if not activations or device.type != "cuda" or unavailable(fmt, device) is not None:
            return EMULATED
        return TORCHAO
    if requested != TORCHAO:
        raise UserError(f"[precision] kernels: expected one of {', '.join(KERNELS)}, found {requested!r}")
    if not activations:
        raise UserError("[precision] kernels = \"torchao\" quantizes the layers' inputs too (torchao's low-precision "
                        "matmuls take both operands quantized): set activations = true, or kernels = \"emulated\" for "
                        "weights-only quantization")
    why = unavailable(fmt, device)
    if why is not None:
        keep = "kernels = \"emulated\" computes the same numerics without them"
        if fmt == "fp8":
            keep += ", and scaling = \"rowwise\" has torchao kernels on the CPU"
        raise UserError(f"[precision] kernels = \"torchao\": {why}; {keep}")
    return TORCHAO


def swappable(module: torch.nn.Module, fmt: str) -> bool:
    """Whether torchao's kernels for ``fmt`` can take ``module``: a plain ``nn.Linear``
    (not a subclass: it would lose its own forward) whose shape the kernels accept
    (rowwise: both dimensions multiples of 16, as CUDA's ``_scaled_mm`` needs; blockwise:
    multiples of 128 and no bias; mxfp8: multiples of 32)."""
    if type(module) is not torch.nn.Linear:
        return False
    dims = (module.in_features, module.out_features)
    if fmt == "fp8_rowwise":
        return all(d % 16 == 0 for d in dims)
    if fmt == "fp8":
        return module.bias is None and all(d % 128 == 0 for d in dims)
    if fmt == "mxfp8":
        return all(d % 32 == 0 for d in dims)
    return False


def swapped(model: torch.nn.Module) -> list[str]:
    """The paths of the modules of ``model`` computing with torchao's kernels."""
    return [path for path, m in model.named_modules() if _MARK in m.__dict__]


def swap(model: torch.nn.Module, paths: Iterable[str], fmt: str) -> list[str]:
    """Give the modules at ``paths`` that torchao can take (:func:`swappable`) torchao's
    kernels for ``fmt``, in place; modules already swapped stay as they are. Returns the
    paths of every swapped module of ``model``."""
    originals = {p: model.get_submodule(p) for p in paths}
    originals = {p: m for p, m in originals.items() if _MARK not in m.__dict__ and swappable(m, fmt)}
    if originals:
        wanted = set(originals)

        def chosen(module: torch.nn.Module, fqn: str) -> bool:
            return fqn in wanted

        if fmt == "fp8_rowwise":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=chosen,
                                       config=Float8LinearConfig.from_recipe_name("rowwise"))
        elif fmt == "fp8":
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig
            from torchao.quantization import quantize_

            quantize_(model, Float8BlockwiseLinearConfig(), filter_fn=chosen)
        elif fmt == "mxfp8":
            for path, module in originals.items():
                _replace(model, path, MXFP8Linear.like(module))
        else:
            raise ValueError(f"torchao has no training kernels for {fmt!r}")
        for path, module in originals.items():
            _adopt(model, path, module)
        if fmt == "fp8":
            for module in originals.values():
                _fit_blockwise(module)
    return swapped(model)


def _replace(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _adopt(model: torch.nn.Module, path: str, original: torch.nn.Module) -> None:
    """Put ``original`` back at ``path`` as the module torchao made for it there: its
    class and the settings it added (the parameters are the original's own tensors)."""
    made = model.get_submodule(path)
    if made is original:
        return
    if made.weight is not original.weight or made.bias is not original.bias:
        raise RuntimeError(f"torchao's module for {path!r} does not hold the layer's own parameters")
    added = {k: v for k, v in vars(made).items() if k not in vars(original)}
    original.__dict__.update(added)
    original.__dict__[_MARK] = tuple(added)
    original.__class__ = type(made)
    _replace(model, path, original)


def _fit_blockwise(module: torch.nn.Module) -> None:
    """torchao's blockwise module computes in bfloat16 and returns bfloat16: hand the
    model its output in the input's dtype (outside autocast, which wants bfloat16), and
    use its triton matmuls where this torch has no ``torch.nn.functional.scaled_mm``."""
    if not hasattr(torch.nn.functional, "scaled_mm"):
        module.use_triton = True
    handle = module.register_forward_hook(_output_like_input)
    module.__dict__[_MARK] += ("_skyrl_output_hook",)
    module.__dict__["_skyrl_output_hook"] = handle.id


def _output_like_input(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or output.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return None
    return output.to(x.dtype)


def restore(model: torch.nn.Module) -> int:
    """Make every swapped module of ``model`` a plain ``nn.Linear`` again (same object,
    same parameters); returns how many there were."""
    count = 0
    for module in model.modules():
        added = module.__dict__.pop(_MARK, None)
        if added is None:
            continue
        hook = module.__dict__.get("_skyrl_output_hook")
        if hook is not None:
            module._forward_hooks.pop(hook, None)
        for key in added:
            module.__dict__.pop(key, None)
        module.__class__ = torch.nn.Linear
        count += 1
    return count


class MXFP8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose three matmuls (forward, input and weight gradients) run in
    MXFP8 through torchao's ``mx_mm`` (e4m3 in 32-element blocks, e8m0 scales rounded
    down as :mod:`skyrl_precisions._formats`' ``mxfp8`` rounds them). torchao quantizes the
    weight gradient's operands along the tokens in blocks of 32, so the tokens are
    zero-padded to a multiple of 32 (zero rows change no block's scale and add nothing)."""

    kernel_preference: Any = None  # torchao's KernelPreference; None: AUTO (its best kernels)

    @classmethod
    def like(cls, linear: torch.nn.Linear) -> "MXFP8Linear":
        with torch.device("meta"):
            made = cls(linear.in_features, linear.out_features, bias=False)
        made.weight, made.bias = linear.weight, linear.bias
        return made

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        pad = -rows.shape[0] % 32
        if pad:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
        preference = self.kernel_preference if self.kernel_preference is not None else KernelPreference.AUTO
        out = _to_mxfp8_then_scaled_mm(rows, self.weight, preference, ScaleCalculationMode.FLOOR)
        out = out[: rows.shape[0] - pad].reshape(*shape[:-1], out.shape[-1])
        return out + self.bias.to(out.dtype) if self.bias is not None else out

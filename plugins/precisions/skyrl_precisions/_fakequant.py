"""Fake quantization of a model's chosen layers (imports torch).

:func:`install` puts a forward pre-hook and a forward hook on every chosen module: the
``nn.Linear`` layers and the modules holding stacked expert matrices (parameters with 3
dimensions, ``[experts, out, in]``), except those the model family keeps in high
precision (router, embeddings, norms, output head). For the duration of the module's
forward its weight parameters are replaced by their fake-quantized values and its input
activation by its fake-quantized value, each through a straight-through function: the
forward computes with exactly the quantized numbers, the backward hands the gradient to
the master weight (and the input) unchanged. The parameters themselves (names, dtype,
optimizer state) are untouched, so checkpoints, data parallelism and weight sync see
the master weights. Layers that compute with torchao's real low-precision kernels
instead (``[precision] kernels``, :mod:`skyrl_precisions._kernels`) get no hooks;
stacked experts always do.

Fake-quantized weights are cached per parameter, so the micro-batches of a step quantize
each weight once: the owner calls :meth:`FakeQuantHooks.invalidate` after every
optimizer step (the torch backend does), and a cached value is also dropped when the
parameter's storage or version counter changed.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Sequence

import torch

from skyrl_precisions._formats import Format

# Module-path components that stay in high precision when the family names none (norms
# are never quantized: any component containing "norm").
DEFAULT_KEEP = ("lm_head", "embed_tokens", "gate", "router", "shared_expert_gate")


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized value, exactly. Backward: the gradient passes to the input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return quantized.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    if not x.requires_grad:
        return quantized
    return _StraightThrough.apply(x, quantized)


class FakeQuantHooks:
    """The hooks of one module (they hold no reference to it, so a deep copy of the model
    copies them with it)."""

    def __init__(self, fmt: Format, params: Sequence[str], *, weights: bool, activations: bool):
        self.fmt, self.params = fmt, tuple(params)
        self.weights, self.activations = weights, activations
        self._cache: dict[str, tuple[int, int, torch.Tensor]] = {}

    def invalidate(self) -> None:
        self._cache.clear()

    def _fake(self, name: str, p: torch.Tensor) -> torch.Tensor:
        key = (p._version, p.data_ptr())
        hit = self._cache.get(name)
        if hit is None or hit[:2] != key or hit[2].dtype != p.dtype:
            with torch.no_grad():
                hit = (*key, self.fmt.fake_weight(p.detach()))
            self._cache[name] = hit
        return straight_through(p, hit[2])

    def pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self.weights:
            saved = {}
            for name in self.params:
                p = module._parameters[name]
                saved[name] = p
                module._parameters[name] = self._fake(name, p)  # type: ignore[assignment]
            module.__dict__["_skyrl_fake_quant_saved"] = saved
        if self.activations and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            x = args[0]
            with torch.no_grad():
                q = self.fmt.fake_activation(x.detach())
            if q is not None:
                return (straight_through(x, q), *args[1:])
        return None

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        saved = module.__dict__.pop("_skyrl_fake_quant_saved", None)
        if saved:
            module._parameters.update(saved)


def _kept(path: str, keep: Iterable[str]) -> bool:
    parts = path.split(".")
    return any(k in parts for k in keep) or any("norm" in part for part in parts)


def chosen(model: torch.nn.Module, fmt: Format, keep: Sequence[str] = DEFAULT_KEEP) -> list[tuple[str, tuple[str, ...]]]:
    """(module path, weight parameter names) of every module the format quantizes: not
    those with a path component in ``keep`` (or containing "norm")."""
    out = []
    for path, module in model.named_modules():
        if not path or _kept(path, keep):
            continue
        if isinstance(module, torch.nn.Linear):
            names = ("weight",) if fmt.supports(module.weight) else ()
        else:  # stacked experts: [experts, out, in] parameters held directly by the module
            names = tuple(n for n, p in module.named_parameters(recurse=False) if p.ndim == 3 and fmt.supports(p))
        if names:
            out.append((path, names))
    return out


def installed(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` carries fake-quantization hooks."""
    return any(isinstance(getattr(h, "__self__", None), FakeQuantHooks)
               for m in model.modules() for h in m._forward_pre_hooks.values())


def remove(model: torch.nn.Module) -> int:
    """Take every fake-quantization hook off ``model`` (a deep copy of a trained model
    carries the trainer's); returns how many modules had them."""
    count = 0
    for module in model.modules():
        found = False
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if isinstance(getattr(h, "__self__", None), FakeQuantHooks)]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)
                found = True
        count += found
    return count


def install(model: torch.nn.Module, fmt: Format, *, keep: Sequence[str] = DEFAULT_KEEP, weights: bool = True,
            activations: bool = True, skip: Collection[str] = ()) -> tuple[list[str], list[FakeQuantHooks]]:
    """Fake-quantize the chosen modules of ``model`` (in place), except those at the
    paths in ``skip`` (they compute with real low-precision kernels); returns the names
    of the weights that are fake-quantized (``<module path>.<parameter>``) and the hooks."""
    names, installed = [], []
    for path, params in chosen(model, fmt, keep):
        if path in skip:
            continue
        module = model.get_submodule(path)
        hooks = FakeQuantHooks(fmt, params, weights=weights, activations=activations)
        module.register_forward_pre_hook(hooks.pre)
        module.register_forward_hook(hooks.post, always_call=True)
        names += [f"{path}.{p}" for p in params]
        installed.append(hooks)
    return names, installed

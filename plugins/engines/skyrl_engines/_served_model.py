"""The embedded engine's own copy of the model, and complete weight updates into it.

:func:`engine_model` copies the module tree (the engine keeps its own eval/train flags)
over the caller's tensors where their dtype already is the engine's, so an engine in the
trainer's dtype serves the trainer's own weights; :func:`copy_weights` applies a
complete set of weights, all or nothing, skipping tensors that already are the engine's.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping

import torch


def resolve_device(requested: str, model_device: torch.device) -> torch.device:
    """The engine's device for its ``device`` option: ``"auto"`` = the model's own device
    when it is CUDA already, else CUDA when present, else the model's device (on a
    machine without CUDA: exactly today's engine); ``"cpu"``; ``"cuda"`` (the current
    CUDA device) or ``"cuda:N"``. A CUDA device without CUDA raises UserError."""
    from skyrl_host.errors import UserError

    from skyrl_toolkit.devices import cuda_problem

    if requested == "auto":
        if model_device.type == "cuda" or not torch.cuda.is_available():
            return torch.device(model_device)
        return torch.device("cuda", torch.cuda.current_device())
    if requested == "cpu":
        return torch.device("cpu")
    problem = cuda_problem(requested)
    if problem is not None:
        raise UserError(f"[engine] {problem}")
    return torch.device("cuda", int(requested.split(":", 1)[1]) if ":" in requested else torch.cuda.current_device())


def engine_model(model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device | None = None, share: bool = True) -> tuple[torch.nn.Module, bool]:
    """A module to serve ``model`` in ``dtype`` on ``device`` (default: where its
    parameters are): the module tree is copied (so the engine has its own eval/train
    flags and never changes the caller's), the parameters and buffers are the caller's
    own tensors when their dtype and device already are ``dtype`` and ``device``,
    converted copies otherwise (``share=False``: copies always). Returns
    (module, shares_all_params)."""
    memo: dict[int, Any] = {}
    shared = True
    for p in model.parameters():
        dev = p.device if device is None else device
        if not share or (p.is_floating_point() and p.dtype != dtype) or p.device != dev:
            to = dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = torch.nn.Parameter(p.detach().to(device=dev, dtype=to, copy=True), requires_grad=False)
            shared = False
        else:
            memo[id(p)] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) in memo:
            continue
        dev = b.device if device is None else device
        # Rotary frequencies stay in float32 (the rotary embedding computes in float32 anyway).
        convert = b.is_floating_point() and b.dtype != dtype and not name.endswith("inv_freq")
        if convert:
            memo[id(b)] = b.detach().to(device=dev, dtype=dtype)
        elif b.device != dev:
            memo[id(b)] = b.detach().to(dev)
        else:
            memo[id(b)] = b
    try:
        served = copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - an exotic module that cannot be deep-copied
        if not shared:
            raise
        served = model  # serve the caller's module itself; generate() toggles eval mode around its forwards
    return served, shared


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def copy_weights(
    params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], named_tensors: Iterable[tuple[str, Any]]
) -> dict[str, int]:
    """Copy ``named_tensors`` into the model's ``params`` / ``buffers`` (keyed by every
    name, a tied weight under each of its names), all or nothing: an unknown name, a wrong shape or a
    parameter left uncovered raises ValueError before anything is written. A tensor that
    already is the target (shared storage) is not copied. Returns
    ``{"copied", "shared", "bytes"}``."""
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    covered: set[int] = set()
    for name, tensor in named_tensors:
        target = params.get(name)
        if target is None:
            target = buffers.get(name)
        if target is None:
            raise ValueError(f"update_weights: unknown weight name {name!r}; nothing was changed")
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.as_tensor(tensor)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}; "
                "nothing was changed"
            )
        covered.add(id(target))
        plan.append((target, tensor))
    for name, p in params.items():
        if id(p) not in covered:
            raise ValueError(f"update_weights: missing weight {name!r} (a complete set is required); nothing was changed")
    copied = shared = nbytes = 0
    done: set[int] = set()
    with torch.no_grad():
        for target, tensor in plan:
            if id(target) in done:
                continue
            done.add(id(target))
            if same_storage(target, tensor):
                shared += 1
                continue
            target.copy_(tensor)
            copied += 1
            nbytes += tensor.numel() * tensor.element_size()
    return {"copied": copied, "shared": shared, "bytes": nbytes}

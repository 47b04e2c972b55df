"""Placing a job's backend and engines: what every launcher shares (the ``local``
launcher of skyrl-launchers, and its ``ray`` launcher).

A driver builds a :class:`~skyrl_host.interfaces.PlacementRequest` and calls
``launcher.place(request)``; it gets a :class:`~skyrl_host.interfaces.Placement` whose
``backend`` and ``engine`` satisfy the kinds' Protocols wherever they run, so drivers
never branch on where things run. Every launcher builds each backend rank and engine
replica with :func:`start_backend` and :func:`start_engine` from this module, so every
copy is built, checked and started alike, and saves the final model with
:func:`save_trained_model`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

from skyrl_host.contracts import describe, has, require
from skyrl_host.errors import UserError
from skyrl_host.interfaces import (
    AdapterTraining,
    LoadedModel,
    ModelTraits,
    PlacementRequest,
    QuantizedServing,
    ReferenceScoring,
    RewardKL,
    SideChannels,
)


def start_backend(request: PlacementRequest, loaded: LoadedModel, algorithm: Any, precision: Any,
                  replay: Sequence[Any]) -> Any:
    """A backend made from ``request.backend``, checked for the capabilities this job
    needs, and started on ``loaded`` with the job's replay strategies (``replay``: made
    from ``request.replay`` by the caller, once per process) and precision."""
    backend = request.backend.create()
    who = describe(request.backend)
    if request.engine is not None and precision is not None and precision.quantizes:
        require(backend, QuantizedServing, who=who, needed_by=f"precision {precision.name!r}")
    if has(algorithm, RewardKL) and algorithm.kl_in_reward:
        require(backend, ReferenceScoring, who=who, needed_by="a KL penalty in the reward (algorithm.kl_in_reward)")
    replay = list(replay)
    try:
        backend.start(loaded, seed=request.seed, total_steps=request.total_steps,
                      reference=bool(algorithm.needs_reference), replay=replay, precision=precision)
    except ValueError as exc:
        if not replay:
            raise
        raise UserError(f"[replay] strategies: {exc}") from None
    return backend


def start_engine(request: PlacementRequest, loaded: LoadedModel, precision: Any, sampler: Any,
                 replay: Sequence[Any]) -> Any:
    """An engine made from ``request.engine`` and started on ``loaded``, checked to fill
    the side channels the job's replay strategies need (with ``sampler``, the job's;
    ``sampler`` and ``replay`` made by the caller, once per process)."""
    engine = request.engine.create()
    engine.start(loaded, precision=precision, sampler=sampler)
    strategies = list(replay)
    if strategies:
        names = ", ".join(repr(s.name) for s in strategies)
        who = describe(request.engine)
        require(engine, SideChannels, who=who, needed_by=f"[replay] strategies {names}")
        filled = engine.side_channels(sampler)
        lacking = [s for s in strategies if s.side_channel not in filled]
        if lacking:
            raise UserError(
                f"{who} fills no {lacking[0].side_channel!r} side channel as configured, which replay strategy "
                f"{lacking[0].name!r} needs (it fills: {', '.join(sorted(filled)) or 'none'})"
            )
    return engine


def save_trained_model(backend: Any, family: Any, loaded: Any, path: str, model: ModelTraits,
                       trained: dict[str, Any] | None = None) -> None:
    """The backend's trained weights as a Hugging Face folder at ``path`` (through the
    family's ``save`` of ``loaded``'s model), in the model's own dtype: ``model.dtype``
    (the ``[model]`` choice's traits: ``[model] dtype``; a family that declares none keeps
    the trained weights' dtype). The weights are converted on the way out, into ``loaded``'s module
    tree only while it is saved: neither the backend's tensors nor ``loaded``'s change.

    With a LoRA backend also the adapters, as a PEFT adapter in ``path/adapter``
    (``path`` itself stays the merged model that ``from_pretrained`` loads), and the
    frozen base they were trained on, which the adapter's ``base_model_name_or_path``
    names: ``[model] path`` when the job loaded a folder (the base is that folder loaded
    in ``[model] dtype``), otherwise (a preset) a copy saved in ``path/base``.
    ``trained``: the backend's ``named_weights()`` when the caller already gathered them."""
    import os

    import torch

    trained = dict(backend.named_weights()) if trained is None else trained
    name = model.dtype
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
    with _weights_held(loaded.model, trained, dtype):
        family.save(loaded, path)
    if not trains_adapters(backend):
        return
    base = model.path
    if base is None:  # a preset: save the frozen base the adapters were trained on
        base = os.path.join(os.path.abspath(path), "base")
        with _weights_held(loaded.model, {}, dtype):
            family.save(loaded, base)
    adapter = os.path.join(path, "adapter")
    backend.save_adapters(adapter, base_model=base)


@contextlib.contextmanager
def _weights_held(model: Any, weights: Mapping[str, Any], dtype: Any) -> Iterator[None]:
    """Inside the block ``model``'s parameters and persistent buffers are ``weights[name]``
    (its own tensor where ``weights`` has no entry), floating-point ones in ``dtype``
    (None: as they are; a converted tensor is a CPU copy); tied parameters stay tied.
    The module tree gets its own tensors (and config dtype) back after the block."""
    import torch

    persistent = set(model.state_dict())
    held: dict[int, Any] = {}  # id(own tensor) -> the tensor in its place (tied ones share)
    undo: list[tuple[dict[str, Any], str, Any]] = []
    for prefix, module in model.named_modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, own in list(table.items()):
                full = f"{prefix}.{key}" if prefix else key
                if own is None or (not is_param and full not in persistent):
                    continue
                if id(own) not in held:
                    value = weights.get(full, own)
                    value = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
                    if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                        value = value.to("cpu", dtype)
                    held[id(own)] = torch.nn.Parameter(value, requires_grad=False) if is_param else value
                undo.append((table, key, own))
                table[key] = held[id(own)]
    hf_config = getattr(model, "config", None)
    config_dtype = getattr(hf_config, "dtype", None)
    try:
        yield
    finally:
        for table, key, own in reversed(undo):
            table[key] = own
        if hf_config is not None:
            hf_config.dtype = config_dtype  # save_pretrained writes the saved dtype into the live config


def trains_adapters(backend: Any) -> bool:
    """Whether ``backend`` trains LoRA adapters (rather than full weights)."""
    return has(backend, AdapterTraining) and backend.adapter_config() is not None


def vocab_size(model: Any) -> int:
    """Rows of ``model``'s input embedding."""
    return int(model.get_input_embeddings().num_embeddings)

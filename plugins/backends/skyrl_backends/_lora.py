"""LoRA for the torch backend (``[backend] lora_rank > 0``), a small implementation of its own.

Every target ``nn.Linear`` (a module whose last name component is in the targets) gets
two parameters registered on the module itself, ``lora_A`` ``[rank, in_features]``
(Kaiming-uniform, as ``nn.Linear`` initialises its weight) and ``lora_B``
``[out_features, rank]`` (zeros), and a forward hook that adds
``(alpha / rank) * B @ A @ dropout(x)`` to the module's output. So:

- the base parameters keep their Hugging Face names (``...q_proj.weight``), the adapters
  are ``...q_proj.lora_A`` / ``...q_proj.lora_B``: stable names for checkpoints and the
  engine, and no wrapper module changes any path;
- at step 0 (B = 0) the model is exactly the base model;
- whatever computes the base Linear's output (plain matmul, a precision's fake-quantized
  forward) is left alone: the adapter is added to that output;
- ``disabled()`` turns every adapter off: the base model (the reference policy).

Why not peft: its wrappers rename the base weights (``base_layer.weight``), which would
leak into the names the engine, checkpoints and ``save_final`` use, and it gives no
handle for the engine's atomic adapter swap. transformers' routed experts are fused 3-D
parameters (``experts.gate_up_proj``), not ``nn.Linear`` modules, so they get no adapter.
The adapters are nonetheless PEFT's LoRA, term for term (:meth:`LoraAdapters.peft_config`):
``save_adapters`` writes them as a PEFT adapter that ``peft`` and vLLM load.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping, Sequence

import torch

ADAPTER_SUFFIXES = ("lora_A", "lora_B")


def target_modules(
    model: torch.nn.Module, targets: Sequence[str], *, strict: bool = True
) -> list[tuple[str, torch.nn.Module]]:
    """The ``nn.Linear`` modules of ``model`` LoRA adapts, in module order: those whose
    last name component is one of ``targets``. Raises ValueError naming the targets that
    match modules which are not ``nn.Linear``, and (``strict``) the targets that match no
    module; without ``strict`` (a family's defaults, which cover several architectures)
    only when no target matches at all."""
    wanted = list(dict.fromkeys(targets))
    found: list[tuple[str, torch.nn.Module]] = []
    hit: set[str] = set()
    not_linear: dict[str, str] = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last not in wanted:
            continue
        if isinstance(module, torch.nn.Linear):
            found.append((name, module))
            hit.add(last)
        else:
            not_linear.setdefault(last, f"{name} ({type(module).__name__})")
    bad = [t for t in wanted if t in not_linear and t not in hit]
    if bad:
        raise ValueError(
            "LoRA adapts nn.Linear modules only; "
            + ", ".join(f"target {t!r} names {not_linear[t]}" for t in bad)
            + " (fused expert weights are 3-D parameters, not Linear modules)"
        )
    missing = [t for t in wanted if t not in hit]
    if missing and (strict or not found):
        raise ValueError(f"LoRA targets {missing} match no nn.Linear module of the model")
    return found


class LoraAdapters:
    """The adapters attached to one model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        targets: Sequence[str],
        seed: int,
        strict: bool = True,
    ):
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.dropout = float(dropout)
        self.targets = tuple(dict.fromkeys(targets))
        self.scale = self.alpha / self.rank
        self.enabled = True
        self.modules: dict[str, torch.nn.Module] = dict(target_modules(model, self.targets, strict=strict))
        # The targets that adapt something here (a family's defaults may name more).
        self.targets = tuple(t for t in self.targets if any(n.rsplit(".", 1)[-1] == t for n in self.modules))
        generator = torch.Generator().manual_seed(int(seed) + 0x10A)
        self._handles = []
        for name, module in self.modules.items():
            w = module.weight
            a = torch.empty(self.rank, module.in_features, dtype=w.dtype)
            # nn.Linear's own initialisation (Kaiming uniform, a = sqrt(5)), from a seeded generator
            # so every data-parallel rank and every resumed run makes the same adapters.
            bound = 1.0 / math.sqrt(module.in_features)
            a.uniform_(-bound, bound, generator=generator)
            module.register_parameter("lora_A", torch.nn.Parameter(a.to(w.device)))
            module.register_parameter(
                "lora_B", torch.nn.Parameter(torch.zeros(module.out_features, self.rank, dtype=w.dtype, device=w.device))
            )
            self._handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        if not self.enabled:
            return None
        x = args[0]
        if self.dropout and module.training:
            x = torch.nn.functional.dropout(x, self.dropout, training=True)
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, module.lora_A), module.lora_B)
        return output + delta * self.scale

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model, without adapters, inside the block."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def config(self) -> dict[str, Any]:
        """What a receiver needs to apply the adapters: rank, alpha and targets."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    def peft_config(self, model: torch.nn.Module, base_model: str | None = None) -> dict[str, Any]:
        """These adapters as PEFT's LoRA config (the ``adapter_config.json`` of a PEFT
        adapter of ``model``, this module tree): PEFT's LoRA layer adds
        ``lora_B(lora_A(dropout(x))) * lora_alpha / r`` to the base layer's output
        (``use_rslora`` false), exactly this module's hook. ``target_modules``: the
        targets, unless PEFT's matching (a module named a target or ending in
        ``.<target>``) would pick a module not adapted here; then the adapted paths."""
        picked = {
            name for name, _ in model.named_modules()
            if name and any(name == t or name.endswith("." + t) for t in self.targets)
        }
        targets = list(self.targets) if picked == set(self.modules) else list(self.modules)
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "revision": None,
            "r": self.rank,
            "lora_alpha": int(self.alpha) if self.alpha.is_integer() else self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets,
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "inference_mode": True,
        }

    def parameter_names(self) -> list[str]:
        """``<module>.lora_A``, ``<module>.lora_B`` for every adapted module, in module order."""
        return [f"{name}.{s}" for name in self.modules for s in ADAPTER_SUFFIXES]

    def is_adapter(self, name: str) -> bool:
        module, _, last = name.rpartition(".")
        return last in ADAPTER_SUFFIXES and module in self.modules

    def merge(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (a full state dict with adapters) with every adapted weight merged,
        ``W + (alpha / rank) * B @ A``, and the adapter entries dropped: plain Hugging
        Face names and shapes, what a model without LoRA holds."""
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if self.is_adapter(name):
                continue
            module, _, last = name.rpartition(".")
            if last == "weight" and module in self.modules:
                a, b = state[f"{module}.lora_A"], state[f"{module}.lora_B"]
                value = (value.detach() + (b.detach().to(value.dtype) @ a.detach().to(value.dtype)) * self.scale)
            out[name] = value
        return out

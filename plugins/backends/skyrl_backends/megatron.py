"""megatron: the megatron-core training backend (``[backend] name = "megatron"``).

The model a job loads is rebuilt as a megatron-core ``GPTModel`` (local layer specs, no
TransformerEngine needed) from its Hugging Face config, its weights converted into
megatron-core's layout (fused QKV per query group, fused gate/up, per-expert MLPs), and
trained with the same packing, algorithm losses and AdamW as the torch backend. The
engine gets Hugging Face names back (``named_weights``), so every transport and engine
works unchanged. ``r3`` runs through megatron-core's own routing replay (the routers'
``RouterReplay``), ``support`` through the same kept-set scoring as the torch backend.

What megatron-core cannot express for a model (another architecture, RoPE scaling,
biases, ...) is refused at validate time where the job's files say it, else when the
backend starts, with a message naming it. See docs/backends.md.

This module only declares the options and registers the backend: it imports neither
torch nor megatron-core (the factory imports ``skyrl_backends._mcore_trainer``).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import attrs

from skyrl_backends._options import TrainerOptions, context_parallel_problem
from skyrl_host import hookimpl
from skyrl_toolkit.devices import cuda_problem
from skyrl_host.interfaces import BackendTraits
from skyrl_host.options import ge, option

@attrs.frozen
class MegatronBackendConfig(TrainerOptions):
    """Options of ``[backend]`` when ``name = "megatron"``."""

    tensor_parallel: int = option(1, help="tensor-parallel size (megatron-core's TP)", validator=ge(1))
    pipeline_parallel: int = option(1, help="pipeline-parallel size (megatron-core's PP)", validator=ge(1))
    expert_parallel: int = option(1, help="expert-parallel size (megatron-core's EP, MoE models)", validator=ge(1))
    context_parallel: int = option(1, help="context-parallel size (megatron-core's CP)", validator=ge(1))


def create(config: MegatronBackendConfig) -> Any:
    """The factory: a :class:`skyrl_host.interfaces.Backend` (imports torch and megatron-core)."""
    from skyrl_backends._mcore_trainer import MegatronBackend

    return MegatronBackend(config)


def _model_config(choice: Any) -> dict[str, Any] | None:
    """What the job's files say of the model's Hugging Face config (from its declared
    traits): a local folder's config.json, or ``{"model_type": ...}`` of a preset; None
    when they say nothing."""
    traits = choice.traits
    if traits.path is not None:
        try:
            data = json.loads((pathlib.Path(traits.path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # the family's own validator reports a bad folder
        return data if isinstance(data, dict) else None
    return {"model_type": traits.model_type} if traits.model_type is not None else None


class _Config:
    """A config.json's keys as attributes (what :func:`describe` reads of a transformers config)."""

    def __init__(self, data: dict[str, Any]):
        self.__dict__.update(data)
        text = data.get("text_config")
        self._text = _Config(text) if isinstance(text, dict) else None

    def get_text_config(self) -> Any:
        return self._text or self


def _trains_on_cpu(device: str, launcher: str) -> bool:
    """Whether the backend's ranks will compute on a CPU: asked for, or "auto" in this
    process on a machine without CUDA (the Ray launcher's actors may have GPUs)."""
    if device == "cpu":
        return True
    if device != "auto" or launcher == "ray":
        return False
    import torch

    return not torch.cuda.is_available()


def check(spec: Any) -> list[tuple[str, str]]:
    """Job-level checks (``skyrl validate``): the parallelism this backend runs, a CUDA
    ``device`` on a machine with CUDA, and a model megatron-core can express."""
    from skyrl_host.kinds import SLOT_KINDS

    choice = spec.plugins.get("backend")
    if choice is None or isinstance(choice, tuple):
        return []
    cfg = choice.config
    problems: list[tuple[str, str]] = []
    tp, ep, pp, cp = cfg.tensor_parallel, cfg.expert_parallel, cfg.pipeline_parallel, cfg.context_parallel
    ranks = spec.cluster.trainer_ranks
    launcher = spec.cluster.launcher
    if cp > 1 and (problem := context_parallel_problem(cfg, None)) is not None:
        problems.append(("backend.context_parallel", problem))
    elif cp > 1 and ranks % (tp * cp):
        problems.append(("backend.context_parallel", f"the megatron backend runs [cluster] trainer_ranks / "
                         f"(tensor_parallel x context_parallel) data-parallel replicas of the model: tensor_parallel x "
                         f"context_parallel = {tp * cp} must divide trainer_ranks = {ranks}"))
    elif ranks % (tp * ep * pp):
        key = "backend." + ("tensor_parallel" if tp > 1 else "expert_parallel" if ep > 1 else "pipeline_parallel")
        if pp == 1:
            problems.append((key, f"the megatron backend runs [cluster] trainer_ranks / tensor_parallel data-parallel "
                             f"replicas of the model, with expert_parallel ranks sharing the experts: tensor_parallel x "
                             f"expert_parallel = {tp * ep} must divide trainer_ranks = {ranks}"))
        else:
            problems.append((key, f"the megatron backend runs [cluster] trainer_ranks / (tensor_parallel x "
                             f"pipeline_parallel) data-parallel replicas of the model, with expert_parallel ranks sharing "
                             f"the experts: tensor_parallel x expert_parallel x pipeline_parallel = {tp * ep * pp} must "
                             f"divide trainer_ranks = {ranks}"))
    elif ep > 1 and (model := spec.plugins.get("model")) is not None and not isinstance(model, tuple) \
            and model.traits.is_moe is False:
        problems.append(("backend.expert_parallel", f"expert_parallel = {ep} spreads experts over ranks, and this "
                         "model has no MoE layers"))
    elif ranks > 1 and launcher != "ray":
        problems.append(("cluster.launcher", f"trainer_ranks = {ranks} megatron ranks run as processes of "
                         "their own: set [cluster] launcher = \"ray\""))
    if launcher != "ray":
        problem = cuda_problem(cfg.device)
        if problem is not None:
            problems.append(("backend.device", problem))
    if cfg.compute_dtype == "bfloat16" and _trains_on_cpu(cfg.device, launcher):
        problems.append(("backend.compute_dtype", "compute_dtype = \"bfloat16\" trains with the megatron backend on "
                         "CUDA only: on a CPU megatron-core's linear layers fail in the backward pass (their custom_bwd "
                         "restores the forward's CUDA autocast, not the CPU's, so a bfloat16 gradient meets a float32 "
                         "weight); use \"float32\" here"))
    model = spec.plugins.get("model")
    if model is not None and not isinstance(model, tuple):
        data = _model_config(model)
        if data is not None:
            from skyrl_backends._mcore_arch import NotExpressible, check_model_type, describe

            try:
                if len(data) == 1:  # a preset: its model type
                    check_model_type(data["model_type"])
                    mla = data["model_type"] == "deepseek_v3"
                else:
                    mla = describe(_Config(data)).mla
            except NotExpressible as exc:
                where = model.traits.key if model.traits.key != "model" else f"model.{SLOT_KINDS['model'].selector}"
                problems.append((where, f"the megatron backend cannot build this model: {exc}"))
                return problems
            if cp > 1 and mla and (problem := context_parallel_problem(cfg, True)) is not None:
                problems.append(("backend.context_parallel", problem))
            layers = data.get("num_hidden_layers")  # (a folder's config.json; a preset's is known when it loads)
            if cfg.pipeline_parallel > 1 and isinstance(layers, int) and layers % cfg.pipeline_parallel:
                problems.append(("backend.pipeline_parallel", f"pipeline_parallel = {cfg.pipeline_parallel} must "
                                 f"divide the model's {layers} decoder layers (each pipeline stage holds as many)"))
    return problems


@hookimpl
def skyrl_register_backends(register: Any) -> None:
    register(
        "megatron",
        create,
        config=MegatronBackendConfig,
        description="megatron-core trainer: Qwen3 dense and MoE, GLM-4.5 and DeepSeek-V3 / Kimi K2 as megatron-core GPT models, routing replay "
        "through megatron-core's RouterReplay, packed micro-batches, AdamW",
        check=check,
        # It trains megatron-core tensors of its own, never the loaded model's, so a one-process
        # engine sharing the loaded model may take any wire dtype; it trains no adapters.
        traits=lambda c: BackendTraits(owns_weights=True, device=c.device),
    )

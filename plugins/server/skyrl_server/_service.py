"""What the server computes: base models, LoRA training models and sampler weights.

- A **base model** (one per ``[models."NAME"]``) is loaded once by its model plugin;
  its module tree stays pristine: training models copy the tree over the same frozen
  tensors (the torch backend's LoRA does that), and the engine gets a tree of its own
  over the same tensors, so several adapters share one base.
- A **training model** is one torch backend (``[backend]``, ``lora_rank`` from the
  request) started on its base: forward_backward runs the model's adapted forward on
  each datum and accumulates gradients into the adapters; optim_step applies AdamW with
  the request's AdamParams and clears them.
- **Sampler weights** are snapshots of a model's adapters that sampling serves
  (:mod:`skyrl_server._sampling`); the training half is :mod:`skyrl_server._training`,
  the losses :mod:`skyrl_server._losses`.

Every method here runs on the server's one worker thread (torch work is serialised).
"""

from __future__ import annotations

import copy
from typing import Any

import attrs

from skyrl_server._errors import BadRequest
from skyrl_server._sampling import SamplerWeights, SamplingMixin
from skyrl_server._stability import RouteStore, StabilityMixin
from skyrl_server._training import TrainingModel, TrainingMixin


def _detached_tree(model: Any) -> Any:
    """A module tree of its own over ``model``'s tensors (parameters and buffers shared)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


@attrs.define
class BaseModel:
    name: str
    family: Any
    loaded: Any  # LoadedModel; its module tree is never run
    engine: Any
    context: int  # the longest sequence (prompt + sampled) the model takes
    vocab: int



class Service(TrainingMixin, SamplingMixin, StabilityMixin):
    """The models one server holds (see the module docstring)."""

    def __init__(self, spec: Any, storage: Any, host: Any):
        self.spec = spec
        self.host = host  # the plugin host: the samplers' registrations
        self.storage = storage  # skyrl_server._storage.Storage
        self.bases: dict[str, BaseModel] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplerWeights] = {}
        self._keys = 0
        # R3 for Tinker clients: routes recorded at sampling, replayed from provenance spans.
        self.route_store = RouteStore(spec.server.route_cache_bytes)
        self.route_hooks: dict[str, Any] = {}  # model_id -> (its module, RouterHooks on it)
        self.batchers: dict[str, Any] = {}  # base name -> its ContinuousBatcher (made at its first sample)

    def close(self) -> None:
        """Stop the batchers' decode threads (what they still hold fails)."""
        for batcher in list(self.batchers.values()):
            batcher.close()

    # -- base models -------------------------------------------------------------

    def load_bases(self) -> None:
        import torch

        for name, choice in self.spec.models.items():
            family = choice.create()
            loaded = family.load(alphabet=self.spec.alphabets.get(name), seed=self.spec.server.seed)
            model = loaded.model
            if any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
                model = model.float()  # float32 master weights, as the torch backend trains them
            model.requires_grad_(False)
            loaded = attrs.evolve(loaded, model=model)
            engine = self._engine_for(loaded)
            engine.start(attrs.evolve(loaded, model=_detached_tree(model)))
            cfg = getattr(model, "config", None)
            context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
            vocab = int(model.get_input_embeddings().num_embeddings)
            self.bases[name] = BaseModel(name, family, loaded, engine, context, vocab)

    def _engine_for(self, loaded: Any) -> Any:
        """The ``[engine]`` plugin for a base; on a mixture-of-experts base it records the
        routers' choices (``return_routed_experts``), which R3 replays for the trainer."""
        choice = self.spec.engine
        config = choice.config
        switch = choice.traits.switches.get("routed_experts")  # the engine's option that records them, if any
        if loaded.routers and config is not None and switch is not None:
            config = attrs.evolve(config, **{switch: True})
        return choice.registration.create(config)

    def capabilities(self) -> list[dict[str, Any]]:
        return [{"model_name": b.name, "max_context_length": b.context, "trainable": True, "sampleable": True}
                for b in self.bases.values()]

    def base(self, name: str | None) -> BaseModel:
        if name not in self.bases:
            raise BadRequest(f"unknown base_model {name!r}; this server serves {sorted(self.bases)}", status=404)
        return self.bases[name]



__all__ = ["BaseModel", "SamplerWeights", "Service", "TrainingModel"]

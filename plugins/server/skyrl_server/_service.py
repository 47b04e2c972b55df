"""What the server computes: base models, LoRA training models and sampler weights.

- A **base model** (one per ``[models."NAME"]``) is loaded once by its model plugin;
  its module tree stays pristine: training models copy the tree over the same frozen
  tensors (the torch backend's LoRA does that), and the engine gets a tree of its own
  over the same tensors, so several adapters share one base.
- A **training model** is one torch backend (``[backend]``, ``lora_rank`` from the
  request) started on its base: forward_backward runs the model's adapted forward on
  each datum and accumulates gradients into the adapters; optim_step applies AdamW with
  the request's AdamParams and clears them.
- **Sampler weights** are a snapshot of a model's adapters (CPU copies + config), kept
  in memory under a sampling-session id and, when saved by name, written to the
  storage root; sampling swaps them into the base's engine (``update_adapter``).

Every method here runs on the server's one worker thread (torch work is serialised).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from skyrl_server._errors import BadRequest


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
    served: Any = None  # the key of the adapter the engine serves now
    zero_adapter: Any = None  # (named tensors, config): B = 0, exactly the base model


@attrs.define
class SamplerWeights:
    base: str
    tensors: dict[str, Any]  # CPU float32
    config: dict[str, Any]
    key: int  # unique per snapshot


@attrs.define
class TrainingModel:
    model_id: str
    base: str
    rank: int
    backend: Any
    params: list[Any]
    optimizer: Any
    steps: int = 0


LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"), "importance_sampling": _RL_INPUTS, "ppo": _RL_INPUTS,
               "cispo": _RL_INPUTS}
# loss_fn_config keys and their defaults (the SDK's documented ones): bounds of the clipped ratio.
LOSS_CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}}


class Service:
    """The models one server holds (see the module docstring)."""

    def __init__(self, spec: Any, storage: Any, host: Any):
        self.spec = spec
        self.host = host  # the plugin host: the samplers' registrations
        self.storage = storage  # skyrl_server._storage.Storage
        self.bases: dict[str, BaseModel] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplerWeights] = {}
        self._keys = 0

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
            engine = self.spec.engine.create()
            engine.start(attrs.evolve(loaded, model=_detached_tree(model)))
            cfg = getattr(model, "config", None)
            context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
            vocab = int(model.get_input_embeddings().num_embeddings)
            self.bases[name] = BaseModel(name, family, loaded, engine, context, vocab)

    def capabilities(self) -> list[dict[str, Any]]:
        return [{"model_name": b.name, "max_context_length": b.context, "trainable": True, "sampleable": True}
                for b in self.bases.values()]

    def base(self, name: str | None) -> BaseModel:
        if name not in self.bases:
            raise BadRequest(f"unknown base_model {name!r}; this server serves {sorted(self.bases)}", status=404)
        return self.bases[name]

    # -- training models -----------------------------------------------------------

    def create_model(self, model_id: str, base_name: str, rank: int, seed: int | None) -> None:
        import torch

        base = self.base(base_name)
        config = attrs.evolve(self.spec.backend.config, lora_rank=rank)
        backend = self.spec.backend.registration.create(config)  # the torch backend (the file is checked for it)
        backend.start(base.loaded, seed=self.spec.server.seed if seed is None else int(seed), total_steps=1,
                      reference=False)
        params = [p for p in backend.module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        self.models[model_id] = TrainingModel(model_id, base_name, rank, backend, params, optimizer)

    def save_state(self, model_id: str, path: str) -> None:
        """The model's adapters and optimizer state at ``path`` (a tinker://.../weights/NAME)."""
        tm = self.model(model_id)
        tensors = {n: t.detach().to("cpu", copy=True) for n, t in tm.backend.named_adapters()}
        self.storage.write_state(path, {"base": tm.base, "rank": tm.rank, "adapters": tensors,
                                        "config": dict(tm.backend.adapter_config()), "steps": tm.steps,
                                        "optimizer": tm.optimizer.state_dict()})

    def load_state(self, model_id: str, path: str, optimizer: bool, *, create: bool, base_model: str | None) -> None:
        """Load the state at ``path`` into ``model_id`` (with ``create``: a new model made
        from it), with its optimizer state when ``optimizer``."""
        state = self.storage.read_state(path)
        if create:
            if base_model is not None and base_model != state["base"]:
                raise BadRequest(f"base_model {base_model!r}: the state at {path!r} was trained on {state['base']!r}")
            self.create_model(model_id, state["base"], int(state["rank"]), None)
        tm = self.model(model_id)
        if tm.base != state["base"] or tm.rank != int(state["rank"]):
            raise BadRequest(f"the state at {path!r} is a rank-{state['rank']} adapter of {state['base']!r}; "
                             f"model {model_id!r} is a rank-{tm.rank} adapter of {tm.base!r}")
        own = dict(tm.backend.module.named_parameters())
        import torch

        with torch.no_grad():
            for name, tensor in state["adapters"].items():
                if name not in own or own[name].shape != tensor.shape:
                    raise BadRequest(f"the state at {path!r} does not fit model {model_id!r} (adapter {name!r})")
                own[name].copy_(tensor)
        if optimizer:
            tm.optimizer.load_state_dict(state["optimizer"])
            tm.steps = int(state["steps"])

    def model(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise BadRequest(f"unknown model_id {model_id!r}", status=404)
        return self.models[model_id]

    def unload(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    def forward_backward(self, model_id: str, data: Sequence[Mapping[str, Any]], loss_fn: str,
                         config: Mapping[str, float], forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum: ``logprobs`` and ``elementwise_loss`` (float32 [N]); metrics
        ``loss:sum``. Without ``forward_only`` the loss's gradient is added to the
        adapters' (summed over the data, like the loss)."""
        import torch

        tm = self.model(model_id)
        base = self.bases[tm.base]
        if loss_fn not in LOSSES:
            raise BadRequest(f"loss_fn {loss_fn!r} is not served yet; served: {list(LOSSES)}")
        known = LOSS_CONFIG.get(loss_fn, {})
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise BadRequest(f"loss_fn_config: {loss_fn!r} takes {sorted(known) or 'no keys'}, found {unknown}")
        config = {**known, **config}
        if known and not config["clip_low_threshold"] <= config["clip_high_threshold"]:
            raise BadRequest("loss_fn_config: clip_low_threshold must not exceed clip_high_threshold")
        for i, datum in enumerate(data):
            tokens = datum["tokens"]
            if len(tokens) == 0:
                raise BadRequest(f"datum {i}: model_input has no tokens")
            if len(tokens) > base.context:
                raise BadRequest(f"datum {i}: {len(tokens)} tokens, longer than the model's context ({base.context})")
            if tokens.min() < 0 or tokens.max() >= base.vocab:
                raise BadRequest(f"datum {i}: model_input holds a token outside the vocabulary (0..{base.vocab - 1})")
            for key in LOSS_INPUTS[loss_fn]:
                if key not in datum["inputs"]:
                    raise BadRequest(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]")
                if datum["inputs"][key].size != len(tokens):
                    raise BadRequest(f"datum {i}: loss_fn_inputs[{key!r}] has {datum['inputs'][key].size} values "
                                     f"for {len(tokens)} input tokens")
            targets = datum["inputs"]["target_tokens"]
            if targets.min() < 0 or targets.max() >= base.vocab:
                raise BadRequest(f"datum {i}: target_tokens holds a token outside the vocabulary (0..{base.vocab - 1})")
        backend = tm.backend
        module, device = backend.module, backend.device
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        grad = torch.enable_grad() if not forward_only else torch.no_grad()
        with grad:
            for datum in data:
                ids = torch.as_tensor(np.array(datum["tokens"], dtype=np.int64), device=device)[None]
                targets = torch.as_tensor(np.array(datum["inputs"]["target_tokens"], dtype=np.int64), device=device)
                logits = module(input_ids=ids).logits[0].float()
                logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
                elementwise = _loss(loss_fn, logprobs, datum["inputs"], config, device)
                loss = elementwise.sum()
                if not forward_only:
                    loss.backward()
                total += float(loss.detach())
                outputs.append({"logprobs": logprobs.detach().cpu().numpy().astype(np.float32),
                                "elementwise_loss": elementwise.detach().cpu().numpy().astype(np.float32)})
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, adam: Mapping[str, float]) -> dict[str, float]:
        import torch

        tm = self.model(model_id)
        lr, b1, b2, eps = (float(adam.get(k, d)) for k, d in
                           (("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-12)))
        wd, clip = float(adam.get("weight_decay", 0.0)), float(adam.get("grad_clip_norm", 0.0))
        problems = [n for n, v, ok in (("learning_rate", lr, lr >= 0), ("beta1", b1, 0 <= b1 < 1),
                                        ("beta2", b2, 0 <= b2 < 1), ("eps", eps, eps > 0), ("weight_decay", wd, wd >= 0),
                                        ("grad_clip_norm", clip, clip >= 0)) if not (ok and math.isfinite(v))]
        if problems:
            raise BadRequest(f"adam_params.{problems[0]}: out of range")
        for group in tm.optimizer.param_groups:
            group.update(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        grads = [p.grad for p in tm.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if clip > 0 and grads:
            torch.nn.utils.clip_grad_norm_(tm.params, clip)
        tm.optimizer.step()
        tm.optimizer.zero_grad(set_to_none=True)
        tm.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}

    # -- sampler weights ------------------------------------------------------------

    def snapshot(self, model_id: str) -> SamplerWeights:
        tm = self.model(model_id)
        tensors = {n: t.detach().to("cpu", copy=True).float() for n, t in tm.backend.named_adapters()}
        self._keys += 1
        return SamplerWeights(tm.base, tensors, dict(tm.backend.adapter_config()), self._keys)

    def save_for_sampler(self, model_id: str, sampling_session_id: str | None, path: str | None) -> None:
        weights = self.snapshot(model_id)
        if sampling_session_id is not None:
            self.samplers[sampling_session_id] = weights
        if path is not None:
            self.storage.write_sampler_weights(path, weights)

    def open_sampler(self, sampling_session_id: str, base_model: str | None, model_path: str | None) -> str:
        """A sampling session over a base model (no adapter) or saved sampler weights;
        returns its base model's name."""
        if model_path is not None:
            weights = self.storage.read_sampler_weights(model_path)
            self.base(weights.base)
            self._keys += 1
            weights.key = self._keys
            self.samplers[sampling_session_id] = weights
            return weights.base
        base = self.base(base_model)
        self.samplers[sampling_session_id] = SamplerWeights(base.name, {}, {}, 0)
        return base.name

    def sampler(self, sampling_session_id: str) -> SamplerWeights:
        if sampling_session_id not in self.samplers:
            raise BadRequest(f"unknown sampling_session_id {sampling_session_id!r}", status=404)
        return self.samplers[sampling_session_id]

    def _serve(self, base: BaseModel, weights: SamplerWeights) -> None:
        key = (weights.key,)
        if base.served == key:
            return
        if weights.tensors:
            tensors, config = weights.tensors, weights.config
        else:  # the base model alone: a zero adapter (B = 0 adds nothing)
            if base.zero_adapter is None:
                import torch

                # The family's default targets that name nn.Linear modules of this model.
                found = {n.rsplit(".", 1)[-1] for n, m in base.loaded.model.named_modules() if isinstance(m, torch.nn.Linear)}
                config = {"rank": 1, "alpha": 1.0, "targets": [t for t in base.loaded.lora_targets if t in found]}
                shapes = base.engine.adapter_slots(config)
                base.zero_adapter = ({n: torch.zeros(s) for n, s in shapes.items()}, config)
            tensors, config = base.zero_adapter
        base.engine.update_adapter(list(tensors.items()), config, version=weights.key)
        base.served = key

    def sample(self, sampling_session_id: str, prompt: Sequence[int], n: int, params: Mapping[str, Any],
               prompt_logprobs: bool, last_n: int | None = None) -> dict[str, Any]:
        """``n`` sequences: tokens, logprobs, stop reason ("stop" or "length")."""
        weights = self.sampler(sampling_session_id)
        base = self.bases[weights.base]
        prompt = [int(t) for t in prompt]
        max_tokens = params.get("max_tokens")
        max_tokens = 16 if max_tokens is None else int(max_tokens)
        if not prompt:
            raise BadRequest("prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= base.vocab:
            raise BadRequest(f"prompt holds a token outside the vocabulary (0..{base.vocab - 1})")
        if max_tokens < 1:
            raise BadRequest(f"sampling_params.max_tokens must be at least 1, found {max_tokens}")
        if len(prompt) + max_tokens > base.context:
            raise BadRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed the model's context "
                             f"({base.context})")
        if not 1 <= n <= 1024:
            raise BadRequest(f"num_samples must be in [1, 1024], found {n}")
        stop = params.get("stop")
        stop_tokens: list[int] = []
        stop_strings: list[str] = []
        if isinstance(stop, str):
            stop_strings = [stop]
        elif isinstance(stop, list):
            if all(isinstance(s, str) for s in stop):
                stop_strings = list(stop)
            elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
                stop_tokens = list(stop)
            else:
                raise BadRequest("sampling_params.stop: expected a string, a list of strings or a list of token ids")
        elif stop is not None:
            raise BadRequest("sampling_params.stop: expected a string, a list of strings or a list of token ids")
        if stop_strings and base.loaded.tokenizer is None:
            raise BadRequest("sampling_params.stop: stop strings need a tokenizer, and this model has none")
        sampler = self._sampler(params)
        seed = params.get("seed")
        seed = int(seed) if seed is not None else int(np.random.default_rng().integers(0, 2**31 - 1))
        self._serve(base, weights)
        batch = base.engine.generate([prompt], n=n, sampler=sampler, max_new_tokens=max_tokens, seed=seed)
        sequences = []
        for i in range(batch.n_sequences):
            tokens = np.asarray(batch.response(i), dtype=np.int32)
            logprobs = np.asarray(batch.response_logprobs(i), dtype=np.float32)
            reason = "length" if bool(batch.truncated[i]) else "stop"
            cut = _first_stop(tokens, stop_tokens, stop_strings, base.loaded.tokenizer)
            if cut is not None:
                tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
            sequences.append({"tokens": tokens, "logprobs": logprobs, "stop_reason": reason})
        result: dict[str, Any] = {"sequences": sequences}
        if prompt_logprobs:
            lp = self._prompt_logprobs(base, prompt)
            if last_n is not None:  # only the last N are scored
                lp[: max(len(lp) - last_n, 0)] = np.nan
            result["prompt_logprobs"] = lp
        return result

    def _prompt_logprobs(self, base: BaseModel, prompt: list[int]) -> np.ndarray:
        """The served weights' logprob of each prompt token given the ones before it (NaN for the first)."""
        import torch

        engine = base.engine
        with torch.no_grad(), engine.adapters.pinned():
            ids = torch.as_tensor([prompt], dtype=torch.long, device=engine.device)
            logits = engine.model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu().numpy()
        return np.concatenate([[np.nan], lp]).astype(np.float32)

    def _sampler(self, params: Mapping[str, Any]) -> Any:
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1))
        top_p = float(params.get("top_p", 1.0))
        if not math.isfinite(temperature) or temperature < 0:
            raise BadRequest(f"sampling_params.temperature must be >= 0, found {temperature}")
        if not 0 < top_p <= 1:
            raise BadRequest(f"sampling_params.top_p must be in (0, 1], found {top_p}")
        if top_k < -1 or top_k == 0:
            raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1, found {top_k}")
        host = self.host
        if temperature == 0:
            reg = host.get("samplers", "greedy")
            return reg.create(reg.config())
        reg = host.get("samplers", "temperature")
        return reg.create(reg.config(temperature=temperature, top_k=max(top_k, 0), top_p=top_p))


def _first_stop(tokens: np.ndarray, stop_tokens: list[int], stop_strings: list[str], tokenizer: Any) -> int | None:
    """How many tokens to keep when a request's stop token or string occurs (it is kept), else None."""
    for j, t in enumerate(tokens.tolist()):
        if t in stop_tokens:
            return j + 1
        if stop_strings:
            text = tokenizer.decode(tokens[: j + 1].tolist())
            if any(s in text for s in stop_strings):
                return j + 1
    return None


def _loss(name: str, logprobs: Any, inputs: Mapping[str, np.ndarray], config: Mapping[str, float], device: Any) -> Any:
    """The per-token loss (float32 [N]) of ``name``: the SDK's definitions.

    - ``cross_entropy``: ``-weights * logprobs``;
    - ``importance_sampling``: ``-ratio * advantages``, ``ratio = exp(logprobs - sampling_logprobs)``;
    - ``ppo``: ``-min(ratio * advantages, clip(ratio, low, high) * advantages)``;
    - ``cispo``: ``-sg(clip(ratio, low, high)) * logprobs * advantages`` (sg: no gradient)."""
    import torch

    def tensor(key: str) -> Any:
        return torch.as_tensor(np.array(inputs[key], dtype=np.float32), device=device)

    if name == "cross_entropy":
        return -tensor("weights") * logprobs
    ratio = torch.exp(logprobs - tensor("logprobs"))
    adv = tensor("advantages")
    if name == "importance_sampling":
        return -ratio * adv
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    if name == "ppo":
        return -torch.minimum(ratio * adv, clipped * adv)
    return -clipped.detach() * logprobs * adv


def safetensors_bytes(tensors: Mapping[str, Any], config: Mapping[str, Any], base: str) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()},
                metadata={"config": json.dumps(dict(config)), "base_model": base})


def from_safetensors_bytes(data: bytes) -> tuple[dict[str, Any], dict[str, Any], str]:
    from safetensors.torch import load

    tensors = load(data)
    n = int.from_bytes(data[:8], "little")  # the safetensors header: its length, then JSON with the metadata
    meta = json.loads(data[8 : 8 + n]).get("__metadata__", {})
    return tensors, json.loads(meta.get("config", "{}")), meta.get("base_model", "")

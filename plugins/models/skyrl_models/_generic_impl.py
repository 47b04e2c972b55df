"""The generic family's implementation (imports torch and transformers).

Imported by :func:`skyrl_models.hf.make_family` only when a job selects ``family = "hf"``
(or a folder no specific family covers). Everything the specific families declare by
hand is found here by probing the model once it is built or loaded:

- **LoRA targets**: the last path component of every ``nn.Linear`` inside the decoder
  layers, routers excepted (``q_proj``, ``qkv_proj``, ``gate_up_proj``, ... whatever the
  architecture calls them);
- **MoE routers**: one forward of a few tokens with a hook on every module of the
  decoder layers; a router is a module whose output is ``(logits [N, E], weights [N, k],
  ids [N, k])`` where ``ids`` are the top-k of ``logits`` and ``weights`` are their
  softmax probabilities (renormalised over the k, or not): exactly what
  :func:`skyrl_toolkit.routing.weights_at` recomputes for ``softmax_topk``, so ``r3`` can
  force the ids and keep the router's gradient. A module with that output shape whose
  numbers differ (PhiMoE's sparsemixer, say) is a router ``r3`` cannot replay:
  :func:`probe_routers` says which and why, and the job is refused with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from skyrl_host.errors import Problem, UserError
from skyrl_host.interfaces import RouterInfo
from skyrl_models import _hf
from skyrl_models._hf_data import INITIALIZER_RANGE, MAX_POSITION_EMBEDDINGS, PRESETS

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from skyrl_models.hf import HfConfig

PROBE_TOKENS = 12  # tokens of the routing probe's forward


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(path, modules) of the model's decoder layers: the ``ModuleList`` with one entry
    per ``num_hidden_layers`` (the longest ``ModuleList`` when the config does not say)."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    exact = [(p, m) for p, m in lists if n is not None and len(m) == n]
    found = exact or sorted(lists, key=lambda pm: -len(pm[1]))
    return found[0] if found else None


def lora_targets(model: torch.nn.Module, routers: list[RouterInfo]) -> tuple[str, ...]:
    """Names of the ``nn.Linear`` modules inside the decoder layers (their last path
    component), routers and their gates excepted, in first-seen order."""
    layers = decoder_layers(model)
    if layers is None:
        return ()
    prefix = layers[0] + "."
    skip = {r.path for r in routers}
    names: list[str] = []
    for path, module in model.named_modules():
        if not path.startswith(prefix) or path in skip or not isinstance(module, torch.nn.Linear):
            continue
        last = path.rsplit(".", 1)[-1]
        if last.endswith("gate") and not last.endswith("_gate") or last in names:
            continue  # a router's linear (mlp.gate) or already listed
        if last in ("shared_expert_gate",):  # a 1-output gate of a shared expert: a scalar per token
            continue
        names.append(last)
    return tuple(names)


def _router_output(output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)):
        return None
    logits, weights, ids = output
    if logits.ndim != 2 or weights.ndim != 2 or ids.ndim != 2 or ids.is_floating_point():
        return None
    if weights.shape != ids.shape or logits.shape[0] != ids.shape[0] or ids.shape[1] > logits.shape[1]:
        return None
    return logits, weights, ids


def probe_routers(model: torch.nn.Module) -> tuple[list[RouterInfo], dict[str, str]]:
    """The model's routers that ``r3`` can replay, in layer order, and
    {path: why not} for router-shaped modules it cannot (empty for a dense model).
    Runs one forward of :data:`PROBE_TOKENS` tokens (no gradients) with the model in
    its own mode restored after."""
    layers = decoder_layers(model)
    if layers is None:
        return [], {}
    prefix = layers[0] + "."
    seen: dict[str, Any] = {}
    handles = []
    for path, module in model.named_modules():
        if path.startswith(prefix) and path.count(".") > prefix.count("."):
            handles.append(module.register_forward_hook(
                lambda m, a, out, path=path: seen.setdefault(path, out)))
    vocab = int(getattr(model.config, "vocab_size", 0) or 0) or 2
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=generator).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    from skyrl_toolkit.routing import weights_at

    found: list[RouterInfo] = []
    refused: dict[str, str] = {}
    for path, out in seen.items():
        parsed = _router_output(out)
        if parsed is None:
            continue
        logits, weights, chosen = (t.detach().float() for t in parsed)
        chosen = parsed[2].detach().long()
        k, n_experts = chosen.shape[1], logits.shape[1]
        layer = int(path[len(prefix):].split(".", 1)[0])
        top = torch.topk(logits, k, dim=-1).indices
        if not torch.equal(top.sort(-1).values, chosen.sort(-1).values):
            refused[path] = (f"{type(_module(model, path)).__name__} does not choose its experts as the top-{k} of its "
                             "logits")
            continue
        match = None
        for normalize in (True, False):
            info = RouterInfo(layer=layer, path=path, kind="softmax_topk", n_experts=n_experts, top_k=k,
                              normalize=normalize, scale=1.0)
            expected = weights_at(info, logits, chosen)
            if torch.allclose(expected, weights, rtol=1e-4, atol=1e-6):
                match = info
                break
        if match is None:
            refused[path] = (f"{type(_module(model, path)).__name__} weighs its top-{k} experts otherwise than a "
                             "softmax over the experts (renormalised or not): r3 would not reproduce its weights")
            continue
        found.append(match)
    found.sort(key=lambda r: r.layer)
    return found, refused


def preset_config(config: HfConfig, tokenizer: Any) -> Any:
    """The transformers config of a tiny preset (:data:`skyrl_models.hf.PRESETS`), for
    the tokenizer's vocabulary."""
    from transformers import AutoConfig

    model_type, numbers = PRESETS[config.preset]
    hf = AutoConfig.for_model(model_type, max_position_embeddings=MAX_POSITION_EMBEDDINGS,
                              initializer_range=INITIALIZER_RANGE, **dict(numbers), **_hf.vocab_ids(tokenizer))
    hf._attn_implementation = config.attn_implementation
    return hf


def _module(model: torch.nn.Module, path: str) -> torch.nn.Module:
    return model.get_submodule(path)


class GenericFamily(_hf.HFFamily):
    """A :class:`skyrl_host.interfaces.ModelFamily` for any transformers causal LM."""

    name = "hf"
    model_types = ("*",)  # any model type AutoModelForCausalLM loads
    max_positions = MAX_POSITION_EMBEDDINGS

    def __init__(self, config: HfConfig):
        super().__init__(config)
        self.refused_routers: dict[str, str] = {}
        self.lora_targets: tuple[str, ...] = ()

    # -- building and loading ----------------------------------------------------------

    def preset_config(self, tokenizer: Any) -> Any:
        return preset_config(self.config, tokenizer)

    def model_class(self, hf_config: Any) -> Any:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]

    def load_folder(self, path: str) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from skyrl_models._checkpoint_files import check_safetensors, load_error, load_errors
        from skyrl_models._model_types import folder_problem

        key = "model.path"
        problem = folder_problem(path, trust_remote_code=self.config.trust_remote_code)
        if problem is not None:
            raise UserError(Problem(problem, key=key))
        if not any((_hf.pathlib.Path(path) / name).is_file() for name in _hf.TOKENIZER_FILES):
            names = ", ".join(_hf.TOKENIZER_FILES)
            raise UserError(Problem(f"{path!r} has no tokenizer files (expected one of {names})", key=key))
        trust = self.config.trust_remote_code
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        except (OSError, ValueError) as exc:
            raise UserError(Problem(f"cannot load a tokenizer from {path!r}: {exc}", key=key)) from None
        check_safetensors(path, key=key)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=_hf.DTYPES[self.config.dtype],
                                                         attn_implementation=self.config.attn_implementation,
                                                         trust_remote_code=trust)
        except load_errors() as exc:
            raise load_error(path, exc, key=key) from None
        if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # batched generation pads; Llama-style tokenizers name no pad
        return model.eval(), tokenizer

    def load(self, *, alphabet: str | None, seed: int) -> Any:
        loaded = super().load(alphabet=alphabet, seed=seed)
        self.lora_targets = lora_targets(loaded.model, list(loaded.routers))
        loaded.lora_targets = self.lora_targets
        loaded.router_problems = dict(self.refused_routers)
        return loaded

    # -- what probing finds ------------------------------------------------------------

    def routers(self, model: Any) -> list[RouterInfo]:
        """The routers :func:`probe_routers` finds (``refused_routers`` keeps the ones r3
        cannot replay, with the reason)."""
        found, self.refused_routers = probe_routers(model)
        return found


# Sizes of the small random copy :func:`folder_router_problems` probes: the folder's own
# architecture (classes, expert count, top-k, routing options) at a width that builds in
# milliseconds.
_SMALL = {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def folder_router_problems(path: str, *, trust_remote_code: bool) -> dict[str, str] | None:
    """What :func:`probe_routers` says of a folder's architecture without loading its
    weights: a random copy with its config at a small width and at most 2 layers.
    ``{}``: every router found can be replayed; ``{path: why}``: none can, and why;
    None: no copy could be built (the run's own probe of the real model decides)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        text = getattr(cfg, "text_config", None) or cfg
        layers = int(getattr(text, "num_hidden_layers", 2))
        for key, value in _SMALL.items():
            if isinstance(getattr(text, key, None), int):
                setattr(text, key, value)
        if layers > 2:
            text.num_hidden_layers = 2
            for key, value in list(vars(text).items()):  # per-layer lists (layer_types, ...)
                if isinstance(value, list) and len(value) == layers:
                    setattr(text, key, value[:2])
        with _hf.seeded(0):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
        found, refused = probe_routers(model)
    except Exception:  # noqa: BLE001 - an architecture that does not shrink: the real model is probed at load
        return None
    return {} if found else refused

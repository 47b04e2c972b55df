"""Training models: one torch backend per LoRA model over its shared frozen base.

``create_model`` starts the backend (``lora_rank`` from the request) on the base's
loaded model; ``forward_backward`` runs the adapted forward on each datum and
accumulates the loss's gradient into the adapters; ``optim_step`` applies AdamW with
the request's AdamParams and clears them; ``save_state`` / ``load_state`` keep the
adapters with the optimizer. Mixed into :class:`skyrl_server._service.Service`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from skyrl_server._errors import BadRequest

from skyrl_server._losses import LOSS_INPUTS, loss_config, loss_terms


@attrs.define
class TrainingModel:
    model_id: str
    base: str
    rank: int
    backend: Any
    params: list[Any]
    optimizer: Any
    steps: int = 0
    seed: int = 0
    parts: str = "attn,mlp,unembed"  # what the adapters cover (LoraConfig's train_attn / train_mlp / train_unembed)
    # Set when the model is restored after a restart while acknowledged forward_backward
    # gradients waited for a step (they are not persisted): its next optim_step fails.
    grads_lost: bool = False



LORA_PARTS = ("attn", "mlp", "unembed")
LOGITS_PER_FORWARD = 1 << 26  # float32 logits one forward_backward chunk may hold (256 MiB): tokens x vocab


def _chunks(data: Sequence[Mapping[str, Any]], plans: Sequence[Any], vocab: int) -> list[list[int]]:
    """Datum indices in forwards of at most LOGITS_PER_FORWARD padded logits; a datum whose
    routes are forced (R3) is a forward of its own (its forced rows are its tokens)."""
    budget = max(1, LOGITS_PER_FORWARD // max(vocab, 1))
    chunks: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i, datum in enumerate(data):
        n = len(datum["tokens"])
        if getattr(plans[i], "hooks", None) is not None:
            chunks.append([i])
            continue
        if current and max(width, n) * (len(current) + 1) > budget:
            chunks.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, n)
    if current:
        chunks.append(current)
    return chunks



def _check_data(data: Sequence[Mapping[str, Any]], loss_fn: str, context: int, vocab: int) -> None:
    """A 400 naming the first datum that is empty, longer than ``context``, holds a token
    outside ``vocab`` or lacks (a right-sized) one of ``loss_fn``'s inputs. The common
    case, every datum fine, is checked over all of them at once."""
    needed = LOSS_INPUTS[loss_fn]
    lengths = np.fromiter((len(d["tokens"]) for d in data), dtype=np.int64, count=len(data))
    if (lengths.size and lengths.min() > 0 and lengths.max() <= context
            and all(key in d["inputs"] and d["inputs"][key].size == n for d, n in zip(data, lengths) for key in needed)):
        tokens = np.concatenate([d["tokens"] for d in data])
        targets = np.concatenate([d["inputs"]["target_tokens"] for d in data])
        if tokens.min() >= 0 and tokens.max() < vocab and targets.min() >= 0 and targets.max() < vocab:
            return
    for i, datum in enumerate(data):  # something is wrong: find it datum by datum, for the message
        tokens = datum["tokens"]
        if len(tokens) == 0:
            raise BadRequest(f"datum {i}: model_input has no tokens")
        if len(tokens) > context:
            raise BadRequest(f"datum {i}: {len(tokens)} tokens, longer than the model's context ({context})")
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise BadRequest(f"datum {i}: model_input holds a token outside the vocabulary (0..{vocab - 1})")
        for key in needed:
            if key not in datum["inputs"]:
                raise BadRequest(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]")
            if datum["inputs"][key].size != len(tokens):
                raise BadRequest(f"datum {i}: loss_fn_inputs[{key!r}] has {datum['inputs'][key].size} values "
                                 f"for {len(tokens)} input tokens")
        targets = datum["inputs"]["target_tokens"]
        if targets.min() < 0 or targets.max() >= vocab:
            raise BadRequest(f"datum {i}: target_tokens holds a token outside the vocabulary (0..{vocab - 1})")


def lora_targets(loaded: Any, parts: str) -> list[str]:
    """The ``nn.Linear`` names LoRA adapts for ``parts`` (a comma-separated subset of
    :data:`LORA_PARTS`): the family's targets inside attention modules (a path with
    ``attn`` or ``attention``) for ``attn``, its other targets (MLPs, shared experts,
    Mamba mixers) for ``mlp``, and the output head for ``unembed`` (a LoRA on the
    unembedding; with tied embeddings the input embedding stays as it is)."""
    import torch

    wanted = set(parts.split(","))
    model = loaded.model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kinds: dict[str, set[str]] = {}
    head_name = None
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        last = path.rsplit(".", 1)[-1]
        if module is head:
            head_name = last
        elif last in loaded.lora_targets:
            kinds.setdefault(last, set()).add("attn" if ("attn" in path or "attention" in path) else "mlp")
    targets = [name for name, found in kinds.items() if found & wanted]
    if "unembed" in wanted and head_name is not None:
        targets.append(head_name)
    if not targets:
        raise BadRequest(f"lora_config: the model has no layers to adapt for {parts!r}")
    return targets


class TrainingMixin:
    """The training half of :class:`skyrl_server._service.Service`."""

    # -- training models -----------------------------------------------------------

    def create_model(self, model_id: str, base_name: str, rank: int, seed: int | None,
                     parts: str = "attn,mlp,unembed") -> None:
        import torch

        base = self.base(base_name)
        config = attrs.evolve(self.spec.backend.config, lora_rank=rank, lora_targets=lora_targets(base.loaded, parts))
        backend = self.spec.backend.registration.create(config)  # the torch backend (the file is checked for it)
        seed = self.spec.server.seed if seed is None else int(seed)
        backend.start(base.loaded, seed=seed, total_steps=1, reference=False)
        params = [p for p in backend.module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        self.models[model_id] = TrainingModel(model_id, base_name, rank, backend, params, optimizer, seed=seed,
                                              parts=parts)

    def state(self, model_id: str) -> dict[str, Any]:
        """The model's adapters (copied to the CPU), their config, optimizer state and steps."""
        tm = self.model(model_id)
        tensors = {n: t.detach().to("cpu", copy=True) for n, t in tm.backend.named_adapters()}
        return {"base": tm.base, "rank": tm.rank, "adapters": tensors, "config": dict(tm.backend.adapter_config()),
                "steps": tm.steps, "optimizer": tm.optimizer.state_dict(), "parts": tm.parts}

    def save_state(self, model_id: str, path: str) -> None:
        """The model's adapters and optimizer state at ``path`` (a tinker://.../weights/NAME)."""
        self.storage.write_state(path, self.state(model_id))

    def save_durable(self, model_id: str, name: str) -> str:
        """The model's whole state as its durable state ``name``; the file (for the store's row)."""
        return self.storage.write_durable(model_id, name, self.state(model_id))

    def restore_model(self, model_id: str, base: str, rank: int, seed: int, file: str | None, grads_lost: bool,
                      parts: str = "attn,mlp,unembed") -> None:
        """A model as the store left it: fresh from ``seed``, then its durable state (adapters,
        optimizer, steps) from ``file`` when it has one."""
        self.create_model(model_id, base, rank, seed, parts)
        if file is not None:
            self._apply_state(model_id, self.storage.read_durable(file), True, file)
        self.models[model_id].grads_lost = grads_lost

    def load_state(self, model_id: str, path: str, optimizer: bool, *, create: bool, base_model: str | None) -> None:
        """Load the state at ``path`` into ``model_id`` (with ``create``: a new model made
        from it), with its optimizer state when ``optimizer``."""
        state = self.storage.read_state(path)
        if create:
            if base_model is not None and base_model != state["base"]:
                raise BadRequest(f"base_model {base_model!r}: the state at {path!r} was trained on {state['base']!r}")
            self.create_model(model_id, state["base"], int(state["rank"]), None, state.get("parts", "attn,mlp,unembed"))
        self._apply_state(model_id, state, optimizer, path)

    def _apply_state(self, model_id: str, state: Mapping[str, Any], optimizer: bool, path: str) -> None:
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
        adapters' (summed over the data, like the loss).

        A chunk of data is one right-padded forward, one log_softmax and gather over it,
        and one loss over its real tokens packed end to end (the losses are sums over
        tokens, so a chunk's loss is the sum of its data's); only data whose targets are
        scored over recorded kept sets take a step of their own."""
        import torch

        tm = self.model(model_id)
        base = self.bases[tm.base]
        config = loss_config(loss_fn, config)
        _check_data(data, loss_fn, base.context, base.vocab)
        backend = tm.backend
        module, device = backend.module, backend.device
        plans = self.replay_plans(tm, data, device)  # R3 from the provenance spans, checked before any gradient
        keys = [k for k in LOSS_INPUTS[loss_fn] if k != "target_tokens"]
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total = 0.0
        grad = torch.enable_grad() if not forward_only else torch.no_grad()
        with grad:
            for chunk in _chunks(data, plans, base.vocab):
                # One forward for the chunk: right-padded rows (a causal model's real positions
                # never see the padding), or the datum alone when its routes are forced.
                lengths = np.fromiter((len(data[i]["tokens"]) for i in chunk), dtype=np.int64, count=len(chunk))
                width = int(lengths.max())
                real = np.arange(width)[None, :] < lengths[:, None]  # [B, W]: the chunk's real positions
                ids = np.zeros((len(chunk), width), dtype=np.int64)
                ids[real] = np.concatenate([data[i]["tokens"] for i in chunk])
                targets = np.zeros((len(chunk), width), dtype=np.int64)
                targets[real] = np.concatenate([data[i]["inputs"]["target_tokens"] for i in chunk])
                kwargs = {}
                if width * len(chunk) != int(lengths.sum()):
                    kwargs["attention_mask"] = torch.as_tensor(real, dtype=torch.long, device=device)
                with plans[chunk[0]] if len(chunk) == 1 else contextlib.nullcontext():
                    all_logits = module(input_ids=torch.as_tensor(ids, device=device), **kwargs).logits.float()
                targets_t = torch.as_tensor(targets, device=device)
                real_t = torch.as_tensor(real, device=device)
                padded = torch.log_softmax(all_logits, dim=-1).gather(-1, targets_t[..., None])[..., 0]
                logprobs = padded[real_t]  # [T]: the chunk's real tokens, datum after datum
                if any(plans[i].sets for i in chunk):  # over the sampler's kept sets, where recorded
                    pieces = list(torch.split(logprobs, lengths.tolist()))
                    for row, i in enumerate(chunk):
                        if plans[i].sets:
                            n = int(lengths[row])
                            pieces[row] = plans[i].logprobs(all_logits[row, :n], targets_t[row, :n], pieces[row])
                    logprobs = torch.cat(pieces)
                inputs = {k: np.concatenate([np.asarray(data[i]["inputs"][k], dtype=np.float32).reshape(-1)
                                             for i in chunk]) for k in keys}
                elementwise, loss = loss_terms(loss_fn, logprobs, inputs, config, device, self.host)
                total += float(loss.detach())
                if not forward_only:
                    loss.backward()
                bounds = np.cumsum(lengths)[:-1]
                lp = np.split(logprobs.detach().cpu().numpy().astype(np.float32, copy=False), bounds)
                el = np.split(elementwise.detach().cpu().numpy().astype(np.float32, copy=False), bounds)
                for row, i in enumerate(chunk):
                    outputs[i] = {"logprobs": lp[row], "elementwise_loss": el[row]}
        return outputs, {"loss:sum": total, **self.replay_metrics(plans)}

    def optim_step(self, model_id: str, adam: Mapping[str, float]) -> dict[str, float]:
        import torch

        tm = self.model(model_id)
        if tm.grads_lost:
            tm.grads_lost = False
            tm.optimizer.zero_grad(set_to_none=True)
            raise BadRequest(f"model {model_id!r}: the gradients of its forward_backward calls since its last optim_step "
                             "were lost in a server restart; this step did not run (the gradients are cleared): "
                             "run forward_backward again, then optim_step", status=409)
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


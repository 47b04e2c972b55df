"""Sampler weights and sampling through a base model's engine.

**Sampler weights** are a snapshot of a model's adapters (CPU copies + config), kept
in memory under a sampling-session id and, when saved by name, written to the
storage root; sampling swaps them into the base's engine (``update_adapter``).
Mixed into :class:`skyrl_server._service.Service`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from skyrl_server._errors import BadRequest


@attrs.define
class SamplerWeights:
    base: str
    tensors: dict[str, Any]  # CPU float32
    config: dict[str, Any]
    key: int  # unique per snapshot



class SamplingMixin:
    """The sampling half of :class:`skyrl_server._service.Service`."""

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

    def _serve(self, base: Any, weights: SamplerWeights) -> None:
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

    def _prompt_logprobs(self, base: Any, prompt: list[int]) -> np.ndarray:
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

"""Sampler weights and sampling through a base model's continuous batcher.

**Sampler weights** are a snapshot of a model's adapters (CPU copies + config), kept
in memory under a sampling-session id and, when saved by name, written to the
storage root. **Sampling** goes to one :class:`skyrl_engines.continuous.ContinuousBatcher`
per base model (its own decode thread, not the server's worker): requests of every
client and adapter decode together, each row with its own adapter, parameters and
random stream, and a request that arrives while others decode joins at the next step.
**Admission control**: a request whose tokens (prompt + max_tokens, per sample) would
take the tokens queued or decoding past ``[server] max_queued_tokens`` is answered 429
at once (the SDK backs off and sends it again); one that could never fit is a user error.
Mixed into :class:`skyrl_server._service.Service`.
"""

from __future__ import annotations

import concurrent.futures
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
    adapter: Any = None  # the batcher's Adapter for these tensors, made at the first sample



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

    def batcher(self, base: Any) -> Any:
        """The base model's continuous batcher (made at its first sample)."""
        batchers = self.batchers
        if base.name not in batchers:
            from skyrl_engines.continuous import ContinuousBatcher

            if getattr(base.engine, "model", None) is None or not hasattr(base.engine, "adapters"):
                raise BadRequest(f"sampling {base.name!r} needs the embedded engine ([engine] name = \"embedded\")")
            batchers[base.name] = ContinuousBatcher(base.engine)
        return batchers[base.name]

    def queued_tokens(self) -> int:
        """Tokens (prompt + max_tokens per sample) of the sampling requests waiting or decoding."""
        return sum(b.queued_tokens for b in list(self.batchers.values()))

    def submit_sample(self, sampling_session_id: str, prompt: Sequence[int], n: int, params: Mapping[str, Any],
                      prompt_logprobs: bool, last_n: int | None = None, record: bool = False, topk_sample: int = 0,
                      topk_prompt: int = 0) -> concurrent.futures.Future:
        """Queue ``n`` sequences in the base's batcher; the future's result: ``{"sequences":
        [{tokens, logprobs, stop_reason ("stop" | "length")}], "prompt_logprobs"}``. Raises
        :class:`BadRequest` for bad input (429: the queue is full now). ``record``
        (``record_stability_info``): the sequences also carry what replay needs (their
        kept sets, and routes on a MoE base) for :meth:`keep_for_replay`. ``topk_sample`` /
        ``topk_prompt``: the k most likely tokens and their logprobs at each sampled /
        prompt position ("topk" per sequence, "prompt_topk")."""
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
        stop_tokens, stop_strings = _stops(params.get("stop"))
        if any(t < 0 or t >= base.vocab for t in stop_tokens):
            raise BadRequest(f"sampling_params.stop: a token id outside the vocabulary (0..{base.vocab - 1})")
        if stop_strings and base.loaded.tokenizer is None:
            raise BadRequest("sampling_params.stop: stop strings need a tokenizer, and this model has none")
        temperature, top_k, top_p = _sampling_values(params)
        if top_k >= base.vocab:  # keeps every token: the same as off (and no top-k over more than the vocabulary)
            top_k = 0
        seed = params.get("seed")
        if seed is not None and not 0 <= int(seed) < 2**63:
            raise BadRequest(f"sampling_params.seed must be in [0, 2**63), found {seed}")
        seed = int(seed) if seed is not None else int(np.random.default_rng().integers(0, 2**31 - 1))
        batcher = self.batcher(base)
        limit = int(self.spec.server.max_queued_tokens)
        cost = batcher.cost(len(prompt), n, max_tokens)
        if cost > limit:
            raise BadRequest(f"this request needs {cost} tokens (prompt + max_tokens, per sample), more than the "
                             f"server's max_queued_tokens ({limit}): ask for fewer samples or tokens")
        queued = self.queued_tokens()
        if queued + cost > limit:
            raise BadRequest(f"busy: {queued} tokens of sampling requests are queued or decoding, and this one needs "
                             f"{cost} more than max_queued_tokens ({limit}) allows; try again", status=429)
        if weights.tensors and weights.adapter is None:
            from skyrl_engines.continuous import Adapter

            weights.adapter = Adapter(weights.key, weights.tensors, weights.config, weights.key)
        inner = batcher.submit(prompt, n=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                               max_tokens=max_tokens, stop_token_ids=stop_tokens, stop_strings=stop_strings,
                               adapter=weights.adapter, prompt_logprobs=prompt_logprobs, record=record,
                               topk_sample_logprobs=topk_sample, topk_prompt_logprobs=topk_prompt)
        if last_n is None or not (prompt_logprobs or topk_prompt):
            return inner
        outer: concurrent.futures.Future = concurrent.futures.Future()

        def done(f: concurrent.futures.Future) -> None:
            if f.exception() is not None:
                outer.set_exception(f.exception())
                return
            result = dict(f.result())
            cut = max(len(prompt) - last_n, 0)  # only the last N are scored
            if result.get("prompt_logprobs") is not None:
                result["prompt_logprobs"] = result["prompt_logprobs"].copy()
                result["prompt_logprobs"][:cut] = np.nan
            if result.get("prompt_topk") is not None:
                ids, lps = (a.copy() for a in result["prompt_topk"])
                ids[:cut], lps[:cut] = 0, -99999.0  # the SDK's empty entry
                result["prompt_topk"] = (ids, lps)
            outer.set_result(result)

        inner.add_done_callback(done)
        return outer

    def keep_for_replay(self, result: Mapping[str, Any], prompt: Sequence[int], sequence_ids: Sequence[str],
                        temperature: float) -> None:
        """Keep a recorded sample's sequences (routes, kept sets) under their ids for R3 and
        support replay (:mod:`skyrl_server._stability`); any thread."""
        store = getattr(self, "route_store", None)
        if store is None:
            return
        from skyrl_host.rollout import CSR
        from skyrl_server._stability import RouteRecord

        prompt = np.asarray(prompt, dtype=np.int64)
        for sequence_id, seq in zip(sequence_ids, result["sequences"]):
            if "kept" not in seq:
                continue
            store.put(sequence_id, RouteRecord(prompt, result.get("prompt_routes"), seq["tokens"].astype(np.int64),
                                               seq.get("routes"), CSR.from_rows(seq["kept"]),
                                               float(temperature) if temperature > 0 else 1.0))

    def sample(self, sampling_session_id: str, prompt: Sequence[int], n: int, params: Mapping[str, Any],
               prompt_logprobs: bool, last_n: int | None = None) -> dict[str, Any]:
        """:meth:`submit_sample`, waited for."""
        return self.submit_sample(sampling_session_id, prompt, n, params, prompt_logprobs, last_n).result()


def _sampling_values(params: Mapping[str, Any]) -> tuple[float, int, float]:
    """(temperature, top_k (0: off), top_p) of a request's sampling_params, checked."""
    temperature = float(params.get("temperature", 1.0))
    top_k = int(params.get("top_k", -1))
    top_p = float(params.get("top_p", 1.0))
    if not math.isfinite(temperature) or temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, found {temperature}")
    if not 0 < top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], found {top_p}")
    if top_k < -1 or top_k == 0:
        raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1, found {top_k}")
    return temperature, max(top_k, 0), top_p


def _stops(stop: Any) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings) of sampling_params.stop."""
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [], [stop]
    if isinstance(stop, list):
        if all(isinstance(s, str) for s in stop):
            return [], list(stop)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            return list(stop), []
    raise BadRequest("sampling_params.stop: expected a string, a list of strings or a list of token ids")


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

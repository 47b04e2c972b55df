"""The sampling routes (create_sampling_session, samplers/{id}, asample), mixed into
:class:`skyrl_server._app.App`: sampling futures live in memory only."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import traceback
from typing import Any

from aiohttp import web

from skyrl_server import _wire
from skyrl_server._errors import BadRequest
from skyrl_server._http import _get

log = logging.getLogger("skyrl.serve")


class SamplingRoutes:
    """The sampling half of the App's routes (``self`` is the App)."""

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        session_id = _get(body, "session_id", str)
        tenant = request["tenant"]
        self._session(session_id, tenant)
        seq = _get(body, "sampling_session_seq_id", int)
        base = _get(body, "base_model", str, required=False)
        path = _get(body, "model_path", str, required=False)
        if (base is None) == (path is None):
            raise BadRequest("create_sampling_session takes exactly one of base_model and model_path")
        self._readable(path, tenant)
        sampling_id = f"{session_id}:sample:{seq}"
        served = await self._compute(lambda: self.service.open_sampler(sampling_id, base, path))
        self.sampling_sessions[sampling_id] = {"base_model": served, "model_path": path, "tenant": tenant}
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampling_id})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sampler_id = request.match_info["sampler_id"]
        if self.sampling_sessions.get(sampler_id, {}).get("tenant") != request["tenant"]:
            raise BadRequest(f"unknown sampler {sampler_id!r}", status=404)
        info = self.sampling_sessions[sampler_id]
        return web.json_response({"sampler_id": sampler_id, "base_model": info["base_model"], "model_path": info["model_path"]})

    async def asample(self, request: web.Request) -> web.Response:
        """Queue a sampling request in its base's continuous batcher (not the worker
        thread) and answer at once with its future and ``sample_sequence_ids``; 429 when
        the queued tokens are at ``[server] max_queued_tokens``."""
        body = await self._json(request)
        tenant = request["tenant"]
        sampling_id = _get(body, "sampling_session_id", str, required=False)
        if sampling_id is None:
            base = _get(body, "base_model", str, required=False)
            path = _get(body, "model_path", str, required=False)
            if (base is None) == (path is None):
                raise BadRequest("asample takes a sampling_session_id, a base_model or a model_path")
            self._readable(path, tenant)
            # One sampler entry per base model or path, shared by every such request.
            sampling_id = f"base:{base}" if base is not None else f"path:{path}"
            if sampling_id not in self.service.samplers:
                if base is not None:
                    self.service.open_sampler(sampling_id, base, None)
                else:
                    await self._compute(lambda: self.service.open_sampler(sampling_id, None, path))
        elif sampling_id not in self.service.samplers or \
                self.sampling_sessions.get(sampling_id, {}).get("tenant") != tenant:
            raise BadRequest(f"unknown sampling_session_id {sampling_id!r}", status=404)
        n = _get(body, "num_samples", int, required=False, default=1)
        prompt = _get(body, "prompt", dict)
        chunks = _get(prompt, "chunks", list)
        tokens: list[int] = []
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
                raise BadRequest(f"prompt.chunks[{i}]: only encoded_text chunks are served")
            ids = _get(chunk, "tokens", list)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest(f"prompt.chunks[{i}].tokens: expected a list of token ids")
            tokens += ids
        params = dict(_get(body, "sampling_params", dict))
        for key, kind in (("max_tokens", int), ("seed", int), ("temperature", float), ("top_k", int), ("top_p", float)):
            value = _get(params, key, kind, required=False)
            if value is None:
                params.pop(key, None)
            else:
                params[key] = value
        prompt_logprobs = bool(_get(body, "prompt_logprobs", bool, required=False, default=False))
        last_n = _get(body, "prompt_logprobs_last_n", int, required=False)
        if last_n is not None and last_n < 0:
            raise BadRequest(f"prompt_logprobs_last_n must be >= 0, found {last_n}")
        if not 1 <= n <= 1024:
            raise BadRequest(f"num_samples must be in [1, 1024], found {n}")
        if params.get("max_tokens", 1) < 1:
            raise BadRequest(f"sampling_params.max_tokens must be at least 1, found {params['max_tokens']}")
        record = bool(_get(body, "record_stability_info", bool, required=False, default=False))
        topk = {}
        for key in ("topk_sample_logprobs", "topk_prompt_logprobs"):
            topk[key] = _get(body, key, int, required=False, default=0) or 0
            if not 0 <= topk[key] <= 1024:
                raise BadRequest(f"{key} must be in [0, 1024], found {topk[key]}")
        self._room(tenant)  # before the batcher takes it
        try:
            inner = self.service.submit_sample(sampling_id, tokens, n, params, prompt_logprobs, last_n, record,
                                               topk["topk_sample_logprobs"], topk["topk_prompt_logprobs"])
        except BadRequest as exc:
            if exc.status == 429:
                raise  # answered at once: the SDK backs off and sends it again
            inner = None
            error = {"error": exc.message, "category": "user"}
        request_id, future = self._new_future(tenant)
        ids = [f"{request_id}:{i}" for i in range(n)]
        if inner is None:
            future.finish("error", error)
        else:
            keep = None
            if record:  # routes and kept sets kept for replay under the sequence ids
                temperature = float(params.get("temperature", 1.0))
                keep = lambda result: self.service.keep_for_replay(result, tokens, ids, temperature)  # noqa: E731
            inner.add_done_callback(_settle_sample(asyncio.get_running_loop(), future, keep))
        return web.json_response({"request_id": request_id, "sample_sequence_ids": ids})


def _settle_sample(loop: asyncio.AbstractEventLoop, future: Any, keep: Any = None):
    """A done-callback (run on the batcher's thread): the result encoded there, the
    server's future finished on the event loop."""

    def done(inner: concurrent.futures.Future) -> None:
        exc = inner.exception()
        if exc is None:
            try:
                if keep is not None:
                    keep(inner.result())
                outcome = ("proto", _wire.sample_response(inner.result()))
            except Exception as err:  # noqa: BLE001 - a fault: answered as the server's
                log.error("encoding a sample failed:\n%s", traceback.format_exc())
                outcome = ("error", {"error": f"{type(err).__name__}: {err}".splitlines()[0], "category": "server"})
        elif isinstance(exc, (ValueError, BadRequest)):  # the request's own (its adapter does not fit, ...)
            outcome = ("error", {"error": str(exc).splitlines()[0], "category": "user"})
        else:
            log.error("sampling failed: %s", exc)
            outcome = ("error", {"error": f"{type(exc).__name__}: {exc}".splitlines()[0], "category": "server"})
        try:
            loop.call_soon_threadsafe(future.finish, *outcome)
        except RuntimeError:  # the server's loop is closed: nobody is waiting
            pass

    return done

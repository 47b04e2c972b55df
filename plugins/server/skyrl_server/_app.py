"""The aiohttp application: the routes the tinker SDK 0.38 calls, under ``/api/v1``.

Work that computes (create_model, forward_backward, optim_step, save_weights_for_sampler,
asample) is answered at once with a future (``request_id``); the computation runs on
one worker thread; ``retrieve_future`` waits for it at most ``[server] poll_seconds``
and then answers ``try_again`` (the SDK polls again). A model's requests run in
``seq_id`` order; the same ``(model_id, seq_id)`` sent again gets the first one's
future and runs once. Bad input is a 4xx with a one-line ``{"error": ...}``.

Durability (:mod:`skyrl_server._store`): sessions, models and every finished training
future are written to ``[server] database`` on the worker thread before the future
finishes (one transaction per request); an optim_step first writes its model's adapters,
optimizer state and steps to the storage root. After a restart (even a SIGKILL) the
server comes back with them: models from their last durable state, finished futures
retrievable by request_id, each model's seq_id order. A request that had not finished
at the crash did not happen (nothing of it was kept): retrieve_future answers it with an
error saying so, and the same ``(model_id, seq_id)`` sent again runs it. Gradients of
acknowledged forward_backward calls are not persisted: after a restart the model's next
optim_step fails with a user error (409) saying they were lost (it never steps with
part of them). Sampling futures and sampling sessions live in memory only.

Tenants: each API key is a tenant, or belongs to the ``[tenants.NAME]`` group that lists it.
A session belongs to the tenant that created it; its models, their checkpoints and sampler
weights, sampling sessions and every future belong to the same tenant. Another tenant's
session, model, checkpoint, sampler or request id is answered 404 as if it did not exist;
a checkpoint its tenant published (the SDK's ``publish_checkpoint_from_tinker_path``) can
be read (sampled from, loaded into a new model) by every tenant. Each tenant holds at most
``max_models`` loaded models (403 past it) and ``max_in_flight`` unfinished futures (429).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import time
import traceback
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from skyrl_server import _wire
from skyrl_server._errors import BadRequest
from skyrl_server._http import _body_json, _get
from skyrl_server._sample_routes import SamplingRoutes
from skyrl_server._service import Service
from skyrl_server._training import LORA_PARTS
from skyrl_server._storage import sampler_path
from skyrl_server._store import Loaded, Record, Store, model_row

log = logging.getLogger("skyrl.serve")
OPEN_ROUTES = {"/api/v1/healthz"}


KEEP_SECONDS = 900.0  # a finished future's result stays retrievable this long (the SDK retries a lost poll)
MAX_SEQ_AHEAD = 1 << 20  # how far past the last seq_id run a model's next request may be


class Future:
    __slots__ = ("event", "kind", "value", "finished_at", "tenant", "on_finish")

    def __init__(self, tenant: str | None = None) -> None:
        self.event = asyncio.Event()
        self.kind = ""  # "json" | "proto" | "error"
        self.value: Any = None
        self.finished_at = 0.0
        self.tenant = tenant  # who may retrieve it
        self.on_finish: Callable[[], None] | None = None

    def finish(self, kind: str, value: Any) -> None:
        if self.event.is_set():
            return
        self.kind, self.value = kind, value
        self.finished_at = time.monotonic()
        self.event.set()
        if self.on_finish is not None:
            self.on_finish()


class ModelQueue:
    """Runs one model's jobs in seq_id order: the next one when it arrives, or the
    smallest waiting one after ``wait`` seconds without its predecessor."""

    def __init__(self, wait: float):
        self.wait = wait
        self.last = 0  # the highest seq_id started
        self.pending: dict[int, Callable[[], Awaitable[None]]] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def submit(self, seq_id: int, job: Callable[[], Awaitable[None]]) -> None:
        self.pending[seq_id] = job
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.pending:
            nxt = min(self.pending)
            if nxt != self.last + 1:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), self.wait)
                    continue  # something arrived: look again
                except asyncio.TimeoutError:
                    nxt = min(self.pending)
            job = self.pending.pop(nxt)
            self.last = max(self.last, nxt)
            await job()


class App(SamplingRoutes):
    """State of one server: sessions, futures, the models' queues, the worker thread, and
    the durable store they are kept in (``loaded``: what it held at start)."""

    def __init__(self, spec: Any, service: Service, store: Store, loaded: Loaded):
        self.spec = spec
        self.service = service
        self.store = store
        self.boot = loaded.boot  # request ids start with it
        self.past_boots = {b: t for b, t in loaded.boots.items() if b != loaded.boot}
        from skyrl_server._config import key_tenant

        of_key = dict(spec.tenants.of_key) or {k: key_tenant(k) for k in spec.api_keys}
        self.keys = [(k.encode(), tenant) for k, tenant in of_key.items()]
        self.sessions: dict[str, dict[str, Any]] = {
            sid: {"finished": done, "tenant": tenant} for sid, (done, tenant) in loaded.sessions.items()
        }
        # Every model ever made (unloaded ones too: their checkpoints outlive them) -> its tenant.
        self.owners: dict[str, str | None] = {
            row["id"]: self.sessions.get(row["session_id"], {}).get("tenant") for row in loaded.models
        }
        self.checkpoints: dict[str, tuple[str, bool]] = dict(loaded.checkpoints)  # path -> (model_id, public)
        self.in_flight: dict[str, int] = {}  # tenant -> its unfinished futures
        self.futures: dict[str, Future] = {}
        self.seen: dict[tuple[str, int], str] = {}  # (model_id, seq_id) -> request_id
        self.queues: dict[str, ModelQueue] = {}
        self.sampling_sessions: dict[str, dict[str, Any]] = {}
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyrl-serve")
        self.creating: set[str] = set()
        now, wall = time.monotonic(), time.time()
        for f in loaded.futures:
            future = Future(f["tenant"])
            future.finish(f["kind"], f["value"])
            future.finished_at = now - max(0.0, wall - f["finished"])
            self.futures[f["request_id"]] = future
            if f["model_id"] is not None and f["seq_id"] is not None:
                self.seen[(f["model_id"], f["seq_id"])] = f["request_id"]
        self.durable = {row["id"]: row["state"] for row in loaded.models}  # the state file each row names
        for row in loaded.models:
            if row["last_seq"]:
                self.queues[row["id"]] = queue = ModelQueue(spec.server.order_wait_seconds)
                queue.last = row["last_seq"]

    # -- plumbing ----------------------------------------------------------------

    def _tenant_of(self, request: web.Request) -> str | None:
        """The tenant of the request's key (every key compared in constant time), or None."""
        key = request.headers.get("X-API-Key", "").encode()
        found = None
        for k, tenant in self.keys:
            if hmac.compare_digest(key, k):
                found = tenant
        return found

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        tenant = self._tenant_of(request)
        if request.path not in OPEN_ROUTES and tenant is None:
            return web.json_response({"error": "missing or wrong X-API-Key"}, status=401)
        request["tenant"] = tenant
        try:
            return await handler(request)
        except BadRequest as exc:
            return web.json_response({"error": exc.message}, status=exc.status)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return web.json_response({"error": f"{exc.reason}: {request.method} {request.path}"}, status=exc.status)
            raise

    async def _json(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object: at most ``max_json_bytes`` (413), parsed in a thread when large."""
        raw = await request.read()
        limit = int(self.spec.server.max_json_bytes)
        if len(raw) > limit:
            raise BadRequest(f"the body has {len(raw)} bytes, more than the {limit} a JSON request may have", status=413)
        return _body_json(raw) if len(raw) <= 1 << 16 else await asyncio.to_thread(_body_json, raw)

    async def _compute(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn)

    def _room(self, tenant: str) -> None:
        """429 when ``tenant`` has ``max_in_flight`` unfinished futures."""
        limit = self.spec.tenant_limits(tenant)[1]
        if self.in_flight.get(tenant, 0) >= limit:
            raise BadRequest(f"this tenant has {limit} requests in flight, the most the server allows it "
                             "(max_in_flight): wait for some to finish", status=429)

    def _new_future(self, tenant: str) -> tuple[str, Future]:
        """A new future of ``tenant``'s (:meth:`_room` first)."""
        self._room(tenant)
        if len(self.futures) % 1024 == 1023:
            self._forget_old_futures()
        request_id = self.boot + uuid.uuid4().hex[:24]
        future = Future(tenant)
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1

        def finished() -> None:
            self.in_flight[tenant] -= 1

        future.on_finish = finished
        self.futures[request_id] = future
        return request_id, future

    # -- ownership -----------------------------------------------------------------------

    def _model_of(self, model_id: Any, tenant: str) -> str:
        """``model_id`` when it is one of ``tenant``'s models (loaded or being made), else 404
        as for a model that does not exist."""
        if not isinstance(model_id, str) or self.owners.get(model_id) != tenant or (
                model_id not in self.service.models and model_id not in self.creating):
            raise BadRequest(f"unknown model_id {model_id!r}", status=404)
        return model_id

    def _readable(self, path: Any, tenant: str) -> None:
        """404 unless ``path`` (tinker://MODEL_ID/...) is a checkpoint of one of
        ``tenant``'s models, or one its tenant published."""
        if not isinstance(path, str):
            return  # the route's own check says what is wrong
        model_id = path[len("tinker://"):].partition("/")[0] if path.startswith("tinker://") else None
        if model_id is None:
            return
        if self.owners.get(model_id) == tenant:
            return
        saved = self.checkpoints.get(path)
        if saved is None or not saved[1]:
            raise BadRequest(f"unknown checkpoint {path!r}", status=404)

    def _forget_old_futures(self) -> None:
        """Drop results finished more than KEEP_SECONDS ago (memory stays bounded by the recent rate)."""
        cutoff = time.monotonic() - KEEP_SECONDS
        old = {rid for rid, f in self.futures.items() if f.event.is_set() and f.finished_at < cutoff}
        for rid in old:
            del self.futures[rid]
        self.seen = {k: rid for k, rid in self.seen.items() if rid not in old}
        self.worker.submit(self._forget_stored, time.time() - KEEP_SECONDS)

    def _forget_stored(self, before: float) -> None:
        try:
            self.store.forget(before)
        except Exception:  # noqa: BLE001 - the next sweep tries again
            log.error("could not delete old futures from the database:\n%s", traceback.format_exc())

    async def _settle(self, future: Future, kind: str, fn: Callable[[], Any], record: Record | None = None) -> None:
        """Run ``fn`` on the worker and finish ``future`` with its result or error; with
        ``record`` (a training request), first store the outcome durably (same thread)."""

        def run() -> tuple[str, Any]:
            try:
                out = (kind, fn())
            except BadRequest as exc:
                out = ("error", {"error": exc.message, "category": "user"})
            except Exception as exc:  # noqa: BLE001 - a fault: logged with its traceback, answered as the server's
                log.error("request failed:\n%s", traceback.format_exc())
                out = ("error", {"error": f"{type(exc).__name__}: {exc}".splitlines()[0], "category": "server"})
            if record is not None:
                if out[0] == "error":
                    record.new_model = record.checkpoint = record.after = record.undo = None
                record.kind, record.value = out
                try:
                    self.store.record(record)
                except Exception as exc:  # noqa: BLE001 - not kept: the client must not take it as done
                    log.error("could not store request %s:\n%s", record.request_id, traceback.format_exc())
                    if record.undo is not None:
                        record.undo()
                    return ("error", {"error": f"the result could not be stored durably ({type(exc).__name__}: "
                                               f"{exc}".splitlines()[0] + ")", "category": "server"})
                if "state" in record.changes:
                    self.durable[record.model_id] = record.changes["state"]
                if record.checkpoint is not None:
                    self.checkpoints[record.checkpoint[0]] = (record.model_id, False)  # saved again: private
                if record.after is not None:
                    try:
                        record.after()
                    except Exception:  # noqa: BLE001 - a stale file, deleted at the next start
                        log.warning("after storing request %s:\n%s", record.request_id, traceback.format_exc())
            return out

        future.finish(*await self._compute(run))

    def _model_future(self, model_id: str, seq_id: int | None, kind: str,
                      fn: Callable[[Record], Any], tenant: str) -> dict[str, Any]:
        """A future for a model's request, run in seq_id order (a repeated seq_id: the
        first's future); ``fn(record)`` computes it and notes what the store must keep."""
        self._model_of(model_id, tenant)
        if seq_id is not None:
            if seq_id < 1:
                raise BadRequest(f"seq_id must be >= 1, found {seq_id}")
            known = self.seen.get((model_id, seq_id))
            if known is not None:
                return {"request_id": known, "model_id": model_id}
            queue = self.queues.setdefault(model_id, ModelQueue(self.spec.server.order_wait_seconds))
            if seq_id <= queue.last:
                raise BadRequest(f"seq_id {seq_id} arrived after seq_id {queue.last} of model {model_id!r} ran")
            if seq_id > queue.last + MAX_SEQ_AHEAD:  # the SDK counts up from 1; a leap would strand later calls
                raise BadRequest(f"seq_id {seq_id} is more than {MAX_SEQ_AHEAD} past the last one of model "
                                 f"{model_id!r} that ran ({queue.last})")
        request_id, future = self._new_future(tenant)
        record = Record(request_id, model_id, seq_id, tenant=tenant)
        if seq_id is None:
            asyncio.get_running_loop().create_task(self._settle(future, kind, lambda: fn(record), record))
        else:
            self.seen[(model_id, seq_id)] = request_id
            queue.submit(seq_id, lambda: self._settle(future, kind, lambda: fn(record), record))
        return {"request_id": request_id, "model_id": model_id}

    # -- session routes ---------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response({"proto_compress_fwdbwd": True, "sample_use_retrieve_futures": False,
                                  "sample_join_sampling_session": False, "pjwt_auth_enabled": False})

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def create_session(self, request: web.Request) -> web.Response:
        (await self._json(request))
        session_id = uuid.uuid4().hex
        tenant = request["tenant"]
        await self._compute(lambda: self.store.add_session(session_id, tenant))
        self.sessions[session_id] = {"finished": False, "tenant": tenant}
        return web.json_response({"type": "create_session", "session_id": session_id})

    def _session(self, session_id: Any, tenant: str) -> dict[str, Any]:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session["tenant"] != tenant:  # another tenant's: as if it did not exist
            raise BadRequest(f"unknown session_id {session_id!r}", status=404)
        return session

    async def heartbeat(self, request: web.Request) -> web.Response:
        session = self._session((await self._json(request)).get("session_id"), request["tenant"])
        if session["finished"]:
            raise BadRequest("session finished", status=410)
        return web.json_response({"type": "session_heartbeat"})

    async def telemetry(self, request: web.Request) -> web.Response:
        (await self._json(request))
        return web.json_response({"status": "accepted"})

    async def finish(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        session = self._session(session_id, request["tenant"])
        if not session["finished"]:
            await self._compute(lambda: self.store.finish_session(session_id))
            session["finished"] = True
        return web.json_response({})

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response({"supported_models": self.service.capabilities()})

    # -- training ---------------------------------------------------------------------

    async def create_model(self, request: web.Request) -> web.Response:
        body = (await self._json(request))
        session_id = _get(body, "session_id", str)
        tenant = request["tenant"]
        self._session(session_id, tenant)
        model_seq_id = _get(body, "model_seq_id", int)
        base = _get(body, "base_model", str)
        self.service.base(base)
        lora = _get(body, "lora_config", dict, required=False)
        if lora is None:
            raise BadRequest("lora_config: missing (this server trains LoRA adapters only)")
        rank = _get(lora, "rank", int)
        limit = self.spec.server.max_lora_rank
        if not 1 <= rank <= limit:
            raise BadRequest(f"lora_config.rank must be in [1, {limit}] on this server, found {rank}")
        seed = _get(lora, "seed", int, required=False)
        flags = {part: _get(lora, f"train_{part}", bool, required=False, default=True) for part in LORA_PARTS}
        parts = ",".join(part for part in LORA_PARTS if flags[part])
        if not parts:
            raise BadRequest("lora_config: train_attn, train_mlp and train_unembed are all false: nothing to train")

        def run(model_id: str, record: Record) -> dict[str, Any]:
            self.service.create_model(model_id, base, rank, seed, parts)
            record.new_model = model_row(model_id, session_id, base, rank, self.service.models[model_id].seed, parts)
            return {"model_id": model_id, "type": "create_model"}

        return web.json_response(self._new_model(session_id, model_seq_id, run, tenant))

    def _new_model(self, session_id: str, model_seq_id: int, run: Callable[[str, Record], Any],
                   tenant: str) -> dict[str, Any]:
        """A future for a request that makes model ``{session_id}:train:{model_seq_id}``
        (create_model, or load_weights from a state): ``run(model_id, record)`` on the worker;
        403 when ``tenant`` holds its ``max_models`` already."""
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.service.models or model_id in self.creating:
            raise BadRequest(f"model {model_id!r} exists (model_seq_id {model_seq_id} was used in this session)", status=409)
        limit = self.spec.tenant_limits(tenant)[0]
        held = sum(1 for m in (*self.service.models, *self.creating) if self.owners.get(m) == tenant)
        if held >= limit:
            raise BadRequest(f"this tenant holds {held} models, the most the server allows it (max_models): unload "
                             "one first", status=403)
        request_id, future = self._new_future(tenant)
        self.creating.add(model_id)
        self.owners[model_id] = tenant
        record = Record(request_id, model_id, None, tenant=tenant)

        async def create() -> None:
            await self._settle(future, "json", lambda: run(model_id, record), record)
            self.creating.discard(model_id)

        asyncio.get_running_loop().create_task(create())
        return {"request_id": request_id, "model_id": model_id}

    async def get_info(self, request: web.Request) -> web.Response:
        model_id = self._model_of(_get((await self._json(request)), "model_id", str), request["tenant"])
        tm = self.service.model(model_id)
        return web.json_response({
            "type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": tm.rank, "model_name": tm.base,
            "model_data": {"arch": self.spec.models[tm.base].name, "model_name": tm.base, "tokenizer_id": None},
        })

    async def unload_model(self, request: web.Request) -> web.Response:
        model_id = self._model_of(_get((await self._json(request)), "model_id", str), request["tenant"])
        self.service.model(model_id)

        def run(record: Record) -> dict[str, Any]:
            self.service.unload(model_id)
            record.changes["unloaded"] = True
            return {"model_id": model_id, "type": "unload_model"}

        return web.json_response(self._model_future(model_id, None, "json", run, request["tenant"]))

    async def forward_backward(self, request: web.Request) -> web.Response:
        if _wire.PROTOBUF not in request.headers.get("Content-Type", ""):
            raise BadRequest(f"forward_backward takes a protobuf ForwardBackwardRequest (Content-Type: {_wire.PROTOBUF})",
                             status=415)
        body, encoding = await request.read(), request.headers.get("Content-Encoding")
        limit = int(self.spec.server.max_body_bytes)
        # off the event loop: inflating and parsing a large body must not stall every other client
        req = await asyncio.to_thread(lambda: _wire.forward_backward_request(_wire.decompress(body, encoding, limit)))
        if not req["data"]:
            raise BadRequest("data: no datum")

        def run(record: Record) -> bytes:
            outputs, metrics = self.service.forward_backward(req["model_id"], req["data"], req["loss_fn"], req["config"],
                                                             req["forward_only"])
            if not req["forward_only"]:
                record.changes["grads"] = True  # acknowledged gradients wait for a step (not persisted)
            return _wire.forward_backward_output(outputs, metrics)

        return web.json_response(self._model_future(req["model_id"], req["seq_id"] or None, "proto", run,
                                                    request["tenant"]))

    async def optim_step(self, request: web.Request) -> web.Response:
        body = (await self._json(request))
        model_id = _get(body, "model_id", str)
        seq_id = _get(body, "seq_id", int, required=False)
        params = _get(body, "optim_params", dict, required=False) or _get(body, "adam_params", dict)
        adam = {k: _get(params, k, float, required=False)
                for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}
        adam = {k: v for k, v in adam.items() if v is not None}

        def run(record: Record) -> dict[str, Any]:
            tm = self.service.model(model_id)
            if tm.grads_lost:
                record.changes["grads"] = False  # the failed step below clears them
            had_grads = any(p.grad is not None for p in tm.params)
            metrics = self.service.optim_step(model_id, adam)
            self._keep_state(model_id, record, had_grads)
            record.changes["grads"] = False  # the step used them
            return {"metrics": metrics}

        return web.json_response(self._model_future(model_id, seq_id, "json", run, request["tenant"]))

    def _keep_state(self, model_id: str, record: Record, had_grads: bool | None) -> None:
        """(On the worker.) The model's whole state written to the storage root as its new
        durable state, and the row's columns that point at it (committed with the result).
        If the write or the commit fails, the model goes back to its last durable state, as
        after a restart (``had_grads``: gradients were waiting; None: a new model, no undo)."""
        tm = self.service.model(model_id)
        undo = None if had_grads is None else (lambda: self._roll_back(model_id, had_grads))
        try:
            file = self.service.save_durable(model_id, f"{tm.steps}-{record.request_id}")
        except BaseException:
            if undo is not None:
                undo()
            raise
        record.changes.update(state=file, steps=tm.steps)  # (load_state keeps waiting gradients)
        record.after = lambda: self.service.storage.prune_durable(model_id, file)
        record.undo = undo

    def _roll_back(self, model_id: str, grads_lost: bool) -> None:
        """The model as its last durable state has it (its change could not be kept)."""
        tm = self.service.model(model_id)
        log.warning("model %s goes back to its last durable state (its change could not be stored)", model_id)
        self.service.restore_model(model_id, tm.base, tm.rank, tm.seed, self.durable.get(model_id), grads_lost, tm.parts)

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        body = (await self._json(request))
        model_id = _get(body, "model_id", str)
        seq_id = _get(body, "seq_id", int, required=False)
        name = _get(body, "path", str, required=False)
        session_seq = _get(body, "sampling_session_seq_id", int, required=False)
        if (name is None) == (session_seq is None):
            raise BadRequest("save_weights_for_sampler takes exactly one of path and sampling_session_seq_id")
        path = sampler_path(model_id, name) if name is not None else None
        session_id = f"{model_id}:sample:{session_seq}" if session_seq is not None else None
        self._model_of(model_id, request["tenant"])
        if session_id is not None:
            self.sampling_sessions[session_id] = {"base_model": None, "model_path": None, "model_id": model_id,
                                                  "tenant": request["tenant"]}

        def run(record: Record) -> dict[str, Any]:
            self.service.save_for_sampler(model_id, session_id, path)
            base = self.service.models[model_id].base
            if path is not None:
                record.checkpoint = (path, "sampler_weights")
            if session_id is not None:
                self.sampling_sessions[session_id]["base_model"] = base
                return {"type": "save_weights_for_sampler", "sampling_session_id": session_id}
            return {"type": "save_weights_for_sampler", "path": path}

        return web.json_response(self._model_future(model_id, seq_id, "json", run, request["tenant"]))

    async def save_weights(self, request: web.Request) -> web.Response:
        body = (await self._json(request))
        model_id = _get(body, "model_id", str)
        seq_id = _get(body, "seq_id", int, required=False)
        name = _get(body, "path", str, required=False) or f"state-{uuid.uuid4().hex[:12]}"
        path = sampler_path(model_id, name, "weights")

        def run(record: Record) -> dict[str, Any]:
            self.service.save_state(model_id, path)
            record.checkpoint = (path, "weights")
            return {"type": "save_weights", "path": path}

        return web.json_response(self._model_future(model_id, seq_id, "json", run, request["tenant"]))

    async def load_weights(self, request: web.Request) -> web.Response:
        body = (await self._json(request))
        path = _get(body, "path", str)
        optimizer = _get(body, "optimizer", bool, required=False, default=False)
        model_id = _get(body, "model_id", str, required=False)
        if model_id is not None:  # into an existing model (load_state)
            seq_id = _get(body, "seq_id", int, required=False)

            def load(record: Record) -> dict[str, Any]:
                had_grads = any(p.grad is not None for p in self.service.model(model_id).params)
                self.service.load_state(model_id, path, optimizer, create=False, base_model=None)
                self._keep_state(model_id, record, had_grads)
                return {"type": "load_weights", "path": path, "model_id": model_id}

            self._readable(path, request["tenant"])
            return web.json_response(self._model_future(model_id, seq_id, "json", load, request["tenant"]))
        # a new model from the state (create_training_client_from_state[_with_optimizer])
        session_id = _get(body, "session_id", str)
        tenant = request["tenant"]
        self._session(session_id, tenant)
        self._readable(path, tenant)
        model_seq_id = _get(body, "model_seq_id", int)
        base = _get(body, "base_model", str, required=False)

        def run(model_id: str, record: Record) -> dict[str, Any]:
            self.service.load_state(model_id, path, optimizer, create=True, base_model=base)
            tm = self.service.models[model_id]
            record.new_model = model_row(model_id, session_id, tm.base, tm.rank, tm.seed, tm.parts)
            try:
                self._keep_state(model_id, record, None)
            except BaseException:
                self.service.unload(model_id)  # not kept: no model
                raise
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return web.json_response(self._new_model(session_id, model_seq_id, run, tenant))

    # -- futures ------------------------------------------------------------------------

    async def retrieve_future(self, request: web.Request) -> web.Response:
        request_id = _get((await self._json(request)), "request_id", str)
        future = self.futures.get(request_id)
        if future is not None and future.tenant != request["tenant"]:
            raise BadRequest(f"unknown request_id {request_id!r}", status=404)  # another tenant's: as if none
        if future is None:
            started = self.past_boots.get(request_id[:len(self.boot)])
            if started is not None:  # accepted before a restart, never finished: it did not happen
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
                return web.json_response({"error": f"request {request_id} is from before the server restarted (it was "
                                          f"accepted by the run started {when}) and its result is not kept: a sampling "
                                          f"request, one finished over {KEEP_SECONDS:.0f} s ago, or one that had not "
                                          "finished (then nothing of it was applied): send it again",
                                          "category": "server"})
            raise BadRequest(f"unknown request_id {request_id!r}", status=404)
        if not future.event.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(future.event.wait()), self.spec.server.poll_seconds)
            except asyncio.TimeoutError:
                return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if future.kind == "proto":
            return web.Response(body=future.value, content_type=_wire.PROTOBUF)
        return web.json_response(future.value)

    # -- sharing ------------------------------------------------------------------------

    async def publish(self, request: web.Request) -> web.Response:
        """POST (publish) or DELETE (unpublish) ``/training_runs/{run}/checkpoints/{checkpoint}/publish``:
        the owner makes a saved checkpoint readable by every tenant, or private again."""
        run_id, checkpoint = request.match_info["run_id"], request.match_info["checkpoint"]
        path = f"tinker://{run_id}/{checkpoint}"
        tenant = request["tenant"]
        saved = self.checkpoints.get(path)
        if self.owners.get(run_id) != tenant or saved is None:
            raise BadRequest(f"unknown checkpoint {path!r}", status=404)
        public = request.method == "POST"
        await self._compute(lambda: self.store.publish(path, public))
        self.checkpoints[path] = (saved[0], public)
        return web.json_response({})

    async def not_served(self, request: web.Request) -> web.Response:
        raise BadRequest(f"{request.method} {request.path} is not served by this server", status=404)


STATE = web.AppKey("state", App)


def make_app(spec: Any, service: Service, store: Store, loaded: Loaded) -> web.Application:
    state = App(spec, service, store, loaded)
    app = web.Application(middlewares=[state.middleware], client_max_size=int(spec.server.max_body_bytes))
    app[STATE] = state
    post, get = web.post, web.get
    v1 = "/api/v1"
    app.add_routes([
        get(f"{v1}/healthz", state.healthz),
        post(f"{v1}/client/config", state.client_config),
        post(f"{v1}/client/dynamic_config", state.dynamic_config),
        post(f"{v1}/create_session", state.create_session),
        post(f"{v1}/session_heartbeat", state.heartbeat),
        post(f"{v1}/telemetry", state.telemetry),
        post(f"{v1}/sessions/{{session_id}}/finish", state.finish),
        get(f"{v1}/get_server_capabilities", state.capabilities),
        post(f"{v1}/create_model", state.create_model),
        post(f"{v1}/get_info", state.get_info),
        post(f"{v1}/unload_model", state.unload_model),
        post(f"{v1}/forward_backward", state.forward_backward),
        post(f"{v1}/optim_step", state.optim_step),
        post(f"{v1}/save_weights_for_sampler", state.save_weights_for_sampler),
        post(f"{v1}/save_weights", state.save_weights),
        post(f"{v1}/load_weights", state.load_weights),
        post(f"{v1}/create_sampling_session", state.create_sampling_session),
        get(f"{v1}/samplers/{{sampler_id}}", state.get_sampler),
        post(f"{v1}/asample", state.asample),
        post(f"{v1}/retrieve_future", state.retrieve_future),
        post(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint:.+}}/publish", state.publish),
        web.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint:.+}}/publish", state.publish),
        web.route("*", "/{tail:.*}", state.not_served),
    ])
    return app


def runner(app: web.Application) -> web.AppRunner:
    """The app's runner: request bodies arrive as sent (this server decodes zstd itself,
    with a size bound; aiohttp's own decoding of zstd needs another package)."""
    return web.AppRunner(app, auto_decompress=False, access_log=None)


async def serve_forever(app: web.Application, host: str, port: int, on_start: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then close every connection."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    run = runner(app)
    await run.setup()
    await web.TCPSite(run, host, port).start()
    if on_start is not None:
        on_start()
    try:
        await stop.wait()
    finally:
        await run.cleanup()
        app[STATE].service.close()
        app[STATE].worker.shutdown(wait=True)
        app[STATE].store.close()


def build(spec: Any, host: Any) -> web.Application:
    """Load the base models and engines of ``spec``, open its database and bring back
    what it kept (sessions, models from their durable states, finished training
    futures), and make the application."""
    from skyrl_server._storage import Storage

    storage = Storage(spec.server.storage)
    service = Service(spec, storage, host)
    service.load_bases()
    store = Store(spec.database)
    loaded = store.start(KEEP_SECONDS)
    restore(service, loaded)
    return make_app(spec, service, store, loaded)


def restore(service: Service, loaded: Loaded) -> None:
    """The store's models back in ``service`` (unloaded ones and ones whose base this
    server file no longer serves are skipped); stale durable files are deleted."""
    for row in loaded.models:
        model_id = row["id"]
        if row["unloaded"]:
            service.storage.prune_durable(model_id, None)
            continue
        if row["base"] not in service.bases:
            log.warning("model %s is not restored: its base model %r is not in the server file", model_id, row["base"])
            continue
        try:
            service.restore_model(model_id, row["base"], row["rank"], row["seed"], row["state"], bool(row["grads"]),
                                  row["parts"])
        except BadRequest as exc:  # e.g. the server file now builds that base differently: kept, not served
            service.unload(model_id)
            log.warning("model %s is not restored (its stored state is kept): %s", model_id, exc.message)
            continue
        service.storage.prune_durable(model_id, row["state"])
    if loaded.models:
        log.info("restored %d models, %d sessions, %d finished futures", len(service.models), len(loaded.sessions),
                 len(loaded.futures))


__all__ = ["STATE", "build", "make_app", "runner", "serve_forever"]

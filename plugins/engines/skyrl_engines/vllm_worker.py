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

The ``skyrl`` backend is transport-agnostic: ``init_info = {"recipe": {"factory":
"module:name", "kwargs": {...}}}`` names how to build a transport's receiver (an object
with ``fetch(target)`` and ``apply(engine)``, such as ``delta``'s ``DeltaReceiver``), and
every update is a phase:

- ``{"phase": "fetch", "target": V}``: download and verify version ``V`` (nothing is
  applied; generation may go on);
- ``{"phase": "apply"}``: apply what was fetched, all or nothing: the receiver hands
  :class:`_ModelTarget` the complete new weights and it loads the tensors that changed
  into the served model (``model.load_weights``: vLLM's own loader, which fuses q/k/v and
  gate/up). If loading fails part-way, the previous version's tensors are loaded back.

Runs in vLLM's interpreter: it imports ``vllm`` only inside :func:`register` and
:func:`engine_class`, so the rest of the module imports anywhere.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

BACKEND = "skyrl"


def build_receiver(recipe: Mapping[str, Any]) -> Any:
    """The receiver a recipe names: ``{"factory": "package.module:Name", "kwargs": {...}}``."""
    try:
        target, kwargs = recipe["factory"], dict(recipe.get("kwargs") or {})
        module_name, _, attr = str(target).partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
    except (KeyError, ValueError, ImportError, AttributeError) as exc:
        raise ValueError(f"skyrl weight transfer: bad receiver recipe {dict(recipe)!r}: {exc}") from None
    return factory(**kwargs)


def _group(name: str) -> str:
    """The unit vLLM loads together: a decoder layer (names up to their first integer
    part: vLLM fuses q/k/v and gate/up inside a layer), else the tensor itself."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


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
            self.fetched: int | None = None

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            if self.receiver is not None and hasattr(self.receiver, "close"):
                self.receiver.close()
            self.receiver = build_receiver(init_info.recipe)
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

        def receive_weights(self, update_info: UpdateInfo) -> None:
            if self.receiver is None:
                raise RuntimeError("skyrl weight transfer: /init_weight_transfer_engine was not called")
            if update_info.phase == "fetch":
                self.fetched = self.receiver.fetch(update_info.target)
                return
            if update_info.phase != "apply":
                raise ValueError(f"skyrl weight transfer: unknown phase {update_info.phase!r} (fetch, apply)")
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
            if self.receiver is not None and hasattr(self.receiver, "close"):
                self.receiver.close()
            self.receiver = None

    _ENGINE_CLASS = SkyrlTransferEngine
    return SkyrlTransferEngine


_ENGINE_CLASS: type | None = None


def register() -> None:
    """vLLM's general-plugin entry point: register the ``skyrl`` weight-transfer backend
    (every vLLM process calls it, maybe more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "SkyrlTransferEngine")
    except ValueError:  # registered already, by an earlier call in this process
        pass


def __getattr__(name: str) -> Any:  # the factory's lazy loader asks for the class by name
    if name == "SkyrlTransferEngine":
        return engine_class()
    raise AttributeError(name)

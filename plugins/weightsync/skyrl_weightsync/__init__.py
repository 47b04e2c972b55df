"""skyrl-weightsync: weight transports (inproc, broadcast, delta, nixl, lora).

Each feature is one module here with its own ``skyrl`` entry point.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Callable, Iterable, Mapping


def weights_to_serve(backend: Any) -> Iterable[tuple[str, Any]]:
    """What a sender publishes: the backend's ``serving_weights()`` (with a quantized
    precision: each quantized weight as payload + ``<name>@<format>`` scales) where it
    has them, else its ``named_weights()``."""
    from skyrl_host.contracts import has
    from skyrl_host.interfaces import QuantizedServing

    return backend.serving_weights() if has(backend, QuantizedServing) else backend.named_weights()


def wire_dtype_problem(spec: Any, transport_name: str, hint: str = "") -> list[tuple[str, str]]:
    """A one-process job whose engine serves the trainer's own tensors (the model's dtype)
    must not be handed weights in another wire dtype: they would overwrite the trainer's.
    A backend whose traits say ``owns_weights`` (it trains tensors of its own making,
    never the loaded model's: ``OwnWeights``) leaves the engine the loaded model's
    tensors, which any dtype may overwrite. The (key, message) pair naming it, or nothing."""
    transport, engine, model = (spec.plugins.get(t) for t in ("weight_sync", "engine", "model"))
    if transport is None or engine is None or model is None or spec.cluster.launcher != "local":
        return []
    backend = spec.plugins.get("backend")
    if backend is not None and not isinstance(backend, tuple) and backend.traits.owns_weights:
        return []
    model_dtype = model.traits.dtype
    engine_dtype = engine.traits.dtype
    wire = transport.config.dtype
    served = model_dtype if engine_dtype == "auto" else engine_dtype
    if model_dtype and served == model_dtype and wire != model_dtype:
        return [(
            "weight_sync.dtype" if "dtype" in spec.raw.get("weight_sync", {}) else "weight_sync",
            f"the {transport_name} transport ships {wire} weights, but the engine serves the trainer's own "
            f"{model_dtype} tensors (engine.dtype = {engine_dtype!r}); set engine.dtype = \"{wire}\" so the engine "
            f"keeps its own copy{hint}",
        )]
    return []


def lazy_exports(module: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) giving each name of ``exports`` from the module
    it maps to, imported on first use: an entry-point module offers its transport's halves
    by public names while discovering the plugin imports nothing heavy."""
    exports = types.MappingProxyType(dict(exports))

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__

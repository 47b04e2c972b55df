"""skyrl-weightsync: weight transports (inproc, broadcast, delta, nixl, lora).

Each feature is one module here with its own ``skyrl`` entry point.
"""

from typing import Any, Iterable


def weights_to_serve(backend: Any) -> Iterable[tuple[str, Any]]:
    """What a sender publishes: the backend's ``serving_weights()`` (with a quantized
    precision: each quantized weight as payload + ``<name>@<format>`` scales) where it
    has them, else its ``named_weights()``."""
    serving = getattr(backend, "serving_weights", None)
    return serving() if callable(serving) else backend.named_weights()

"""Options shared by the quantized precisions (no torch import)."""

from __future__ import annotations

from typing import Any

from skyrl_host.options import option


def keep_option() -> Any:
    return option(
        help="more module names (path components, e.g. \"o_proj\") kept in high precision, beside the family's "
        "(router, embeddings, norms, output head)",
        factory=list,
    )


def create(name: str) -> Any:
    def factory(config: Any) -> Any:
        if name == "bf16":  # wherever the job builds its models (the driver, each Ray actor): no torchao
            from skyrl_precisions._torchao import hide_from_transformers

            hide_from_transformers()
        from skyrl_precisions._precision import Precision

        return Precision(name, config)

    factory.__doc__ = f"The {name!r} precision (imports torch and torchao)."
    return factory


def check(spec: Any) -> list[tuple[str, str]]:
    """Job combinations in which the engine could not serve the quantized numbers."""
    name = spec.plugins["precision"].name
    problems = []
    transport = spec.plugins.get("weight_sync")
    backend = spec.plugins.get("backend")
    rank = getattr(getattr(backend, "config", None), "lora_rank", 0) or 0
    if rank > 0 and transport is not None and transport.name not in ("lora", "inproc"):
        problems.append(("weight_sync.transport", f"precision {name!r} with LoRA (backend.lora_rank = {rank}) serves the "
                         "quantized base plus the adapters; transport {!r} would ship merged weights, quantized anew: "
                         "use transport = \"lora\" (or \"inproc\" in one process)".format(transport.name)))
    return problems

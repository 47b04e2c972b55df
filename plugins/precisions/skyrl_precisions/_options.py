"""Options shared by the quantized precisions (no torch import)."""

from __future__ import annotations

from typing import Any

from skyrl_host.options import OptionError, option


def keep_option() -> Any:
    return option(
        help="more module names (path components, e.g. \"o_proj\") kept in high precision, beside the family's "
        "(router, embeddings, norms, output head)",
        factory=list,
    )


def kernels_option(gpu: str) -> Any:
    """``kernels``: how the trainer computes the chosen layers. ``gpu``: where torchao's
    kernels for the format run (named in the help)."""
    return option(
        "auto",
        help="how the trainer computes the chosen layers: 'torchao' runs real low-precision matmuls through torchao "
        f"on the nn.Linear layers ({gpu}; stacked MoE experts stay emulated), 'emulated' fake-quantizes them "
        "(the same quantized weights and activations, on any device), 'auto' takes 'torchao' where the trainer's model "
        "is on a GPU that has the kernels, else 'emulated'",
    )


def check_kernels(config: Any) -> None:
    """Options that exclude each other, found when the job is read."""
    if config.kernels == "torchao" and not config.activations:
        raise OptionError("kernels", "\"torchao\" quantizes the layers' inputs too (torchao's low-precision matmuls "
                          "take both operands quantized): set activations = true, or kernels = \"emulated\" for "
                          "weights-only quantization")


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
    kernels = getattr(spec.plugins["precision"].config, "kernels", "emulated")
    if kernels == "torchao" and backend is not None and backend.name == "megatron":
        problems.append(("precision.kernels", "kernels = \"torchao\" swaps the torch backend's nn.Linear layers for "
                         f"torchao's; backend {backend.name!r} computes the precision with layers of its own "
                         "(emulated): use kernels = \"auto\" or \"emulated\""))
    if rank > 0 and transport is not None and transport.name not in ("lora", "inproc"):
        problems.append(("weight_sync.transport", f"precision {name!r} with LoRA (backend.lora_rank = {rank}) serves the "
                         "quantized base plus the adapters; transport {!r} would ship merged weights, quantized anew: "
                         "use transport = \"lora\" (or \"inproc\" in one process)".format(transport.name)))
    return problems

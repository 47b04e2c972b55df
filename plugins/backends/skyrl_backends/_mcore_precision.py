"""A job's precision (fp8, mxfp8, int4) on megatron-core's linear layers: the trainer
computes with exactly the numbers the engine serves.

The engine fake-quantizes the transformers model's separate weights (``q_proj``,
``k_proj``, ``v_proj``, ``gate_proj``, ...); megatron-core fuses them (``linear_qkv`` in
query-group order, ``linear_fc1`` = ``[gate; up]``) and splits them over tensor-parallel
ranks, and FP8's 128x128 blocks would straddle those seams. So the quantized weights are
made in the transformers layout, through the precision's own protocol:

1. ``prepare_model`` on a meta-device copy of the transformers model names the weights
   the precision quantizes (the family's ``precision_keep`` applied), which is also what
   ``serving_weights`` packs;
2. once per optimizer step the trainer's weights go to transformers names
   (``named_weights``), through ``pack`` and ``unpack`` (exactly what the engine receives),
   and back to this rank's megatron-core tensors (``hf_to_mcore``);
3. each megatron-core module holding a quantized weight computes with it, straight
   through (the gradient reaches the float32 master unchanged), and, where the precision
   quantizes activations, with its input fake-quantized as the engine's matching
   ``nn.Linear`` quantizes its own (a row-parallel layer's input shard is gathered for
   that, so the tiles are the whole rows').
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from skyrl_backends._mcore_arch import Architecture
from skyrl_backends._mcore_model import hf_to_mcore
from skyrl_host.contracts import has
from skyrl_host.errors import UserError
from skyrl_host.interfaces import ActivationQuantizing

# Row-parallel layers: under tensor parallelism their input is split along its last dimension.
_ROW_PARALLEL = ("linear_proj", "linear_fc2")


class _Exact(torch.autograd.Function):
    """Forward: ``value`` exactly. Backward: the gradient goes to ``x`` unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return _Exact.apply(x, value) if x.requires_grad else value


def quantized_names(precision: Any, model: torch.nn.Module, keep: tuple[str, ...]) -> set[str]:
    """The transformers weight names ``precision`` quantizes in ``model``'s architecture
    (found on a meta-device copy: no memory, no hooks on the model itself)."""
    with torch.device("meta"):
        skeleton = type(model)(model.config)
    return set(precision.prepare_model(skeleton, keep=keep, train=True) or ())


def mcore_quantized(arch: Architecture, hf_shapes: Mapping[str, torch.Tensor], names: set[str]) -> dict[str, bool]:
    """Which of this rank's megatron-core weights hold quantized transformers weights:
    name -> True (all of it) / False (a fused weight mixing quantized and kept parts);
    weights with no quantized part are absent. (The transformers state is mapped with
    ones where quantized, zeros elsewhere, one byte an element.)"""
    marks = {k: torch.full(tuple(v.shape), int(k in names), dtype=torch.uint8) for k, v in hf_shapes.items()}
    out = {}
    for k, v in hf_to_mcore(arch, marks).items():
        if float(v.max()) > 0:
            out[k] = bool(float(v.min()) > 0)
    return out


class _ModuleHooks:
    """The hooks of one megatron-core module: its quantized parameters replaced by their
    values in ``source()`` for the forward, its input fake-quantized (``activation``)."""

    def __init__(self, params: dict[str, str], source: Callable[[], Mapping[str, torch.Tensor]],
                 activation: Callable[[torch.Tensor], torch.Tensor | None] | None, row_parallel: bool):
        self.params, self.source = params, source  # parameter -> its megatron-core state name
        self.activation, self.row_parallel = activation, row_parallel

    def pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        values = self.source()
        saved = {}
        for pname, full in self.params.items():
            p = module._parameters[pname]
            saved[pname] = p
            module._parameters[pname] = _through(p, values[full].to(p.dtype))  # type: ignore[assignment]
        module.__dict__["_skyrl_mcore_fq_saved"] = saved
        if self.activation is not None and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            x = args[0]
            with torch.no_grad():
                q = _fake_rows(x.detach(), self.activation, self.row_parallel)
            if q is not None:
                return (_through(x, q), *args[1:])
        return None

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        saved = module.__dict__.pop("_skyrl_mcore_fq_saved", None)
        if saved:
            module._parameters.update(saved)


def _fake_rows(x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor | None], split: bool) -> torch.Tensor | None:
    """``activation(x)``; under tensor parallelism a row-parallel layer's input is this
    rank's slice of each row: the rows are gathered, quantized whole, and sliced again."""
    if not split:
        return activation(x)
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return activation(x)
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    q = activation(gather_from_tensor_model_parallel_region(x))
    if q is None:
        return None
    width = x.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    return q[..., start:start + width].contiguous()


class MegatronPrecision:
    """A precision installed on a ``GPTModel`` (see the module docstring). ``weights()``
    gives the trainer's current weights by transformers names (a collective under model
    parallelism); ``version()`` changes whenever they do."""

    def __init__(self, precision: Any, arch: Architecture, names: set[str], hf_shapes: Mapping[str, torch.Tensor]):
        self.precision, self.arch, self.names = precision, arch, names
        self.marks = mcore_quantized(arch, hf_shapes, names)
        # (a precision without the capability is taken to quantize weights only)
        self._activation = precision.fake_activation if has(precision, ActivationQuantizing) else None
        self._mixed = sorted(k for k, whole in self.marks.items() if not whole)

    def fake(self, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's megatron-core weights as the engine computes with them, from the
        full transformers weights ``hf``: only the quantized ones."""
        served = dict(self.precision.unpack(self.precision.pack(hf.items()), torch.float32))
        mc = hf_to_mcore(self.arch, {k: torch.as_tensor(v) for k, v in served.items()})
        return {k: mc[k] for k in self.marks}

    def install(self, gpt: torch.nn.Module, source: Callable[[], Mapping[str, torch.Tensor]]) -> int:
        """Hooks on every module of ``gpt`` holding a quantized weight; returns how many."""
        by_module: dict[str, dict[str, str]] = {}
        for full in self.marks:
            path, _, pname = full.rpartition(".")
            by_module.setdefault(path, {})[pname] = full
        # (a row of 128 is whole tiles for every format)
        quantizes_inputs = self._activation is not None and self._activation(torch.ones(1, 128)) is not None
        if quantizes_inputs and self._mixed:
            raise UserError(f"[precision] {self.precision.name}: megatron-core fuses {self._mixed[0]!r} from quantized "
                            "and kept transformers weights, and one fused layer cannot quantize its input for some of them: "
                            "keep all or none of its parts ([precision] keep)")
        for path, params in by_module.items():
            module = gpt.get_submodule(path)
            # transformers' stacked experts quantize the experts' input once (their down projection's
            # input stays as it is); megatron-core's experts are MLPs of their own
            expert_down = ".experts." in path and path.endswith("linear_fc2")
            act = self._activation if quantizes_inputs and not expert_down else None
            hooks = _ModuleHooks(params, source, act, row_parallel=path.endswith(_ROW_PARALLEL))
            module.register_forward_pre_hook(hooks.pre)
            module.register_forward_hook(hooks.post, always_call=True)
        return len(by_module)

"""The precisions' shared implementation (imports torch): fake quantization or
torchao's low-precision kernels in the trainer, quantized weights on the wire,
dequantization in the engine."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator, Sequence

import torch

from skyrl_host.errors import UserError
from skyrl_precisions import _fakequant, _kernels
from skyrl_precisions._formats import FORMATS, FP8_BLOCK, INT4_GROUP, MX_BLOCK, Format

PAYLOAD_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # never a model's own weight dtype
SEP = "@"  # a weight's scales travel as f"{name}@{format}" beside its payload (under its own name)


def unpack_named(named_tensors: Iterable[tuple[str, Any]], dtype: Any) -> Iterator[tuple[str, Any]]:
    """Pairs of payload (``name``) and scales (``name@format``) back to dequantized weights
    in ``dtype``; every other tensor as given. A payload without its scales, or scales
    without their payload, is an error naming the weight."""
    payloads: dict[str, Any] = {}
    scales: dict[str, tuple[str, Any]] = {}
    plain: list[tuple[str, Any]] = []
    for name, t in named_tensors:
        if SEP in name:
            base, fmt = name.rsplit(SEP, 1)
            if fmt not in FORMATS:
                raise ValueError(f"weight {base!r}: unknown quantized format {fmt!r} (known: {', '.join(FORMATS)})")
            scales[base] = (fmt, t)
        else:
            plain.append((name, t))
    for name, t in plain:
        if name in scales:
            payloads[name] = t
        elif getattr(t, "dtype", None) in PAYLOAD_DTYPES:
            raise ValueError(f"weight {name!r}: a quantized payload arrived without its scales")
        else:
            yield name, t
    missing = sorted(set(scales) - set(payloads))
    if missing:
        raise ValueError(f"weight {missing[0]!r}: scales arrived without the quantized payload")
    for name, payload in payloads.items():
        fmt, scale = scales[name]
        yield name, FORMATS[fmt].unpack(torch.as_tensor(payload), torch.as_tensor(scale), dtype)


def wire_shapes(fmt: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of the payload and of the scales ``fmt.pack`` gives for a weight of ``shape``."""
    lead, cols = tuple(shape[:-1]), shape[-1]
    if fmt.name == "fp8_rowwise":
        return tuple(shape), lead
    if fmt.name == "fp8":
        rows = shape[-2]
        return tuple(shape), tuple(shape[:-2]) + (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if fmt.name == "mxfp8":
        return tuple(shape), lead + (cols // MX_BLOCK,)
    return lead + (cols // 2,), lead + (cols // INT4_GROUP,)


def sharded_pack(fmt: Any, name: str, t: Any) -> Iterator[tuple[str, Any]]:
    """Pack one rank's shard of a weight (a ``DTensor``) as its shards of the whole
    payload and scales (``DTensor``s on the same mesh and placements), so a sharded
    transport serves them like any sharded tensor. Exact where the format's blocks never
    straddle two shards: a shard along a leading dimension (stacked experts, or the rows
    of fp8_rowwise / mxfp8 / int4, whose blocks run along a row); fp8's 128x128 blocks need each shard
    of the rows to start on a multiple of 128. Anything else is a user error naming the
    weight."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(t.shape)
    for p in t.placements:
        if isinstance(p, Shard) and p.dim >= len(shape) - (2 if fmt.name == "fp8" else 1):
            blocks = {"fp8": "128x128 blocks", "fp8_rowwise": "rows (one scale each)"}.get(
                fmt.name, "blocks along the last dimension")
            if not (fmt.name == "fp8" and p.dim == len(shape) - 2):
                raise UserError(f"[precision] {fmt.name}: weight {name!r} is sharded on dimension {p.dim}, which cuts "
                                f"{fmt.name}'s {blocks}: a sharded transport cannot serve it quantized")
            _, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
            local_rows = t.to_local().shape[p.dim]
            if offset[p.dim] % FP8_BLOCK or (local_rows % FP8_BLOCK and offset[p.dim] + local_rows != shape[p.dim]):
                raise UserError(f"[precision] fp8: weight {name!r} is sharded at row {offset[p.dim]} ({local_rows} rows "
                                f"on this rank): fp8's 128-row blocks would straddle two shards; use mxfp8 or int4, "
                                "data_parallel = \"ddp\", or transport \"delta\" or \"broadcast\"")
    payload, scale = fmt.pack(t.to_local())
    payload_shape, scale_shape = wire_shapes(fmt, shape)

    def wrap(local: Any, global_shape: tuple[int, ...]) -> Any:
        stride = tuple(int(x) for x in torch.empty(global_shape, device="meta").stride())
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=global_shape, stride=stride)

    yield name, wrap(payload, payload_shape)
    yield f"{name}{SEP}{fmt.name}", wrap(scale, scale_shape)


def format_of(name: str, config: Any) -> Format | None:
    """The format precision ``name`` ships and computes with (None: ``bf16``): ``fp8``'s
    ``scaling`` option picks blockwise (``fp8``) or rowwise (``fp8_rowwise``) scales."""
    if name == "fp8" and getattr(config, "scaling", "blockwise") == "rowwise":
        return FORMATS["fp8_rowwise"]
    return FORMATS.get(name)


class Precision:
    """A :class:`skyrl_host.interfaces.Precision` for one format (or none: ``bf16``)."""

    def __init__(self, name: str, config: Any):
        self.name = name
        self.config = config
        self.format = format_of(name, config)
        self.quantizes = self.format is not None  # False for bf16: nothing to install, pack or unpack
        self.quantized: list[str] = []  # the weights prepare_model(train=True) quantizes
        self._kernels: str | None = None  # what prepare_model(train=True) chose
        self._hooks: list[Any] = []
        self._trained: set[int] = set()  # storage of the parameters prepare_model(train=True) took

    @property
    def kernels(self) -> str | None:
        """How the trainer computes the chosen layers, once ``prepare_model(train=True)``
        has decided (``[precision] kernels``): ``"torchao"`` (real low-precision matmuls
        for the ``nn.Linear`` layers torchao takes; stacked experts and the rest stay
        emulated) or ``"emulated"`` (fake quantization); None before, and for ``bf16``."""
        return self._kernels

    def prepare_model(self, model: Any, *, keep: Sequence[str] = (), train: bool = True, source: Any = None) -> list[str]:
        """Install the precision on ``model`` (in place); returns the quantized weights' names.

        ``train=True`` (the backend): the chosen layers compute with quantized weights
        (and activations, where the format quantizes them). With ``kernels`` resolving to
        ``"torchao"`` (decided here, from the device the model is on) the ``nn.Linear``
        layers torchao takes run its FP8 / MXFP8 matmuls; the others (stacked experts
        among them) are fake-quantized, straight-through. Parameter names and the state
        dict stay as they are either way.
        ``train=False`` (an engine): fake-quantization hooks and torchao modules a copy of
        the trainer's model carries are taken off, the chosen weights are replaced by
        their quantized values (of ``source``'s weights, the model the engine copied, when
        given: the trainer quantizes the same master values) and activations are
        fake-quantized as in the trainer; weights that arrive later come quantized
        (:meth:`unpack`). An engine that serves the trainer's own tensors computes as the
        trainer does instead (its kernels too)."""
        if self.format is None:
            return []
        keep = tuple(keep or _fakequant.DEFAULT_KEEP) + tuple(getattr(self.config, "keep", ()) or ())
        activations = bool(getattr(self.config, "activations", False))
        fmt = self.format
        if not train:
            if any(p.data_ptr() in self._trained for p in model.parameters()):
                # An engine serving the trainer's own tensors (the same storage): never write
                # them; compute as the trainer does (a deep copy of the trained modules already
                # carries the trainer's hooks and torchao modules; a tree of its own gets them).
                fast = self._swap(model, keep) if self._kernels == _kernels.TORCHAO else []
                if not _fakequant.installed(model):
                    names, hooks = _fakequant.install(model, fmt, keep=keep, weights=True, activations=activations,
                                                      skip=fast)
                    self._hooks += hooks
                return [n for n in self.quantized if n in dict(model.named_parameters())]
            _fakequant.remove(model)
            _kernels.restore(model)
            names, hooks = _fakequant.install(model, fmt, keep=keep, weights=False, activations=activations)
            self._hooks += hooks
            params = dict(model.named_parameters())
            originals = dict(source.named_parameters()) if source is not None else params
            with torch.no_grad():
                for name in names:
                    target = params[name]
                    master = originals.get(name, target)
                    target.copy_(fmt.fake_weight(master.detach().float()).to(target.dtype))
            return names
        requested = getattr(self.config, "kernels", _kernels.EMULATED)
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        self._kernels = _kernels.resolve(requested, fmt.name, device, activations=activations)
        fast = self._swap(model, keep) if self._kernels == _kernels.TORCHAO else []
        _, hooks = _fakequant.install(model, fmt, keep=keep, weights=True, activations=activations, skip=fast)
        self._hooks += hooks
        self.quantized = [f"{path}.{p}" for path, params in _fakequant.chosen(model, fmt, keep) for p in params]
        self._trained = {p.data_ptr() for p in model.parameters()}
        if device.type != "meta":  # (a meta-device skeleton only names the weights: the megatron backend)
            # One line for whoever reads the run (the device kit's precision check parses it).
            sys.stderr.write(f"precision {self.name}: {self._kernels} kernels ({fmt.name}, kernels = {requested!r}): "
                             f"{len(fast)} layers on torchao's, {len(hooks)} fake-quantized, on {device}\n")
        return self.quantized

    def _swap(self, model: Any, keep: Sequence[str]) -> list[str]:
        """torchao's kernels on the chosen ``nn.Linear`` layers it takes; their paths."""
        linears = [path for path, params in _fakequant.chosen(model, self.format, keep)
                   if isinstance(model.get_submodule(path), torch.nn.Linear)]
        return _kernels.swap(model, linears, self.format.name)

    def fake_activation(self, x: Any) -> Any:
        """A chosen layer's input as it computes with it (the format's tiles along the
        last dimension), or None: weights-only formats and ``activations = false``, and
        an input the format does not tile (:class:`skyrl_host.interfaces.ActivationQuantizing`)."""
        if self.format is None or not getattr(self.config, "activations", False):
            return None
        with torch.no_grad():
            return self.format.fake_activation(x.detach())

    def invalidate(self) -> None:
        """The weights changed (an optimizer step, a loaded checkpoint): quantize them anew."""
        for hooks in self._hooks:
            hooks.invalidate()

    def pack(self, named_tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        if self.format is None:
            yield from named_tensors
            return
        chosen = set(self.quantized)
        for name, t in named_tensors:
            if name not in chosen:
                yield name, t
            elif hasattr(t, "placements"):  # a DTensor: this rank's shard, quantized here
                yield from sharded_pack(self.format, name, t.detach())
            else:
                payload, scale = self.format.pack(t.detach())
                yield name, payload
                yield f"{name}{SEP}{self.format.name}", scale

    def unpack(self, named_tensors: Iterable[tuple[str, Any]], dtype: Any) -> Iterator[tuple[str, Any]]:
        return unpack_named(named_tensors, dtype)

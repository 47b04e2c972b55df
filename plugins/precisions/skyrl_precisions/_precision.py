"""The precisions' shared implementation (imports torch): fake quantization in the
trainer, quantized weights on the wire, dequantization in the engine."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch

from skyrl_precisions import _fakequant
from skyrl_precisions._formats import FORMATS

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


class Precision:
    """A :class:`skyrl_host.interfaces.Precision` for one format (or none: ``bf16``)."""

    def __init__(self, name: str, config: Any):
        self.name = name
        self.config = config
        self.format = FORMATS.get(name)
        self.quantizes = self.format is not None  # False for bf16: nothing to install, pack or unpack
        self.quantized: list[str] = []  # the weights prepare_model(train=True) quantizes
        self._hooks: list[Any] = []
        self._trained: set[int] = set()  # storage of the parameters prepare_model(train=True) took

    def prepare_model(self, model: Any, *, keep: Sequence[str] = (), train: bool = True, source: Any = None) -> list[str]:
        """Install the precision on ``model`` (in place); returns the quantized weights' names.

        ``train=True`` (the backend): the chosen layers compute with fake-quantized
        weights (and activations, where the format quantizes them), straight-through.
        ``train=False`` (an engine): fake-quantization hooks a copy of the trainer's model
        carries are taken off, the chosen weights are replaced by their quantized values
        (of ``source``'s weights, the model the engine copied, when given: the trainer
        quantizes the same master values) and activations are fake-quantized as in the
        trainer; weights that arrive later come quantized (:meth:`unpack`)."""
        if self.format is None:
            return []
        keep = tuple(keep or _fakequant.DEFAULT_KEEP) + tuple(getattr(self.config, "keep", ()) or ())
        activations = bool(getattr(self.config, "activations", False))
        if not train:
            if any(p.data_ptr() in self._trained for p in model.parameters()):
                # An engine serving the trainer's own tensors (the same storage): never write
                # them; quantize on the fly as the trainer does (a deep copy of the trained
                # modules already carries the trainer's hooks; a tree of its own gets them).
                if not _fakequant.installed(model):
                    names, hooks = _fakequant.install(model, self.format, keep=keep, weights=True, activations=activations)
                    self._hooks += hooks
                return [n for n in self.quantized if n in dict(model.named_parameters())]
            _fakequant.remove(model)
        names, hooks = _fakequant.install(model, self.format, keep=keep, weights=train, activations=activations)
        self._hooks += hooks
        if train:
            self.quantized = names
            self._trained = {p.data_ptr() for p in model.parameters()}
            return names
        params = dict(model.named_parameters())
        originals = dict(source.named_parameters()) if source is not None else params
        with torch.no_grad():
            for name in names:
                target = params[name]
                master = originals.get(name, target)
                target.copy_(self.format.fake_weight(master.detach().float()).to(target.dtype))
        return names

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
            if name in chosen:
                payload, scale = self.format.pack(t.detach())
                yield name, payload
                yield f"{name}{SEP}{self.format.name}", scale
            else:
                yield name, t

    def unpack(self, named_tensors: Iterable[tuple[str, Any]], dtype: Any) -> Iterator[tuple[str, Any]]:
        return unpack_named(named_tensors, dtype)

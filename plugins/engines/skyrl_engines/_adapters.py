"""LoRA adapters served by the embedded engine, swapped atomically.

The engine's own model keeps its base weights; every adapted ``nn.Linear`` gets a
forward hook that adds ``scale * B @ A @ x`` from the adapter *bank* pinned by the
running ``generate`` call (nothing when none is pinned, so the hooks never touch a
forward that is not the engine's).

A bank is one complete version: ``(A, B)`` per module in the engine's dtype, the
scale ``alpha / rank`` and the version number. ``stage`` validates a new version and
copies it into a bank no generate call holds (the spare one when it is free, else a
new one); ``activate`` then switches the serving reference in one assignment. A
generate call pins the serving (bank, version) once, at its start, and uses exactly
that bank for every forward, so a swap during a call never mixes versions; the next
call sees the new one.

The continuous batcher (``skyrl_engines.continuous``) serves several adapters in one
batch instead: :meth:`EngineAdapters.build` makes a bank of its own for each adapter it
serves, and inside :meth:`EngineAdapters.per_row` every forward of that thread adds each
bank's ``scale * B @ A @ x`` to its own rows only (rows of no bank get none).

Adapter names: ``<module path>.lora_A`` ``[rank, in_features]`` and ``<module
path>.lora_B`` ``[out_features, rank]`` (the torch backend's names); the modules are
the ``nn.Linear`` modules whose last path component is in the config's ``targets``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch


class AdapterError(ValueError):
    """A new adapter version does not fit the engine's model; the engine keeps its last one."""


class _Bank:
    __slots__ = ("tensors", "scale", "signature", "pins")

    def __init__(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], signature: tuple):
        self.tensors = tensors  # module path -> (A [r, in], B [out, r])
        self.scale = 1.0
        self.signature = signature  # (rank, module paths): banks of one signature are interchangeable
        self.pins = 0  # generate calls using this bank


class Serving:
    """What a generate call pins: the adapter bank (None: base model only) and the version."""

    __slots__ = ("bank", "version")

    def __init__(self, bank: _Bank | None, version: int):
        self.bank = bank
        self.version = version


def _config_values(config: Mapping[str, Any]) -> tuple[int, float, list[str]]:
    try:
        rank, alpha, targets = int(config["rank"]), float(config["alpha"]), list(config["targets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"adapter config needs rank, alpha and targets, found {dict(config)!r} ({exc})") from None
    if rank <= 0 or not alpha > 0 or not targets:
        raise AdapterError(f"adapter config needs rank > 0, alpha > 0 and targets, found {dict(config)!r}")
    return rank, alpha, targets


class EngineAdapters:
    """The adapter slots, banks and the serving (bank, version) of one engine (see the
    module docstring). ``bind`` it to the engine's model before use."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.serving = Serving(None, 0)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._hooked: dict[str, Any] = {}
        self._spare: _Bank | None = None
        self.staged_bytes = 0

    def bind(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked = {}
        self._spare = None
        self.model, self.dtype, self.device = model, dtype, device
        self.serving = Serving(None, self.serving.version)

    # -- slots -------------------------------------------------------------------

    def modules(self, targets: Iterable[str]) -> dict[str, torch.nn.Linear]:
        if self.model is None:
            raise RuntimeError("the engine has not been started (call start(loaded) first)")
        wanted = set(targets)
        found = {
            name: m for name, m in self.model.named_modules()
            if name.rsplit(".", 1)[-1] in wanted and isinstance(m, torch.nn.Linear)
        }
        missing = sorted(wanted - {n.rsplit(".", 1)[-1] for n in found})
        if missing:
            raise AdapterError(f"adapter targets {missing} match no nn.Linear module of the engine's model")
        return found

    def slots(self, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """``{adapter tensor name: shape}`` a complete adapter with ``config`` has here."""
        rank, _, targets = _config_values(config)
        out: dict[str, tuple[int, ...]] = {}
        for name, m in self.modules(targets).items():
            out[f"{name}.lora_A"] = (rank, m.in_features)
            out[f"{name}.lora_B"] = (m.out_features, rank)
        return out

    # -- staging and the swap ------------------------------------------------------

    def _validated(self, named_tensors: Iterable[tuple[str, Any]], config: Mapping[str, Any],
                   version: int) -> tuple[dict[str, tuple[int, ...]], dict[str, Any], list[str], tuple, float]:
        rank, alpha, targets = _config_values(config)
        slots = self.slots(config)
        given: dict[str, Any] = {}
        for name, tensor in named_tensors:
            if name not in slots:
                raise AdapterError(
                    f"adapter version {version}: tensor {name!r} has no slot in the engine's model "
                    f"(targets {targets}, rank {rank})"
                )
            if name in given:
                raise AdapterError(f"adapter version {version}: tensor {name!r} given twice")
            shape = tuple(getattr(tensor, "shape", ()))
            if shape != slots[name]:
                raise AdapterError(f"adapter version {version}: tensor {name!r} has shape {shape}, expected {slots[name]}")
            given[name] = tensor
        missing = [n for n in slots if n not in given]
        if missing:
            raise AdapterError(f"adapter version {version}: tensor {missing[0]!r} is missing ({len(missing)} of {len(slots)})")
        modules = [n[: -len(".lora_A")] for n in slots if n.endswith(".lora_A")]
        return slots, given, modules, (rank, tuple(modules)), alpha / rank

    def stage(self, named_tensors: Iterable[tuple[str, Any]], config: Mapping[str, Any], version: int) -> _Bank:
        """Validate a complete adapter and copy it into a bank no generate call uses.
        Raises :class:`AdapterError` (naming the version and the tensor) and changes
        nothing served when it does not fit."""
        slots, given, modules, signature, scale = self._validated(named_tensors, config, version)
        with self._lock:
            spare, self._spare = self._spare, None
        # The spare bank no longer serves and no call pins it any more: reuse its buffers.
        bank = spare if spare is not None and spare.pins == 0 and spare.signature == signature else None
        if bank is None:
            bank = self._new_bank(slots, modules, signature)
        self.staged_bytes = self._fill(bank, given, scale)
        return bank

    def build(self, named_tensors: Iterable[tuple[str, Any]], config: Mapping[str, Any], version: int = 0) -> _Bank:
        """A bank of its own (never the serving one, never reused by :meth:`stage`) for
        :meth:`per_row`; validated like :meth:`stage` (raises :class:`AdapterError`)."""
        slots, given, modules, signature, scale = self._validated(named_tensors, config, version)
        bank = self._new_bank(slots, modules, signature)
        self._fill(bank, given, scale)
        self._hook_modules(bank)
        return bank

    def _new_bank(self, slots: Mapping[str, tuple[int, ...]], modules: list[str], signature: tuple) -> _Bank:
        return _Bank(
            {m: (torch.empty(slots[f"{m}.lora_A"], dtype=self.dtype, device=self.device),
                 torch.empty(slots[f"{m}.lora_B"], dtype=self.dtype, device=self.device)) for m in modules},
            signature,
        )

    def _fill(self, bank: _Bank, given: Mapping[str, Any], scale: float) -> int:
        nbytes = 0
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only numpy views (Ray's object store) are only read
            for m, (a, b) in bank.tensors.items():
                for dst, src in ((a, given[f"{m}.lora_A"]), (b, given[f"{m}.lora_B"])):
                    src_t = torch.from_numpy(src) if isinstance(src, np.ndarray) else torch.as_tensor(src)
                    dst.copy_(src_t)
                    nbytes += src_t.numel() * src_t.element_size()
        bank.scale = scale
        return nbytes

    def activate(self, bank: _Bank, version: int) -> None:
        """Serve ``bank`` as ``version`` from the next generate call on (one assignment)."""
        self._hook_modules(bank)
        with self._lock:
            old = self.serving.bank
            self.serving = Serving(bank, int(version))
            if old is not None and old is not bank:
                self._spare = old

    def _hook_modules(self, bank: _Bank) -> None:
        with self._lock:
            for name in bank.tensors:  # hook each adapted module once
                if name not in self._hooked:
                    module = self.model.get_submodule(name)
                    self._hooked[name] = module.register_forward_hook(self._hook(name))

    def set_version(self, version: int) -> None:
        """New base weights: keep the adapter, report ``version``."""
        with self._lock:
            self.serving = Serving(self.serving.bank, int(version))

    def _hook(self, name: str) -> Any:
        local = self._local

        def hook(_module: Any, args: tuple[Any, ...], output: torch.Tensor) -> Any:
            groups = getattr(local, "groups", None)
            if groups is not None:  # per_row: each bank adds to its own rows
                out = output
                for bank, rows in groups:
                    ab = bank.tensors.get(name)
                    if ab is None:
                        continue
                    a, b = ab
                    if rows is None:  # every row of the batch
                        out = out + torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b) * bank.scale
                    else:
                        x = args[0].index_select(0, rows)
                        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * bank.scale
                        out = out.index_add(0, rows, delta)
                return out
            bank = getattr(local, "bank", None)
            if bank is None:
                return None
            ab = bank.tensors.get(name)
            if ab is None:
                return None
            a, b = ab
            return output + torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b) * bank.scale

        return hook

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Serving]:
        """For one generate call: the serving (bank, version), read once, and its bank
        used by every forward of this thread inside the block."""
        with self._lock:
            serving = self.serving
            if serving.bank is not None:
                serving.bank.pins += 1
        before = getattr(self._local, "bank", None)
        self._local.bank = serving.bank
        try:
            yield serving
        finally:
            self._local.bank = before
            with self._lock:
                if serving.bank is not None:
                    serving.bank.pins -= 1


    @contextlib.contextmanager
    def per_row(self, groups: list[tuple[_Bank, torch.Tensor | None]]) -> Iterator[None]:
        """Inside the block, every forward of this thread adds each ``(bank, rows)``
        group's adapter to the batch rows ``rows`` (an index tensor; None: every row) and
        nothing to the other rows, whatever bank :meth:`pinned` would give."""
        before = getattr(self._local, "groups", None)
        self._local.groups = list(groups)
        try:
            yield
        finally:
            self._local.groups = before


def adapter_tensors(bank: _Bank | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a bank, for inspection and tests."""
    if bank is None:
        return iter(())
    return iter([(f"{m}.{s}", t) for m, (a, b) in bank.tensors.items() for s, t in (("lora_A", a), ("lora_B", b))])

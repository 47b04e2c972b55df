"""Low-precision compute weights: the model's parameters hold a bf16 copy of the float32
master weights while one optimizer update's forwards and backwards run.

Under ``torch.autocast`` every matmul casts its float32 weight to bf16 again, in every
forward and again in every activation-recomputation (gradient checkpointing), and the
residual stream stays float32, so every norm output and every projection input is cast
too. On a CPU these casts took about 15% of a bf16 training step of a 135M model (11,500
``_to_copy`` calls, docs/benchmarks.md). With :class:`ComputeCopy` the weights are cast
once per optimizer update; the forward then runs in bf16 from end to end, as the
embedded engine does when it samples in bf16 (norms and softmax still compute in float32
inside transformers' modules).

How: for the span of one update each parameter's ``.data`` is its bf16 copy (the
``Parameter`` objects stay the same, so gradient checkpointing, replay hooks and LoRA
see nothing new), the bf16 gradient of each micro-batch is added into a float32
accumulator and freed, and before the optimizer step every parameter gets its float32
master back with the accumulated gradient: clipping, AdamW and its state are float32 as
before, and nothing outside the update (weights for the engine, checkpoints, adapters)
ever sees the copy. Frozen parameters (LoRA's base) are cast once, not per update.

Only for one process without a precision plugin: DDP and FSDP2 keep their own views of
the parameters' storage (FSDP2 has its own mixed-precision policy), and a precision
plugin's fake quantization reads the float32 weight.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


class ComputeCopy:
    """bf16 (or fp16) copies of ``module``'s float32 parameters, swapped in for one
    update at a time (:meth:`update`) or for a no-grad pass (:meth:`forward_only`)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        seen: set[int] = set()
        self.params: list[torch.nn.Parameter] = []
        for p in module.parameters():  # tied weights (embeddings = head) once
            if id(p) not in seen and p.dtype == torch.float32:
                seen.add(id(p))
                self.params.append(p)
        self._frozen: dict[int, torch.Tensor] = {}  # copies of parameters that never train
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._masters: list[torch.Tensor] | None = None

    def _swap_in(self) -> None:
        masters = []
        with torch.no_grad():
            for p in self.params:
                master = p.data
                masters.append(master)
                if not p.requires_grad:
                    copy = self._frozen.get(id(p))
                    if copy is None or copy.shape != master.shape:
                        copy = self._frozen[id(p)] = master.to(self.dtype)
                else:
                    copy = master.to(self.dtype)
                p.data = copy
        self._masters = masters

    def _swap_out(self) -> None:
        if self._masters is None:
            return
        for p, master in zip(self.params, self._masters):
            p.data = master
        self._masters = None

    def forget(self) -> None:
        """Drop the frozen parameters' copies (after a checkpoint load)."""
        self._frozen.clear()

    def collect(self) -> None:
        """After a micro-batch's backward: add each bf16 gradient into its float32
        accumulator and free it (the next backward starts from no gradient)."""
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            acc = self._grads[i]
            if acc is None:
                self._grads[i] = g.to(torch.float32)
            else:
                acc.add_(g)
            p.grad = None

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """The parameters hold their copies inside; on leaving (normally or by an
        exception) they hold their float32 masters again, with the float32 sum of the
        micro-batches' gradients (each :meth:`collect`) as ``.grad``."""
        self._grads = [None] * len(self.params)
        self._swap_in()
        try:
            yield
        finally:
            self.collect()
            self._swap_out()
            for p, g in zip(self.params, self._grads):
                p.grad = g
            self._grads = [None] * len(self.params)

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """The copies for a pass without gradients (the pre-update logprobs)."""
        self._swap_in()
        try:
            yield
        finally:
            self._swap_out()

    @staticmethod
    def applies(backend: Any) -> bool:
        """Whether ``backend`` (a TorchBackend after ``start``) computes through copies."""
        cfg = backend.config
        return (cfg.compute_dtype == "bfloat16" and cfg.compute_weights == "copy"
                and not backend._dp and backend.precision is None)


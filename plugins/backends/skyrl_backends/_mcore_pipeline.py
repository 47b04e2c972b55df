"""Pipeline parallelism for the megatron backend: this rank's stage and the two autograd
functions at the stage boundaries.

megatron-core 0.16.1's pipeline schedules allocate tensors with ``device="cuda"`` and its
point-to-point layer calls ``torch.cuda.synchronize()``, so they cannot run on a CPU. The
backend runs a schedule of its own instead, the simplest there is: every stage runs the
same train step in lockstep, one micro-batch at a time (no interleaving; the bubbles cost
nothing that matters on a CPU), and the stages meet only inside the policy forward:

- a stage that is not the first receives its input hidden states from the previous stage
  (:func:`Stage.receive_hidden`); the backward pass sends their gradient back;
- a stage that is not the last sends its output hidden states to the next stage, and gets
  back the per-token logprobs (and entropies) that the last stage computes
  (:func:`Stage.to_last`), so the algorithm's loss and metrics are computed identically on
  every stage. Its backward pass ignores the gradient of those logprobs (the last stage
  computes the same one and backpropagates it through its own layers) and receives the
  gradient of its hidden states from the next stage instead.

Every stage calls the same sends and receives in the same order at every forward and
backward (the no-grad passes included), so the exchange cannot deadlock: forward, stage
``s`` receives from ``s - 1`` and sends to ``s + 1``, then all stages take the last
stage's results (a broadcast over the pipeline group); backward, the last stage sends
first and each earlier stage receives before it sends.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

# The dtypes hidden states cross a stage boundary in (as float32 values, exactly), by code:
# under bf16 autocast a decoder layer's output is bfloat16, and the next stage must go on from
# the same dtype as one process would.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Stage:
    """This rank's pipeline stage: ``index`` of ``size``, holding the decoder layers
    ``offset .. offset + layers - 1``; ``ranks``: the global ranks of its pipeline, in
    stage order; ``group``: their process group (megatron-core's pipeline group)."""

    def __init__(self, index: int, size: int, ranks: list[int], group: Any, offset: int, layers: int):
        self.index, self.size, self.ranks, self.group = index, size, ranks, group
        self.offset, self.layers = offset, layers
        self.first, self.last = index == 0, index == size - 1

    def __repr__(self) -> str:
        return f"Stage({self.index} of {self.size}, layers {self.offset}..{self.offset + self.layers - 1})"

    # -- point to point ------------------------------------------------------------------

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        dist.send(tensor.detach().float().contiguous(), dst=self.ranks[to], group=self.group)

    def _recv(self, shape: tuple[int, ...], frm: int, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=device)
        dist.recv(out, src=self.ranks[frm], group=self.group)
        return out

    def _send_hidden(self, hidden: torch.Tensor) -> None:
        """``hidden`` to the next stage, with its dtype's code as one more element."""
        if hidden.dtype not in _DTYPES:
            raise TypeError(f"pipeline stages pass hidden states in {_DTYPES}, not {hidden.dtype}")
        code = torch.full((1,), float(_DTYPES.index(hidden.dtype)), device=hidden.device)
        self._send(torch.cat([hidden.detach().float().reshape(-1), code]), self.index + 1)

    def _recv_hidden(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        flat = self._recv((math.prod(shape) + 1,), self.index - 1, device)
        return flat[:-1].reshape(shape).to(_DTYPES[int(flat[-1])])

    # -- the boundaries ------------------------------------------------------------------

    def receive_hidden(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """(not the first stage) The previous stage's output hidden states ``shape`` (in
        their dtype there), whose gradient the backward pass sends back to it."""
        anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
        return _FromPrevious.apply(anchor, self, tuple(shape))

    def to_last(self, hidden: torch.Tensor, result: tuple[int, ...] | None) -> torch.Tensor:
        """(not the last stage) Send ``hidden`` on; returns the last stage's results
        (``result``: their shape; None: the last stage sends none, and a zero [1] comes
        back) as a tensor whose backward receives ``hidden``'s gradient from the next stage."""
        return _ToNext.apply(hidden, self, result)

    def share(self, result: torch.Tensor) -> None:
        """(the last stage) Hand ``result`` to every earlier stage (they wait in
        :meth:`to_last`)."""
        dist.broadcast(result.detach().float().contiguous(), src=self.ranks[-1], group=self.group)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the stages."""
        dist.all_reduce(tensor, group=self.group)


class _FromPrevious(torch.autograd.Function):
    """Forward: the previous stage's hidden states. Backward: their gradient to it."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, stage: Stage, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.stage = stage
        return stage._recv_hidden(shape, anchor.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.stage._send(grad, ctx.stage.index - 1)
        return None, None, None


class _ToNext(torch.autograd.Function):
    """Forward: send the hidden states to the next stage, return the last stage's results.
    Backward: the hidden states' gradient, from the next stage (the results' own gradient
    is not used: the last stage backpropagates the same one through its layers)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, stage: Stage, result: tuple[int, ...] | None) -> torch.Tensor:
        ctx.stage, ctx.shape, ctx.dtype = stage, tuple(hidden.shape), hidden.dtype
        stage._send_hidden(hidden)
        if result is None:
            return torch.zeros(1, dtype=torch.float32, device=hidden.device)
        out = torch.empty(result, dtype=torch.float32, device=hidden.device)
        dist.broadcast(out, src=stage.ranks[-1], group=stage.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        stage = ctx.stage
        return stage._recv(ctx.shape, stage.index + 1, grad.device).to(ctx.dtype), None, None


def stage_layers(num_layers: int) -> tuple[int, int, bool, bool]:
    """(the first decoder layer, how many, whether the first stage, whether the last) of
    this rank's pipeline stage (megatron-core's parallel state; layers split evenly)."""
    from megatron.core import parallel_state

    size = parallel_state.get_pipeline_model_parallel_world_size()
    index = parallel_state.get_pipeline_model_parallel_rank()
    per = num_layers // size
    return index * per, per, index == 0, index == size - 1


def pipeline_stage(num_layers: int) -> Stage | None:
    """This rank's :class:`Stage` (None without pipeline parallelism)."""
    from megatron.core import parallel_state

    size = parallel_state.get_pipeline_model_parallel_world_size()
    if size == 1:
        return None
    group = parallel_state.get_pipeline_model_parallel_group()
    offset, per, _, _ = stage_layers(num_layers)
    return Stage(parallel_state.get_pipeline_model_parallel_rank(), size, dist.get_process_group_ranks(group), group,
                 offset, per)


def global_layer_names(state: dict[str, Any], offset: int) -> dict[str, Any]:
    """``state`` (a stage's megatron-core names: ``decoder.layers.j.``) with the whole
    model's layer numbers (``decoder.layers.{offset + j}.``)."""
    if not offset:
        return dict(state)
    out = {}
    prefix = "decoder.layers."
    for k, v in state.items():
        if k.startswith(prefix):
            j, _, rest = k[len(prefix):].partition(".")
            k = f"{prefix}{int(j) + offset}.{rest}"
        out[k] = v
    return out

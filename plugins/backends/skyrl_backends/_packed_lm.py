"""The policy as the torch backend calls it on packed rows: logits only at the loss positions.

:class:`PackedLM` runs the base transformer on packed rows and the output head only on
the positions that predict a loss token; :func:`head_is_plain` checks that this path
gives the model's own logits (otherwise the whole model runs); :class:`WithoutAdapters`
is the LoRA policy with its adapters off (the reference policy).
"""

from __future__ import annotations

from typing import Any

import torch


class PackedLM(torch.nn.Module):
    """A causal LM that computes logits only where they are needed.

    ``forward(ids [rows, R], pos [rows, R], keep [K])`` runs the model's base
    transformer (``get_decoder()``) on the packed rows (no attention mask, no cache:
    transformers builds the block-diagonal causal mask from the positions), flattens
    the hidden states to ``[rows * R, H]``, takes the ``keep`` rows and applies the
    output head: logits ``[K, V]``. (``logits_to_keep`` cannot do this: it takes the
    same sequence indices in every row.)

    The data-parallel wrappers (DDP, the FSDP2 root) wrap this module, so their
    forward/backward hooks run around the call that uses the parameters. It owns the
    model as ``lm``, so its own parameter names carry an ``lm.`` prefix: names for the
    engine and checkpoints always come from the model itself.

    ``full_logits``: for a model whose forward changes the head's output (logit
    scaling or soft-capping), call the whole model and index its logits instead."""

    def __init__(self, model: torch.nn.Module, full_logits: bool = False):
        super().__init__()
        self.lm = model
        self.full_logits = full_logits
        names = {id(m): n for n, m in model.named_modules()}
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if get_decoder is not None else None
        if decoder is None or decoder is model:
            decoder = getattr(model, getattr(model, "base_model_prefix", "") or "model", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if decoder is None or decoder is model or id(decoder) not in names or head is None or id(head) not in names:
            self.full_logits = True  # no separable base transformer / output head
            self._decoder_name = self._head_name = ""
        else:
            # Names, not modules: registering them again would duplicate the parameters.
            self._decoder_name, self._head_name = names[id(decoder)], names[id(head)]

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, scorer: Any = None, **kwargs: Any) -> Any:
        """Logits ``[K, V]`` at ``keep``; with ``scorer`` (a replay strategy's scoring,
        called here so FSDP2 has the head's parameters gathered), its result from
        ``hidden=[K, H], head=module`` (or ``logits=`` for a transformed head).
        ``kwargs``: the micro-batch's extra keywords for the model (a flat row's prepared
        masks and segments, ``MicroBatch.model_kwargs``)."""
        if self.full_logits:
            logits = self.lm(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
            logits = logits.reshape(-1, logits.shape[-1])[keep]
            return logits if scorer is None else scorer(logits=logits)
        out = self.lm.get_submodule(self._decoder_name)(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[keep]
        head = self.lm.get_submodule(self._head_name)
        return head(hidden) if scorer is None else scorer(hidden=hidden, head=head)


class WithoutAdapters:
    """Calls a ``PackedLM`` with its LoRA adapters off: the frozen base, used as the
    reference policy (no second copy of the weights)."""

    def __init__(self, lm: Any, lora: Any):
        self.lm = lm
        self.lora = lora

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lora.disabled():
            return self.lm(*args, **kwargs)


def head_is_plain(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``PackedLM``'s decoder + head path gives the model's own logits
    (checked on two short packed rows; a model that scales or soft-caps its logits
    after the head does not)."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "get_text_config", lambda: None)()):
        if cfg is not None and (getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_scaling", None)):
            return False
    if hasattr(model, "logit_scale"):
        return False
    probe = PackedLM(model)
    if probe.full_logits:
        return False
    vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 8))
    ids = (torch.arange(12, device=device).reshape(2, 6) * 7 + 3) % vocab
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], device=device)
    keep = torch.arange(12, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=pos, use_cache=False).logits.reshape(12, -1)
            got = probe(ids, pos, keep)
    finally:
        model.train(was_training)
    scale = float(want.abs().max()) + 1.0
    return got.shape == want.shape and bool(((got.float() - want.float()).abs().max() <= 1e-4 * scale))

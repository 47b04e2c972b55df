"""``[engine] share_weights``: the embedded engine serves the trainer's own tensors, or
a copy of its own that training cannot touch (what async RL needs)."""

from __future__ import annotations

import torch


def _engine(skyrl_host, **options):
    reg = skyrl_host.registry.get("engines", "embedded")
    return reg.create(reg.config(**options))


def test_share_weights_false_keeps_a_copy_training_cannot_change(skyrl_host) -> None:
    reg = skyrl_host.registry.get("models", "qwen")
    loaded = reg.create(reg.config(preset="tiny")).load(alphabet="0123456789:", seed=0)
    shared, own = _engine(skyrl_host), _engine(skyrl_host, share_weights=False)
    shared.start(loaded)
    own.start(loaded)
    assert shared.shares_weights and not own.shares_weights
    src = dict(loaded.model.named_parameters())
    for name, p in own.model.named_parameters():
        assert p.data_ptr() != src[name].data_ptr(), name
        assert torch.equal(p, src[name])
    assert all(p.data_ptr() == src[n].data_ptr() for n, p in shared.model.named_parameters())
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.add_(1.0)  # a training step
    name, p = next(iter(own.model.named_parameters()))
    assert not torch.equal(p, src[name]) and torch.equal(p + 1.0, src[name])

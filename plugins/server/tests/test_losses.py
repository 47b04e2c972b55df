"""The server's loss functions without a server: ``ppo`` through the ``grpo`` plugin equals its formula."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("low,high,routed", [(0.8, 1.2, True), (0.9, 1.05, True), (0.5, 2.0, False)])
def test_ppo_through_the_algorithm_plugin_equals_the_formula(low, high, routed) -> None:
    from skyrl_host.plugins import build_host
    from skyrl_server import _losses

    host = build_host()
    assert (_losses._ppo_algorithm(host, {"clip_low_threshold": low, "clip_high_threshold": high}) is not None) == routed
    rng = np.random.default_rng(0)
    n = 64
    base = torch.tensor(rng.normal(-2.0, 1.0, n), dtype=torch.float32)
    inputs = {"logprobs": (base.numpy() - rng.normal(0, 0.4, n)).astype(np.float32),
              "advantages": rng.normal(0, 1, n).astype(np.float32), "target_tokens": np.zeros(n, np.int64)}
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    grads, values = [], []
    for with_host in (host, None):
        lp = base.clone().requires_grad_(True)
        elementwise, loss = _losses.loss_terms("ppo", lp, inputs, config, "cpu", with_host)
        loss.backward()
        grads.append(lp.grad.numpy().copy())
        values.append((float(loss.detach()), elementwise.detach().numpy()))
    ratio = np.exp(base.numpy().astype(np.float64) - inputs["logprobs"])
    adv = inputs["advantages"].astype(np.float64)
    hand = -np.minimum(ratio * adv, np.clip(ratio, low, high) * adv)
    for value, elementwise in values:
        assert value == pytest.approx(hand.sum(), rel=1e-5)
        np.testing.assert_allclose(elementwise, hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert np.abs(grads[0]).sum() > 0  # some tokens inside the clip range carry a gradient

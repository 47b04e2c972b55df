"""One KL estimator serves the numpy reward penalty and the torch loss."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import skyrl_toolkit.kl as _kl
from skyrl_algorithms import _advantages, _losses

LOGP = [-1.0, -2.0, -0.3, -4.25, 0.0]
REF = [-1.5, -1.5, -0.3, -0.125, -7.0]


def test_the_numpy_and_torch_callers_use_the_one_estimator() -> None:
    assert _advantages.kl_estimate is _kl.kl_estimate
    assert _losses.kl_estimate is _kl.kl_estimate


@pytest.mark.parametrize("estimator", _kl.ESTIMATORS)
def test_numpy_and_torch_agree_and_keep_their_type(estimator: str) -> None:
    lp64, ref64 = np.asarray(LOGP), np.asarray(REF)
    got_np = _kl.kl_estimate(lp64, ref64, estimator)
    got_t = _kl.kl_estimate(torch.tensor(LOGP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64), estimator)
    assert isinstance(got_np, np.ndarray) and got_np.dtype == np.float64
    assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.float64
    np.testing.assert_array_equal(got_np, got_t.numpy())
    d = lp64 - ref64
    reference = {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-d) + d - 1.0}[estimator]
    np.testing.assert_array_equal(got_np, reference)  # bit-identical to the former numpy formula


def test_torch_estimate_keeps_the_gradient() -> None:
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    _kl.kl_estimate(logp, torch.tensor([-1.5, -1.5]), "k3").sum().backward()
    # d/dlogp (exp(-d) + d - 1) = 1 - exp(-d)
    assert logp.grad.tolist() == pytest.approx([1 - np.exp(-0.5), 1 - np.exp(0.5)])


def test_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; expected 'k1', 'k2' or 'k3'"):
        _kl.kl_estimate(np.zeros(2), np.zeros(2), "k4")


def test_the_numpy_penalty_does_not_import_torch() -> None:
    code = (
        "import sys; from skyrl_algorithms import kl_reward_penalty as f\n"
        "f([0.0, -1.0], [0.0, -1.5], [0, 1], [0, 0], 'k3')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

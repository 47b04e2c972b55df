"""The one KL estimator: per-token KL(pi || pi_ref) estimates for numpy arrays and
torch tensors through one code path.

The array namespace (``numpy`` or ``torch``) is taken from the type of the inputs,
so this module imports neither eagerly: the numpy callers (``_advantages``) never
load torch.
"""

from __future__ import annotations

import sys
from typing import Any

ESTIMATORS = ("k1", "k2", "k3")


def _namespace(x: Any) -> Any:
    """``torch`` for a tensor, else ``numpy``."""
    if type(x).__module__.split(".")[0] == "torch":
        return sys.modules["torch"]  # a tensor exists, so torch is imported
    import numpy

    return numpy


def kl_estimate(logp: Any, ref: Any, estimator: str) -> Any:
    """Per-token KL(pi || pi_ref) estimates, with d = logp - ref:
    k1 = d; k2 = d^2 / 2; k3 = exp(-d) + d - 1 (= exp(ref - logp) - (ref - logp) - 1).

    ``logp`` and ``ref``: numpy arrays or torch tensors of one shape; the result
    has their type."""
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return _namespace(d).exp(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")

"""The samplers' objects, for code outside this distribution (engines' tests, tools).

Importing this imports torch (unlike the registered modules, which only declare their
options). A job gets its sampler through the registry (``[sampler] name = ...``);
these names are for code that needs one directly:

- :class:`TruncatedSampler`: temperature, top-k, top-p, min-p, then a random draw
  (every stochastic sampler name);
- :class:`GreedySampler`: the most likely token (``greedy``);
- :func:`build_sampler`: the factory of the stochastic names, a ``TruncatedSampler``
  from a sampler config (e.g. ``skyrl_samplers.top_p.TopPConfig``).
"""

from __future__ import annotations

from skyrl_samplers._options import build_sampler
from skyrl_samplers._processing import GreedySampler, TruncatedSampler

__all__ = ["GreedySampler", "TruncatedSampler", "build_sampler"]

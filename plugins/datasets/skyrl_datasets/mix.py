"""mix: draw each document from one of several datasets, by weight or by size.

``[data] strategy = "mix"`` with either

- ``weights = [w_0, w_1, ...]``: one per dataset (``[job] data_paths``), in any
  scale: dataset ``i`` is drawn with probability ``w_i / sum(w)``; or
- ``temperature = T``: ``p_i ∝ n_i^(1/T)`` with ``n_i`` the dataset's document
  count. ``T = 1`` (the default) draws in proportion to size, larger ``T``
  flattens towards uniform (``T → ∞``), ``T < 1`` favours the large datasets.

Draw ``k`` picks its dataset by a hash of (seed, k), so the proportions are exact
in expectation and the choice is a pure function of the seed and the draw count.
Within a dataset, documents come in a new seeded permutation each epoch (its own
epochs: a small dataset wraps around sooner), or in order with ``shuffle =
false``. The checkpointed position is the draw count and each dataset's (epoch,
position): O(datasets), not O(documents).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import OptionError, ge, gt, option
from skyrl_datasets._order import BlockCache, Permutation, check_state, epoch_key, sizes_of, uniforms

CHOICE_STREAM = 0x313  # the hash stream that picks datasets (the datasets' own streams are 0, 1, ...)
ENDLESS = 1 << 62  # the draws never end


def _weights(_inst: Any, _attr: Any, value: Sequence[float] | None) -> None:
    if value is None:
        return
    if not value:
        raise ValueError("expected at least one weight, found an empty array")
    if any(not math.isfinite(w) or w < 0 for w in value):
        raise ValueError(f"expected finite weights >= 0, found {list(value)!r}")
    if sum(value) <= 0:
        raise ValueError(f"expected at least one weight > 0, found {list(value)!r}")


_weights.__doc__ = "each >= 0, one per dataset"


@attrs.frozen
class MixConfig:
    """Options of ``[data]`` when ``strategy = "mix"``."""

    weights: list[float] | None = option(
        None, help="one weight per dataset of job.data_paths (any scale); excludes temperature", validator=_weights
    )
    temperature: float | None = option(
        None, help="p_i ∝ n_i^(1/T) over the datasets' document counts (default 1: by size); excludes weights",
        validator=gt(0),
    )
    shuffle: bool = option(True, help="a new seeded order of each dataset's documents every epoch (false: in order)")
    seed_offset: int = option(0, help="added to the job's seed, to get other draws", validator=ge(0))

    def __attrs_post_init__(self) -> None:
        if self.weights is not None and self.temperature is not None:
            raise OptionError("temperature", "give either weights or temperature, not both")


def temperature_probabilities(sizes: Sequence[int], temperature: float) -> list[float]:
    """``p_i = n_i^(1/T) / sum_j n_j^(1/T)`` (empty datasets get 0)."""
    # In log space, so huge sizes and small temperatures do not overflow.
    logs = [math.log(n) / temperature if n > 0 else -math.inf for n in sizes]
    top = max(logs)
    raw = [math.exp(x - top) if x > -math.inf else 0.0 for x in logs]
    total = sum(raw)
    return [r / total for r in raw]


class Mix:
    """A :class:`skyrl_host.interfaces.DataStrategy` mixing datasets by probability."""

    def __init__(self, config: MixConfig | None = None):
        self.config = config or MixConfig()
        self.probabilities: list[float] = []
        self._cumulative: list[float] = []
        self._sizes: list[int] = []
        self._perms: list[Permutation | None] = []
        self._choices = BlockCache(self._fill_choices)
        self._docs: list[BlockCache] = []
        self.seed = 0
        self.draws = 0
        self.streams: list[list[int]] = []  # per dataset: [epoch, position]

    def bind(self, lengths: Sequence[Any], seed: int) -> None:
        sizes = sizes_of(lengths)
        cfg = self.config
        if cfg.weights is not None:
            if len(cfg.weights) != len(sizes):
                raise ValueError(f"weights has {len(cfg.weights)} entries but there are {len(sizes)} datasets")
            empty = [i for i, (w, n) in enumerate(zip(cfg.weights, sizes)) if w > 0 and n == 0]
            if empty:
                raise ValueError(f"dataset {empty[0]} has weight {cfg.weights[empty[0]]} but no documents")
            total = float(sum(cfg.weights))
            probs = [w / total for w in cfg.weights]
        else:
            probs = temperature_probabilities(sizes, cfg.temperature if cfg.temperature is not None else 1.0)
        self.probabilities = probs
        self._cumulative = list(itertools.accumulate(probs))
        self._sizes = sizes
        self.seed = seed + cfg.seed_offset
        self.draws = 0
        self.streams = [[0, 0] for _ in sizes]
        self._perms = [self._permutation(d) for d in range(len(sizes))]
        self._choices = BlockCache(self._fill_choices)
        self._docs = [BlockCache(self._fill_docs(d)) for d in range(len(sizes))]

    def _permutation(self, d: int) -> Permutation | None:
        if not self.config.shuffle or self._sizes[d] == 0:
            return None
        return Permutation(self._sizes[d], epoch_key(self.seed, d, self.streams[d][0]))

    def _fill_choices(self, _key: Any, start: int, stop: int) -> list[int]:
        """The datasets of draws ``start..stop-1``: inverse CDF of a hash of (seed, draw)."""
        import numpy as np

        u = uniforms((self.seed, CHOICE_STREAM), start, stop)
        cumulative = np.asarray(self._cumulative)
        d = np.minimum(np.searchsorted(cumulative, u * cumulative[-1], side="right"), len(self._sizes) - 1)
        out = d.tolist()
        for k, x in enumerate(out):
            while self.probabilities[x] == 0.0:  # only reachable through rounding at an edge
                x = (x - 1) % len(self._sizes)
            out[k] = x
        return out

    def _fill_docs(self, d: int) -> Any:
        def fill(_epoch: int, start: int, stop: int) -> list[int]:
            perm = self._perms[d]
            return perm.block(start, stop).tolist() if perm is not None else list(range(start, stop))

        return fill

    def draw(self, step: int) -> tuple[int, int]:
        if not self._sizes:
            raise RuntimeError("draw() before bind()")
        choices, j = self._choices.get(0, self.draws, ENDLESS)
        d = choices[j]
        self.draws += 1
        epoch, position = self.streams[d]
        docs, i = self._docs[d].get(epoch, position, self._sizes[d])
        doc = docs[i]
        if position + 1 == self._sizes[d]:
            self.streams[d] = [epoch + 1, 0]
            self._perms[d] = self._permutation(d)
        else:
            self.streams[d] = [epoch, position + 1]
        return d, doc

    def state_dict(self) -> Mapping[str, Any]:
        return {"draws": self.draws, "streams": [list(s) for s in self.streams]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, ("draws", "streams"), "mix")
        if len(state["streams"]) != len(self._sizes):
            raise ValueError(f"the state is of {len(state['streams'])} datasets, this job has {len(self._sizes)}")
        self.draws = int(state["draws"])
        self.streams = [[int(e), int(p)] for e, p in state["streams"]]
        self._perms = [self._permutation(d) for d in range(len(self._sizes))]
        self._docs = [BlockCache(self._fill_docs(d)) for d in range(len(self._sizes))]


@hookimpl
def skyrl_register_data_strategies(register: Any) -> None:
    register(
        "mix",
        Mix,
        config=MixConfig,
        description="Mix datasets by weights or by temperature over their sizes; each shuffled per epoch",
    )

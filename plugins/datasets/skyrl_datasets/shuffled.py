"""shuffled: every document once per epoch, in a new random order each epoch.

``[data] strategy = "shuffled"``. All datasets form one pool of documents; epoch
``e`` visits the pool in the order of a pseudo-random permutation chosen by
(seed, e), so an epoch never repeats or skips a document and the order is the same
on every run with the same seed.

Memory: none per document. The permutation is a Feistel network evaluated for a
block of 4,096 positions at a time (``skyrl_datasets._order.Permutation``), so a pool
of 10^9 documents costs what a pool of 10 does; the checkpointed position is two
numbers.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import ge, option
from skyrl_datasets._order import BlockCache, Concatenation, Permutation, check_state, epoch_key, sizes_of

STREAM = 0x5EF  # the permutation stream of the whole pool (mix uses one per dataset)


@attrs.frozen
class ShuffledConfig:
    """Options of ``[data]`` when ``strategy = "shuffled"``."""

    seed_offset: int = option(0, help="added to the job's seed, to get another order", validator=ge(0))


class Shuffled:
    """A :class:`skyrl_host.interfaces.DataStrategy`: a new permutation of all
    documents each epoch."""

    def __init__(self, config: ShuffledConfig | None = None):
        self.config = config or ShuffledConfig()
        self._docs: Concatenation | None = None
        self._perm: Permutation | None = None
        self._cache = BlockCache(self._fill)
        self.seed = 0
        self.epoch = 0
        self.position = 0

    def bind(self, lengths: Sequence[Any], seed: int) -> None:
        self._docs = Concatenation(sizes_of(lengths))
        self.seed = seed + self.config.seed_offset
        self._start_epoch(0, 0)

    def _start_epoch(self, epoch: int, position: int) -> None:
        assert self._docs is not None
        self.epoch, self.position = epoch, position
        self._perm = Permutation(self._docs.total, epoch_key(self.seed, STREAM, epoch))
        self._cache = BlockCache(self._fill)

    def _fill(self, epoch: int, start: int, stop: int) -> tuple[list[int], list[int]]:
        assert self._docs is not None and self._perm is not None
        datasets, docs = self._docs.locate_many(self._perm.block(start, stop))
        return datasets.tolist(), docs.tolist()

    def draw(self, step: int) -> tuple[int, int]:
        if self._docs is None or self._perm is None:
            raise RuntimeError("draw() before bind()")
        (datasets, docs), j = self._cache.get(self.epoch, self.position, self._docs.total)
        picked = (datasets[j], docs[j])
        if self.position + 1 == self._docs.total:
            self._start_epoch(self.epoch + 1, 0)
        else:
            self.position += 1
        return picked

    def state_dict(self) -> Mapping[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, ("epoch", "position"), "shuffled")
        self._start_epoch(int(state["epoch"]), int(state["position"]))


@hookimpl
def skyrl_register_data_strategies(register: Any) -> None:
    register(
        "shuffled",
        Shuffled,
        config=ShuffledConfig,
        description="Every document once per epoch, in a new seeded order each epoch (O(1) memory)",
    )

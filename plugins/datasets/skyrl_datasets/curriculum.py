"""curriculum: short documents first, the length limit growing over the steps.

``[data] strategy = "curriculum"``: an example of a custom strategy shipped as a
plugin (docs/sft.md shows how to write one). The limit of step ``s`` grows
linearly from ``start_max_len`` at step 1 to ``end_max_len`` at step
``1 + ramp_steps`` and stays there. Documents come in a new seeded permutation of
all datasets each epoch, as with ``shuffled``, except that a document longer than
the current limit is passed over for the rest of that epoch (it comes round again
in the next epoch, when the limit may admit it).

Each draw reads lengths until it finds a short enough document: cheap while most
documents fit, slower when the limit admits few of them. The checkpointed
position is two numbers. A ``start_max_len`` below the shortest document (step 1
could draw nothing) is refused when the strategy is bound to the datasets, as an
:class:`~skyrl_host.config.OptionError` at ``start_max_len`` (a user error).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import OptionError, ge, gt, option
from skyrl_datasets._order import BlockCache, Concatenation, Permutation, check_state, epoch_key, sizes_of

STREAM = 0xC0C  # its own permutation stream, so the order differs from shuffled's


@attrs.frozen
class CurriculumConfig:
    """Options of ``[data]`` when ``strategy = "curriculum"``."""

    start_max_len: int = option(64, help="longest document (tokens) drawn at step 1", validator=gt(0))
    end_max_len: int | None = option(
        None, help="longest document once the ramp is over (default: the longest document of the datasets)",
        validator=gt(0),
    )
    ramp_steps: int = option(100, help="steps over which the limit grows linearly from start to end", validator=gt(0))
    seed_offset: int = option(0, help="added to the job's seed, to get another order", validator=ge(0))

    def __attrs_post_init__(self) -> None:
        if self.end_max_len is not None and self.end_max_len < self.start_max_len:
            raise OptionError("end_max_len", f"expected at least start_max_len ({self.start_max_len}), found {self.end_max_len}")


class Curriculum:
    """A :class:`skyrl_host.interfaces.DataStrategy`: shuffled epochs, filtered by a
    length limit that grows with the step."""

    def __init__(self, config: CurriculumConfig | None = None):
        self.config = config or CurriculumConfig()
        self._lengths: Sequence[Any] = ()
        self._docs: Concatenation | None = None
        self._perm: Permutation | None = None
        self._cache = BlockCache(self._fill)
        self.end_max_len = 0
        self.seed = 0
        self.epoch = 0
        self.position = 0

    def bind(self, lengths: Sequence[Any], seed: int) -> None:
        self._docs = Concatenation(sizes_of(lengths))
        self._lengths = lengths
        cfg = self.config
        import numpy as np

        # A pass over the length arrays for the shortest document, another for the
        # longest when no end is given.
        shortest = min(int(np.asarray(x).min()) for x in lengths if len(x))
        if shortest > cfg.start_max_len:
            # Step 1 could draw nothing: a job-file problem, located at the key by the driver.
            raise OptionError(
                "start_max_len",
                f"no document of at most {cfg.start_max_len} tokens: the shortest of the datasets has {shortest}; "
                f"raise start_max_len to at least {shortest}",
            )
        self.end_max_len = cfg.end_max_len or max(int(x.max()) if len(x) else 0 for x in lengths)
        self.end_max_len = max(self.end_max_len, cfg.start_max_len)
        self.seed = seed + cfg.seed_offset
        self._start_epoch(0, 0)

    def _start_epoch(self, epoch: int, position: int) -> None:
        assert self._docs is not None
        self.epoch, self.position = epoch, position
        self._perm = Permutation(self._docs.total, epoch_key(self.seed, STREAM, epoch))
        self._cache = BlockCache(self._fill)

    def _fill(self, epoch: int, start: int, stop: int) -> tuple[list[int], list[int], list[int]]:
        import numpy as np

        assert self._docs is not None and self._perm is not None
        datasets, docs = self._docs.locate_many(self._perm.block(start, stop))
        lengths = np.zeros(len(docs), dtype=np.int64)
        for d in np.unique(datasets):
            where = datasets == d
            lengths[where] = np.asarray(self._lengths[int(d)])[docs[where]]
        return datasets.tolist(), docs.tolist(), lengths.tolist()

    def max_len(self, step: int) -> int:
        """The length limit of ``step`` (counting from 1)."""
        cfg = self.config
        progress = min(1.0, max(0, step - 1) / cfg.ramp_steps)
        return int(cfg.start_max_len + (self.end_max_len - cfg.start_max_len) * progress)

    def draw(self, step: int) -> tuple[int, int]:
        if self._docs is None or self._perm is None:
            raise RuntimeError("draw() before bind()")
        limit = self.max_len(step)
        for _ in range(self._docs.total):
            (datasets, docs, lengths), j = self._cache.get(self.epoch, self.position, self._docs.total)
            if self.position + 1 == self._docs.total:
                self._start_epoch(self.epoch + 1, 0)
            else:
                self.position += 1
            if lengths[j] <= limit:
                return datasets[j], docs[j]
        raise ValueError(f"no document of at most {limit} tokens (step {step}): raise start_max_len")  # bind() checks

    def state_dict(self) -> Mapping[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, ("epoch", "position"), "curriculum")
        self._start_epoch(int(state["epoch"]), int(state["position"]))


@hookimpl
def skyrl_register_data_strategies(register: Any) -> None:
    register(
        "curriculum",
        Curriculum,
        config=CurriculumConfig,
        description="Example custom strategy: short documents first, the length limit growing over the steps",
    )

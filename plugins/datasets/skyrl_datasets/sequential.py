"""sequential: every document in order, dataset after dataset, then again.

``[data] strategy = "sequential"`` (the ``sft`` job's default). The first epoch reads
dataset 0's documents 0, 1, 2, ..., then dataset 1's, and so on; the next epoch
starts over. The checkpointed position is two numbers.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from skyrl_host import hookimpl
from skyrl_datasets._order import Concatenation, check_state, sizes_of


class Sequential:
    """A :class:`skyrl_host.interfaces.DataStrategy` reading documents in order."""

    def __init__(self, config: Any = None):
        self.config = config
        self._docs: Concatenation | None = None
        self.epoch = 0
        self.position = 0  # global index of the next document within the epoch

    def bind(self, lengths: Sequence[Any], seed: int) -> None:
        self._docs = Concatenation(sizes_of(lengths))
        self.epoch, self.position = 0, 0

    def draw(self, step: int) -> tuple[int, int]:
        if self._docs is None:
            raise RuntimeError("draw() before bind()")
        picked = self._docs.locate(self.position)
        self.position += 1
        if self.position == self._docs.total:
            self.epoch, self.position = self.epoch + 1, 0
        return picked

    def state_dict(self) -> Mapping[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, ("epoch", "position"), "sequential")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


@hookimpl
def skyrl_register_data_strategies(register: Any) -> None:
    register("sequential", Sequential, description="Every document in order, dataset after dataset, epoch after epoch")

"""Receivers that run inside an engine's own worker processes (vLLM's workers:
:class:`skyrl_host.interfaces.WorkerReceiving`), as the process holding the engine sees
them: a recipe the workers build their receiver from, and the engine's calls that drive
them."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from skyrl_host.errors import JobFailed


class InWorkers:
    """A transport's receiving half that the engine's workers run: ``sync(engine, target)``
    has them fetch version ``target`` (beside generation) and apply it (all of them, or
    none). ``join``: build the receivers now (a collective recipe's members join their
    group here, so the sender must be joining it meanwhile)."""

    def __init__(self, engine: Any, recipe: Mapping[str, Any], *, join: bool = False):
        self.recipe = dict(recipe)
        if join:
            engine.init_workers(self.recipe)

    def sync(self, engine: Any, target: int | None = None, **_unused: Any) -> dict[str, float]:
        if target is None:
            raise ValueError("a receiver in the engine's workers needs the version to fetch (target=)")
        return dict(engine.receive_in_workers(self.recipe, int(target)))

    def close(self) -> None:
        pass


def together(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run the two halves of one transfer at once (each blocks until the other takes its
    part: a group's members joining, a broadcast sent and received) and return both
    results. When one half fails the other is still waited for (it fails too, at the
    latest when its own timeout runs out: a collective's, an HTTP request's), so nothing
    of this transfer is left running; then the first error is raised."""
    outcomes: list[tuple[bool, Any] | None] = [None, None]
    order: list[int] = []

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            outcomes[i] = (True, fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcomes[i] = (False, exc)
        order.append(i)

    threads = [threading.Thread(target=run, args=(i, fn), name=f"skyrl-transfer-{i}", daemon=True)
               for i, fn in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The cause: a job-level failure (a lost server) if either half names one, else the
    # first to fail (the other usually failed waiting for it).
    errors = [outcomes[i][1] for i in order if not outcomes[i][0]]  # type: ignore[index]
    if errors:
        raise next((e for e in errors if isinstance(e, JobFailed)), errors[0])
    return outcomes[0][1], outcomes[1][1]  # type: ignore[index]

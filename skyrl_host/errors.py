"""User errors: mistakes a person can fix (a bad job file, an unknown plugin name,
a missing file). The CLI prints them without a traceback and exits with code 2.

Faults (a bug, a dead worker, a corrupt payload) are ordinary exceptions and keep
their tracebacks.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Sequence

import attrs

USER_ERROR_EXIT_CODE = 2


@attrs.frozen
class Problem:
    """One thing wrong, located as precisely as the host can."""

    message: str
    file: str | None = None
    key: str | None = None  # dotted key path, e.g. "algorithm.clip_low"
    line: int | None = None

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "")
        if self.key:
            where = f"{where}: {self.key}" if where else self.key
        return f"{where}: {self.message}" if where else self.message


class UserError(Exception):
    """One or more problems a user can fix; never shown with a traceback."""

    def __init__(self, problems: str | Problem | Sequence[Problem]):
        if isinstance(problems, str):
            problems = [Problem(problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        if len(self.problems) == 1:
            return f"error: {self.problems[0]}"
        lines = [f"error: {len(self.problems)} problems"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(word), sorted(set(choices)), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def quoted_list(names: Iterable[str]) -> str:
    names = sorted(set(names))
    return ", ".join(repr(n) for n in names) if names else "(none)"


class JobFailed(Exception):
    """A job ran and reached a verdict of failure (a check that did not pass), or stopped
    because something it depends on is gone (an inference server that died).

    The CLI prints its message without a traceback and exits with code 1."""


class ProcessLost(JobFailed):
    """A process the job placed (a Ray actor and its node, an inference server) is gone.
    The run's checkpoints are intact: ``skyrl run JOB --resume`` continues from the last
    one, and ``[cluster] max_restarts = N`` makes the job do so by itself up to N times."""

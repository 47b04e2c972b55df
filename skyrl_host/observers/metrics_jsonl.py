"""Writes one JSON line per step to ``<output_dir>/metrics.jsonl``.

Each line is written and flushed whole, so a crash leaves every finished step on
disk; a reader of a running job's file may see the line being written in part (one
write is not atomic for readers), which :func:`read_metrics` leaves out. The first line of a run is a header record
(``{"event": "start", ...}``) and the last one says how the job ended.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Mapping

from skyrl_host import hookimpl

FILENAME = "metrics.jsonl"


def _append(path: Any, record: Mapping[str, Any]) -> None:
    line = json.dumps({k: _finite(v) for k, v in record.items()}, allow_nan=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf; keep them readable rather than writing invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _truncate_after(path: Any, step: int) -> None:
    """Keep the records up to ``step`` (a resumed run rewrites the steps after it)."""
    if not path.exists():
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a torn last line from a killed run
            row = json.loads(line)
            if "step" in row and "event" not in row and row["step"] > step:
                break
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


@hookimpl
def skyrl_job_started(run: Any) -> None:
    path = run.output_dir / FILENAME
    record = {"event": "start", "time": time.time(), "job": run.spec.name, "kind": run.spec.kind.name, "steps": run.total_steps}
    if run.resuming:
        _truncate_after(path, run.resume_step)
        record.update(event="resume", from_step=run.resume_step)
    _append(path, record)


@hookimpl
def skyrl_step_finished(run: Any, step: int, metrics: Mapping[str, Any]) -> None:
    _append(run.output_dir / FILENAME, {"step": step, "time": time.time(), **metrics})


@hookimpl
def skyrl_job_finished(run: Any, status: str, error: BaseException | None) -> None:
    record = {"event": "end", "time": time.time(), "status": status, "last_step": run.last_step}
    if error is not None:
        record["error"] = f"{type(error).__name__}: {error}"
    _append(run.output_dir / FILENAME, record)


def read_metrics(path: Any) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl file (header and end records left out). A last
    line without its newline is left out: one being written while this reads it (a
    reader watching a running job sees a write in progress), or torn by a killed run."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            row = json.loads(line)
            if "step" in row and "event" not in row:
                rows.append(row)
    return rows

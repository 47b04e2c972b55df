"""Running a validated job: the output folder, the driver, the lifecycle hooks."""

from __future__ import annotations

import json
import numbers
import pathlib
import shutil
import time
from typing import Any, Callable, Mapping

import attrs
import cattrs

from skyrl_host.checkpoints import JOB_RECORD, latest_checkpoint, read_job_record, resume_mismatches
from skyrl_host.config import JobSpec, PluginChoice
from skyrl_host.errors import ProcessLost, Problem, UserError
from skyrl_host.plugins import PluginHost

RUN_RECORD = JOB_RECORD


@attrs.define
class Run:
    """One execution of a job: what drivers and observers see."""

    spec: JobSpec
    host: PluginHost
    output_dir: pathlib.Path
    total_steps: int
    scratch: dict[str, Any] = attrs.field(factory=dict)  # observers keep state here, by plugin name
    headline: list[str] = attrs.field(factory=list)  # metric names the progress display shows first
    resuming: bool = False  # `skyrl run --resume`
    resume_step: int = 0  # the step of the checkpoint the driver resumes from (0: from scratch)
    resume_path: pathlib.Path | None = None
    last_step: int = 0
    started_at: float = attrs.field(factory=time.monotonic)
    observers: list[Any] = attrs.field(factory=list)  # [observers] use, made and started (interfaces.Observer)
    _reported: bool = attrs.field(default=False, init=False, repr=False)

    @property
    def job(self) -> JobSpec:
        return self.spec

    def plugin(self, table: str) -> PluginChoice | tuple[PluginChoice, ...]:
        """The plugin (or plugins) selected by ``[table]``."""
        return self.spec.plugins[table]

    def launcher(self) -> Any:
        """The ``[cluster] launcher`` plugin, made for this run (a Launcher)."""
        if self.spec.launcher is None:
            raise UserError("[cluster]: no launcher is selected (is the host's 'local' launcher blocked?)")
        return self.spec.launcher.create(self.spec.cluster)

    def report(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Called by drivers once per step: checks the metrics and fires
        ``skyrl_step_finished``. Steps increase; a new run may report step 0 first (what
        it measured before training, e.g. an evaluation of the starting weights)."""
        first_zero = step == 0 == self.last_step and not self._reported  # e.g. an evaluation before training
        if step <= self.last_step and not first_zero:
            raise ValueError(f"steps must increase: step {step} reported after step {self.last_step}")
        clean: dict[str, float | int] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"metric {key!r} must map a name to a number, got {value!r}")
            clean[key] = int(value) if isinstance(value, numbers.Integral) else float(value)
        self.last_step, self._reported = step, True
        self.host.pm.hook.skyrl_step_finished(run=self, step=step, metrics=clean)
        for observer in self.observers:
            observer.step_finished(self, step, clean)


def describe_spec(spec: JobSpec) -> dict[str, Any]:
    """A JSON-able record of the resolved job: configs and plugin origins."""
    conv = cattrs.Converter()

    def entry(choice: PluginChoice) -> dict[str, Any]:
        return {
            "name": choice.name,
            "plugin": choice.registration.origin.plugin,
            "distribution": choice.registration.origin.distribution,
            "version": choice.registration.origin.version,
            "config": conv.unstructure(choice.config) if choice.config is not None else {},
            **({"chosen_by": choice.chosen_by} if choice.chosen_by else {}),
        }

    plugins: dict[str, Any] = {}
    for choice in spec.choices():
        plugins.setdefault(choice.slot, []).append(entry(choice))
    return {
        "file": str(spec.path),
        "name": spec.name,
        "job": conv.unstructure(spec.job),
        "kind": {
            "name": spec.kind.name,
            "plugin": spec.kind.origin.plugin,
            "distribution": spec.kind.origin.distribution,
            "version": spec.kind.origin.version,
            "config": conv.unstructure(spec.kind_config) if spec.kind_config is not None else {},
        },
        "cluster": conv.unstructure(spec.cluster),
        "launcher": entry(spec.launcher) if spec.launcher is not None else None,  # [cluster] launcher, its own keys
        **({"eval": conv.unstructure(spec.eval)} if spec.eval is not None else {}),  # its dataset: plugins["eval"]
        **({"teacher": conv.unstructure(spec.teacher)} if spec.teacher is not None else {}),  # plugins["teacher"]
        "plugins": plugins,
    }


def prepare_output_dir(spec: JobSpec, overwrite: bool, resume: bool = False) -> pathlib.Path:
    out = spec.output_dir
    where = {"file": str(spec.path), "key": "job.output_dir"}
    if out.exists() and not out.is_dir():
        raise UserError(Problem(f"output folder {str(out)!r} exists and is not a folder", **where))
    if resume:
        if not (out / RUN_RECORD).exists():
            raise UserError(Problem(f"--resume: {str(out)!r} holds no run to resume", **where))
        previous = read_job_record(out / RUN_RECORD) or {}
        if previous.get("kind", {}).get("name") != spec.kind.name:
            raise UserError(
                Problem(f"--resume: {str(out)!r} holds a {previous.get('kind', {}).get('name')!r} run, not {spec.kind.name!r}", **where)
            )
        return out
    if (out / RUN_RECORD).exists():
        if not overwrite:
            raise UserError(
                Problem(
                    f"{str(out)!r} already holds a run; pass --resume to continue it, --overwrite to replace it, "
                    f"or choose another folder with --set job.output_dir=...",
                    **where,
                )
            )
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(Problem(f"cannot create output folder: {exc}", **where)) from None
    return out


def _line_of(spec: JobSpec, key: str) -> int | None:
    """The line of ``key`` in the job file, when the file gave it its value (not --set)."""
    import tomllib

    from skyrl_host.config import locate_keys

    try:
        text = spec.path.read_text()
        data: Any = tomllib.loads(text)
    except (OSError, ValueError):
        return None
    raw: Any = spec.raw
    for part in key.split("."):
        if not (isinstance(data, Mapping) and isinstance(raw, Mapping) and part in data and part in raw):
            return None
        data, raw = data[part], raw[part]
    return locate_keys(text).get(key) if data == raw else None


def check_resume(spec: JobSpec, out: pathlib.Path, current: Mapping[str, Any]) -> None:
    """A user error unless the checkpoint ``--resume`` continues from (else the run in
    ``out``) was written by this job: same kind, model (family and config) and backend.

    The checkpoint's own ``job.json`` is compared when it has one (a checkpoint copied
    from another run is caught too); the output folder's record otherwise."""
    found = latest_checkpoint(out)
    recorded, source = None, None
    if found is not None:
        recorded, source = read_job_record(found[1] / JOB_RECORD), f"checkpoint {str(found[1])!r}"
    if recorded is None:
        recorded = read_job_record(out / RUN_RECORD)
        source = f"checkpoint {str(found[1])!r}" if found is not None else f"the run in {str(out)!r}"
    if recorded is None:
        return
    problems = [
        Problem(f"--resume: {source} belongs to another job: {what}", file=str(spec.path), key=key,
                line=_line_of(spec, key))
        for key, what in resume_mismatches(recorded, current)
    ]
    if problems:
        raise UserError(problems)


def run_job(host: PluginHost, spec: JobSpec, *, overwrite: bool = False, resume: bool = False) -> Run:
    """Run ``spec``'s driver between ``skyrl_job_started`` and ``skyrl_job_finished``.

    With ``resume``, the run continues in its output folder from the latest
    complete checkpoint (``run.resume_step``; 0 when there is none)."""
    if overwrite and resume:
        raise UserError("--overwrite and --resume exclude each other")
    out = prepare_output_dir(spec, overwrite, resume)
    described = describe_spec(spec)
    if resume:  # before the record is replaced: the job that wrote the run and its checkpoints
        check_resume(spec, out, json.loads(json.dumps(described, default=str)))
    record = json.dumps(described, indent=2, default=str)
    tmp = out / (RUN_RECORD + ".tmp")
    tmp.write_text(record + "\n")
    tmp.replace(out / RUN_RECORD)

    run = Run(spec=spec, host=host, output_dir=out, total_steps=spec.job.steps, resuming=resume)
    if resume:
        found = latest_checkpoint(out)
        if found is not None:
            run.resume_step, run.resume_path = found
            run.last_step = run.resume_step
    hook = host.pm.hook
    status, error = "failed", None
    try:
        hook.skyrl_job_started(run=run)
        for choice in spec.plugins.get("observers", ()):  # type: ignore[union-attr]
            observer = choice.create()
            observer.started(run)
            run.observers.append(observer)
        driver = spec.kind.create(run)
        driver.run()
        status = "completed"
    except KeyboardInterrupt as exc:
        status, error = "interrupted", exc
        raise
    except BaseException as exc:
        status, error = "failed", exc
        raise
    finally:
        try:
            hook.skyrl_job_finished(run=run, status=status, error=error)
        finally:
            _finish_observers(run, status, error)
    return run


def run_restarting(host: PluginHost, spec: JobSpec, *, overwrite: bool = False, resume: bool = False,
                   notice: Callable[[str], None] = print) -> Run:
    """:func:`run_job`, and again with ``resume`` each time it stops on a
    :class:`~skyrl_host.errors.ProcessLost`, up to ``[cluster] max_restarts`` times
    (``notice`` is told of each restart)."""
    restarts = 0
    while True:
        try:
            return run_job(host, spec, overwrite=overwrite and restarts == 0, resume=resume or restarts > 0)
        except ProcessLost as exc:
            if restarts >= spec.cluster.max_restarts:
                raise
            restarts += 1
            notice(f"notice: {exc}; resuming from the last checkpoint (restart {restarts} of "
                   f"{spec.cluster.max_restarts}, [cluster] max_restarts)")


def _finish_observers(run: Run, status: str, error: BaseException | None) -> None:
    """``finished`` for every started observer, in reverse order, even when one fails
    (the first failure is raised after all were told, unless the job failed already:
    its error is the one to see)."""
    failure = None
    while run.observers:
        observer = run.observers.pop()
        try:
            observer.finished(run, status, error)
        except BaseException as exc:  # noqa: BLE001 - the others still end their runs
            failure = failure or exc
    if failure is not None and error is None:
        raise failure

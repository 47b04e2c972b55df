"""Logs the run to MLflow when the job says ``[job] mlflow = true`` (needs
``pip install 'skyrl-host[mlflow]'``).

The run goes to ``[job] mlflow_tracking_uri`` (default: a local file store,
``file:<output_dir>/mlruns``), experiment ``[job] mlflow_experiment``. The resolved job
(``job.json``) is logged flattened as params (``job.seed``, ``kind.config.batch_size``,
...) and whole as the artifact ``job.json``; every step's metrics at their step; the final
status as the tag ``skyrl.status`` and the run's status (FINISHED, FAILED, or KILLED when
interrupted). The run id is kept in ``<output_dir>/mlflow_run_id`` so ``skyrl run
--resume`` continues the same run, logging only the steps after those it already holds.

MLflow 3 keeps its file store behind ``MLFLOW_ALLOW_FILE_STORE``; for a ``file:`` URI
this observer sets it (unless the environment already says otherwise). MLflow is
imported only here, through ``MlflowClient`` (no fluent API, no global active run).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator, Mapping

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError

KEY = "mlflow"
FOLDER = "mlruns"
RUN_ID_FILE = "mlflow_run_id"
MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value's length
BATCH = 100  # params per log_batch call (MLflow allows at most 100)

#: MLflow's run status for each status of skyrl_job_finished.
RUN_STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


def tracking_uri(run: Any) -> str:
    """The job's MLflow tracking URI: ``[job] mlflow_tracking_uri`` or the local file store."""
    return run.spec.job.mlflow_tracking_uri or (run.output_dir / FOLDER).resolve().as_uri()


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri and ":" not in uri.split("/", 1)[0]


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, text)`` for each leaf of a JSON value (lists by index)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{i}")
    elif prefix:
        text = value if isinstance(value, str) else json.dumps(value)
        yield prefix, text[:MAX_PARAM_VALUE]


def _job_record(run: Any) -> dict[str, Any]:
    try:
        return json.loads((run.output_dir / "job.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _last_logged_step(client: Any, run_id: str) -> int:
    data = client.get_run(run_id).data
    return max((m.step for key in data.metrics for m in client.get_metric_history(run_id, key)), default=0)


@hookimpl
def skyrl_job_started(run: Any) -> None:
    job = run.spec.job
    if not job.mlflow:
        return
    uri = tracking_uri(run)
    if _is_file_store(uri):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UserError(
            Problem(
                "mlflow = true needs MLflow: pip install \"skyrl-host[mlflow]\"",
                file=str(run.spec.path),
                key="job.mlflow",
            )
        ) from None
    client = MlflowClient(tracking_uri=uri)
    id_file = run.output_dir / RUN_ID_FILE
    run_id = id_file.read_text(encoding="utf-8").strip() if run.resuming and id_file.exists() else ""
    logged_through = 0
    if run_id:
        client.update_run(run_id, status="RUNNING")
        logged_through = _last_logged_step(client, run_id)
        held = client.get_run(run_id).data.params
    else:
        experiment = client.get_experiment_by_name(job.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id if experiment is not None else client.create_experiment(job.mlflow_experiment)
        )
        run_id = client.create_run(experiment_id, run_name=run.spec.name).info.run_id
        id_file.write_text(run_id + "\n", encoding="utf-8")
        held = {}
    record = _job_record(run)
    # A param cannot change once logged: a resumed run adds the keys it lacks (the
    # artifact job.json holds the job as it is now).
    params = [Param(k, v) for k, v in flatten(record) if k not in held]
    for i in range(0, len(params), BATCH):
        client.log_batch(run_id, params=params[i : i + BATCH], synchronous=True)
    client.log_dict(run_id, record, "job.json")
    run.scratch[KEY] = {"client": client, "run_id": run_id, "logged_through": logged_through}


@hookimpl
def skyrl_step_finished(run: Any, step: int, metrics: Mapping[str, Any]) -> None:
    state = run.scratch.get(KEY)
    if state is None or step <= state["logged_through"]:
        return  # a resumed run's steps that the MLflow run already holds
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(name, float(value), now, step) for name, value in metrics.items()]
    for i in range(0, len(batch), 1000):
        state["client"].log_batch(state["run_id"], metrics=batch[i : i + 1000], synchronous=True)


@hookimpl
def skyrl_job_finished(run: Any, status: str, error: BaseException | None) -> None:
    state = run.scratch.pop(KEY, None)
    if state is None:
        return
    client, run_id = state["client"], state["run_id"]
    client.set_tag(run_id, "skyrl.status", status)
    client.set_tag(run_id, "skyrl.last_step", str(run.last_step))
    if error is not None:
        client.set_tag(run_id, "skyrl.error", f"{type(error).__name__}: {error}"[:5000])
    client.set_terminated(run_id, status=RUN_STATUS.get(status, "FAILED"))

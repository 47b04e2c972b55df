"""Logs the run to MLflow when the job lists the observer (``[observers] use =
["mlflow"]``; its keys in ``[observers.mlflow]``; needs ``pip install 'skyrl-host[mlflow]'``).

The run goes to ``tracking_uri`` (default: a local file store,
``file:<output_dir>/mlruns``), experiment ``experiment``. The resolved job
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

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError
from skyrl_host.options import option

FOLDER = "mlruns"
RUN_ID_FILE = "mlflow_run_id"
MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value's length
BATCH = 100  # params per log_batch call (MLflow allows at most 100)

#: MLflow's run status for each status of skyrl_job_finished.
RUN_STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


@attrs.frozen
class MlflowOptions:
    tracking_uri: str | None = option(None, help="the MLflow tracking URI (default: a local file store, file:<output_dir>/mlruns)")
    experiment: str = option("skyrl", help="the MLflow experiment of the run")


def tracking_uri(config: MlflowOptions, run: Any) -> str:
    """The job's MLflow tracking URI: ``tracking_uri`` or the local file store."""
    return config.tracking_uri or (run.output_dir / FOLDER).resolve().as_uri()


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
    return max((m.step for key in data.metrics for m in client.get_metric_history(run_id, key)), default=-1)


class Mlflow:
    def __init__(self, config: MlflowOptions) -> None:
        self.config = config
        self.client: Any = None
        self.run_id = ""
        self.logged_through = -1  # a new run logs from step 0 (an evaluation before training) on

    def started(self, run: Any) -> None:
        uri = tracking_uri(self.config, run)
        if _is_file_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise UserError(
                Problem(
                    "the mlflow observer needs MLflow: pip install \"skyrl-host[mlflow]\"",
                    file=str(run.spec.path),
                    key="observers.use",
                )
            ) from None
        client = MlflowClient(tracking_uri=uri)
        id_file = run.output_dir / RUN_ID_FILE
        run_id = id_file.read_text(encoding="utf-8").strip() if run.resuming and id_file.exists() else ""
        if run_id:
            client.update_run(run_id, status="RUNNING")
            self.logged_through = _last_logged_step(client, run_id)
            held = client.get_run(run_id).data.params
        else:
            experiment = client.get_experiment_by_name(self.config.experiment)
            experiment_id = (
                experiment.experiment_id if experiment is not None else client.create_experiment(self.config.experiment)
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
        self.client, self.run_id = client, run_id

    def step_finished(self, run: Any, step: int, metrics: Mapping[str, Any]) -> None:
        if step <= self.logged_through:
            return  # a resumed run's steps that the MLflow run already holds
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name, float(value), now, step) for name, value in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000], synchronous=True)

    def finished(self, run: Any, status: str, error: BaseException | None) -> None:
        client, run_id = self.client, self.run_id
        client.set_tag(run_id, "skyrl.status", status)
        client.set_tag(run_id, "skyrl.last_step", str(run.last_step))
        if error is not None:
            client.set_tag(run_id, "skyrl.error", f"{type(error).__name__}: {error}"[:5000])
        client.set_terminated(run_id, status=RUN_STATUS.get(status, "FAILED"))


@hookimpl
def skyrl_register_observers(register: Any) -> None:
    register("mlflow", Mlflow, config=MlflowOptions, description="an MLflow run (pip install \"skyrl-host[mlflow]\")")
